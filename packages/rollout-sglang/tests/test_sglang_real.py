"""Our side of the contract against the real code of the pinned sglang (0.5.23), where it runs
on a CPU: its request types, its multimodal processor's placeholder expansion and its Qwen3-VL
weight loader's renaming.

Marked ``sglang``; skipped where ``sglang.srt`` cannot be imported. To run them on a CPU
machine (sglang itself is not installed there), put the wheel's source and its light
dependencies on PYTHONPATH, as the rollout-sglang README ("The SGLang contract") describes::

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl && unzip -q /tmp/sgl/sglang-*.whl -d /tmp/sgl/src
    pip install --no-deps --target /tmp/sgl/deps <the packages that README lists>
    PYTHONPATH=/tmp/sgl/src:/tmp/sgl/deps uv run pytest -m sglang packages/rollout-sglang

On a GPU machine, ``uv sync --extra gpu`` installs sglang and they run as they are.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from rollout_sglang.sglang_client.common import SGLangConfig
from rollout_sglang.sglang_client.protocol import generate_payload
from rollout_sglang.types import GenerateRequest, SamplingParams
from weight_sync.nccl import bucket_spec
from weight_sync.weight_names import WeightNameCheck


def _import_sglang() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("sglang.srt.managers.io_struct")
            importlib.import_module("sglang.srt.multimodal.processors.qwen_vl")
            importlib.import_module("sglang.srt.models.qwen3_vl")
    except Exception as exc:  # not installed, or a dependency missing
        return f"{type(exc).__name__}: {exc}"
    return None


_MISSING = _import_sglang()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        _MISSING is not None,
        reason=f"sglang.srt not importable ({_MISSING}); see this file's docstring",
    ),
]


@pytest.fixture
def limits_id(tiny_model) -> int:
    return tiny_model.config.image_token_id


def test_generate_payload_is_a_valid_generate_req_input(requests_, limits_id):
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    payload = generate_payload(
        requests_, SamplingParams(temperature=0.7, max_new_tokens=5, seed=3), limits_id
    )
    request = GenerateReqInput(**payload)
    request.normalize_batch_and_arguments()
    assert request.batch_size == len(requests_)
    seeds = []
    for params in request.sampling_params:
        sp = SGLangSamplingParams(**params)  # every key we send is one SGLang knows
        sp.verify(vocab_size=200_000)
        seeds.append(sp.sampling_seed)
    assert seeds == [3, 4, 5, 6]


def test_weight_sync_requests_are_valid_io_structs():
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        InitWeightsUpdateGroupReqInput,
        UpdateWeightsFromDistributedReqInput,
    )

    spec = bucket_spec([("model.norm.weight", torch.ones(4, dtype=torch.bfloat16))])
    req = UpdateWeightsFromDistributedReqInput(**spec, group_name="g", flush_cache=False)
    assert req.dtypes == ["bfloat16"] and req.shapes == [[4]]
    assert getattr(torch, req.dtypes[0]) is torch.bfloat16  # SGLang resolves dtypes this way
    InitWeightsUpdateGroupReqInput(
        master_address="127.0.0.1",
        master_port=1,
        rank_offset=1,
        world_size=2,
        group_name="g",
        backend="nccl",
    )
    BeginWeightUpdateReqInput(selector="all")
    EndWeightUpdateReqInput()


def _real_expander(config):
    """The real ``build_input_ids`` of SGLang's Qwen-VL processor, on an instance that skips
    ``__init__`` (which loads the HF processor and server state) and sets what it reads."""
    from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor

    proc = object.__new__(QwenVLImageProcessor)
    proc.IM_TOKEN_ID = config.image_token_id
    proc.VIDEO_TOKEN_ID = config.video_token_id
    proc.audio_token_id = None
    proc._spatial_merge_size = config.vision_config.spatial_merge_size
    return proc


def test_real_processor_expands_our_ids_to_the_trainers(requests_, tiny_model, limits_id):
    """One pad per image, expanded by SGLang's own code, gives back our processor's ids."""
    proc = _real_expander(tiny_model.config)
    payload = generate_payload(requests_, SamplingParams(), limits_id)
    for wire, request in zip(payload["input_ids"], requests_, strict=True):
        expanded, offsets, _ = proc.build_input_ids(wire, img_grid_thw=request.image_grid_thw)
        assert expanded == request.input_ids.tolist()
        assert len(offsets) == len(request.images)


def test_real_processor_fails_on_expanded_pads(requests_, tiny_model):
    """What SGLang did with the ids we used to send (issue #21, item 2)."""
    proc = _real_expander(tiny_model.config)
    one = requests_[0]
    with pytest.raises(IndexError):
        proc.build_input_ids(one.input_ids.tolist(), img_grid_thw=one.image_grid_thw)
    two = GenerateRequest(
        input_ids=torch.cat([requests_[0].input_ids, requests_[1].input_ids]),
        image_grid_thw=torch.cat([requests_[0].image_grid_thw, requests_[1].image_grid_thw]),
    )
    with pytest.raises(AssertionError):
        proc.build_input_ids(two.input_ids.tolist(), img_grid_thw=two.image_grid_thw)


def test_real_qwen3vl_loader_consumes_every_name_we_send(tiny_model):
    """The real ``Qwen3VLForConditionalGeneration.load_weights`` run over our HF names, its
    parameters being the names our mirror predicts: every name lands, a renamed one does not
    (SGLang says nothing) and our check refuses it (issue #21, item 8)."""
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration

    from vlm_models.weights import hf_named_tensors

    sent = [(n, t.detach()) for n, t in hf_named_tensors(tiny_model)]
    check = WeightNameCheck.from_names(n for n, _ in sent)
    landed: list[str] = []

    def loader(param, weight, shard_id=None):
        landed.append(param.name)

    params = {p: SimpleNamespace(name=p, weight_loader=loader) for p in check.params}
    fake = SimpleNamespace(
        named_parameters=lambda remove_duplicate=True: params.items(),
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(tie_word_embeddings=False),
        model=SimpleNamespace(start_layer=0, end_layer=10**6),
    )
    Qwen3VLForConditionalGeneration.load_weights(fake, iter(sent))
    expected = [n for n, _ in sent if "rotary_emb.inv_freq" not in n]
    assert len(landed) == len(expected) and not check.unknown(n for n, _ in sent)

    renamed = "model.language_model.layers.0.mlp.gate_projection.weight"
    landed.clear()
    Qwen3VLForConditionalGeneration.load_weights(fake, iter([(renamed, torch.ones(1))]))
    assert landed == [] and check.unknown([renamed]) == [renamed]


def test_cpu_tensors_cannot_reach_a_server_we_did_not_fork(tmp_path):
    """Why ``SGLangClient`` never sends CPU tensors (issue #21, item 4): the real
    ``MultiprocessingSerializer`` pickles a CPU tensor as a file descriptor that another
    process fetches from ours with our multiprocessing authkey, which a separately launched
    server does not have."""
    from sglang.srt.utils import MultiprocessingSerializer

    tensor = torch.arange(4.0)
    payload = tmp_path / "bucket.b64"
    payload.write_text(MultiprocessingSerializer.serialize([("w", tensor)], output_str=True))
    code = (
        "import sys; from sglang.srt.utils import MultiprocessingSerializer as S; "
        "print(S.deserialize(open(sys.argv[1]).read())[0][1].tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(payload)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0, done.stdout
    assert "AuthenticationError" in done.stderr, done.stderr[-2000:]


def test_our_launch_flags_parse_with_sglangs_own_parser():
    """``server_command`` through the real ``ServerArgs.add_cli_args`` parser: every flag is
    SGLang's, the pixel bounds arrive as a dict (JSON, issue #21 item 6), and every
    ``engine_kwargs`` key is a ``ServerArgs`` field."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    config = SGLangConfig(
        model_path="/models/qwen3-vl",
        tp_size=2,
        mm_attention_backend="sdpa",
        min_pixels=4096,
        max_pixels=16384,
        enable_deterministic_inference=True,
    )
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(config.server_command()[3:])
    assert args.mm_process_config == {"image": {"min_pixels": 4096, "max_pixels": 16384}}
    assert args.tp_size == 2 and args.enable_deterministic_inference and args.port == 30000
    assert set(config.engine_kwargs()) <= set(ServerArgs.__struct_fields__)


def test_our_flattened_bucket_payloads_load_through_sglangs_own_path():
    """The CUDA IPC transport's SGLang format (``weight_sync.cuda_ipc``): one payload per TP
    rank, one dtype per payload, read back by the real ``SafeUnpickler`` (its allow-list must
    take everything we pickle) and rebuilt by the real ``FlattenedTensorBucket``, as
    ``tp_worker.deserialize_own_rank`` and ``weight_updater._update_weights_from_flattened_bucket``
    do. CPU tensors here (in-process, so their file descriptors open); CUDA ones in the GPU smoke."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from weight_sync.cuda_ipc import by_dtype, flattened_bucket_payloads

    bucket = [
        ("model.language_model.norm.weight", torch.randn(5, dtype=torch.bfloat16)),
        ("model.visual.merger.norm.bias", torch.randn(3)),
        ("model.language_model.embed_tokens.weight", torch.randn(4, 7, dtype=torch.bfloat16)),
    ]
    loaded = {}
    for part in by_dtype(bucket):
        payloads, _flat = flattened_bucket_payloads(part, tp_size=2, keep=True)
        assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
        raw = normalize_serialized_named_tensor_payloads(payloads)  # Engine's pass-through
        data = MultiprocessingSerializer.deserialize(raw[1])  # TP rank 1 reads its own
        rebuilt = FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        )
        loaded.update(rebuilt.reconstruct_tensors())
    assert list(loaded) == [bucket[0][0], bucket[2][0], bucket[1][0]]
    for name, tensor in bucket:
        assert loaded[name].dtype == tensor.dtype
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_speculative_and_moe_settings_are_sglangs_own():
    """The Qwen3.5 recipe's SGLang settings (EP, EAGLE from the MTP head, decode-graph batch
    sizes, running requests) as `RolloutConfig` writes them: every key a ``ServerArgs``
    field, and the server command read back by SGLang's own parser with the same values."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from rollout_sglang import RolloutConfig

    rollout = RolloutConfig(
        model_path="/models/qwen3.5",
        backend="sglang",
        tp_size=8,
        ep_size=8,
        speculative_algorithm="EAGLE",
        speculative_num_steps=2,
        speculative_num_draft_tokens=3,
        max_running_requests=512,
        cuda_graph_bs=(1, 2, 4, 8, 16),
        weights_cpu_backup=True,
    )
    config = rollout.sglang_config()
    assert set(config.engine_kwargs()) <= set(ServerArgs.__struct_fields__)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(config.server_command()[3:])
    assert (args.ep_size, args.speculative_algorithm, args.speculative_num_steps) == (8, "EAGLE", 2)
    assert (args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (1, 3)
    assert args.max_running_requests == 512 and args.enable_draft_weights_cpu_backup
    assert args.enable_weights_cpu_backup  # --weights-cpu-backup
    assert list(args.cuda_graph_bs_decode) == [1, 2, 4, 8, 16]


def test_routing_replay_request_flag_and_answer_are_sglangs_own(requests_, limits_id):
    """Routing replay through SGLang: the server flag parses with SGLang's parser, the request
    field is a ``GenerateReqInput`` field, and an answer encoded as SGLang's detokenizer does
    (``_b64_encode_per_request``: pybase64 of the int32 tensor's bytes) decodes to the ids
    SGLang's own reader (``extract_routed_experts_from_meta_info``) gives, shaped
    ``[seqlen - 1, layers, k]``."""
    import argparse

    import pybase64
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from rollout_sglang import RolloutConfig
    from rollout_sglang.sglang_client.protocol import parse_output

    rollout = RolloutConfig(model_path="/models/qwen3.5", backend="sglang")
    rollout.return_routed_experts = True
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(rollout.sglang_config().server_command()[3:])
    assert args.enable_return_routed_experts
    payload = generate_payload(
        requests_, SamplingParams(max_new_tokens=4), limits_id, return_routed_experts=True
    )
    request = GenerateReqInput(**payload)
    request.normalize_batch_and_arguments()
    assert request.return_routed_experts
    prompt, layers, k = requests_[0].prompt_length, 3, 2
    ids = torch.randint(0, 64, (prompt + 4 - 1, layers, k), dtype=torch.int32)
    output = {
        "output_ids": [5, 6, 7, 8],
        "meta_info": {
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, t, None] for t in (5, 6, 7, 8)],
            "routed_experts": pybase64.b64encode(ids.numpy().tobytes()).decode("utf-8"),
        },
    }
    theirs = torch.from_numpy(extract_routed_experts_from_meta_info(output).copy())
    completion = parse_output(output, requests_[0], routing_shape=(layers, k))
    assert completion.ok and torch.equal(completion.routed_experts.reshape(-1), theirs)
    assert torch.equal(completion.routed_experts, ids)
