"""One wire layout for weight sync (issue #35, item 3): both trainers, built from a saved HF
folder (as every real run is), send the checkpoint's own layout, and every receiver takes it.

For each tiny MoE preset a random model is saved with ``save_pretrained``; the FSDP and the
Megatron actor are built from that folder (one gloo process, float32, CPU) and their
``iter_hf_weights`` buckets (small: a layer's experts span several) are loaded (a) into the
transformers engine's model built from the same folder, its parameters first overwritten with
NaN: every parameter is set, equal to the folder's; (b) ``-m sglang``: through sglang 0.5.23's
own ``load_weights`` of ``qwen3_vl_moe.py`` and ``qwen3_5.py``, on a test double of the model
(SGLang's classes need its distributed and CUDA state to be constructed; the double gives
``load_weights`` the attributes it reads and records each ``weight_loader`` call): every
parameter, shard and expert lands, each expert slice equal to the folder's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from trainers_fsdp.synthetic import TINY_OVERRIDES
from vlm_models.build import build_model
from weight_sync.weight_names import WeightNameCheck

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("wire_layout_worker.py")
PRESETS = ("qwen3-vl-moe-tiny", "qwen3.5-moe-tiny")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=PRESETS)
def sent(request, tmp_path_factory):
    """(folder, {backend: buckets}) for one preset."""
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "model"
    torch.manual_seed(0)
    build_model(request.param, **TINY_OVERRIDES).save_pretrained(folder)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    out = root / "buckets.pt"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(folder), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder, torch.load(out, weights_only=True)


def _names(buckets) -> list[str]:
    return [n for b in buckets for n, _ in b]


def test_both_trainers_send_the_checkpoint_layout(sent):
    """Same names and tensors from both backends; Qwen3.5-MoE per expert (as its files),
    Qwen3-VL-MoE's stacks transposed (as released files and SGLang's loader have them)."""
    folder, by_backend = sent
    fsdp, megatron = (dict(p for b in by_backend[k] for p in b) for k in ("fsdp", "megatron"))
    assert sorted(fsdp) == sorted(megatron)
    for name, tensor in fsdp.items():
        torch.testing.assert_close(megatron[name], tensor, rtol=0, atol=0, msg=name)
    ref = dict(build_model(folder).named_parameters())
    if "qwen3_5" in (folder / "config.json").read_text():
        assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in fsdp
        assert not any(n.endswith("experts.gate_up_proj") for n in fsdp)
    else:
        stack = "model.language_model.layers.0.mlp.experts.down_proj"
        assert torch.equal(fsdp[stack], ref[stack].detach().transpose(1, 2))


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_transformers_engine_takes_the_wire_layout(sent, backend):
    from rollout_sglang.hf.weights import WeightLoader

    folder, by_backend = sent
    ref = {n: t.detach().clone() for n, t in build_model(folder).state_dict().items()}
    engine_model = build_model(folder)
    with torch.no_grad():
        for p in engine_model.parameters():
            p.fill_(float("nan"))
    loader = WeightLoader(engine_model)
    assert sum(loader.load(b) for b in by_backend[backend]) == len(_names(by_backend[backend]))
    for name, tensor in engine_model.state_dict().items():
        assert torch.equal(tensor, ref[name]), name


def _sglang_double(check: WeightNameCheck, config, tie: bool):
    """A stand-in for SGLang's model: ``named_parameters`` of the names our mirror predicts,
    each recording ``weight_loader(param, weight, *shard)`` calls."""
    calls: list[tuple[str, torch.Tensor, tuple]] = []

    def loader(param, weight, *args, **kwargs):
        calls.append((param.name, weight, args + tuple(kwargs.values())))

    params = {p: SimpleNamespace(name=p, weight_loader=loader) for p in check.params}
    text = config.text_config
    fake = SimpleNamespace(
        named_parameters=lambda remove_duplicate=True: params.items(),
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(
            tie_word_embeddings=tie,
            num_experts=text.num_experts,
            encoder_only=False,
            language_only=False,
        ),
        model=SimpleNamespace(start_layer=0, end_layer=10**6),
        enable_shared_expert_fusion=False,
        num_fused_shared_experts=0,
    )
    return fake, calls


@pytest.mark.sglang
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_sglang_loader_consumes_the_wire_layout(sent, backend):
    pytest.importorskip("sglang.srt.models.qwen3_vl_moe")
    from safetensors import safe_open
    from transformers import AutoConfig

    folder, by_backend = sent
    config = AutoConfig.from_pretrained(folder)
    if config.model_type == "qwen3_5_moe":
        from sglang.srt.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration as cls
    else:
        from sglang.srt.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration as cls
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        check = WeightNameCheck.from_checkpoint(folder)
        assert check is not None and list(f.keys())
    names = _names(by_backend[backend])
    assert check.unknown(names) == []
    fake, calls = _sglang_double(check, config, tie=bool(config.tie_word_embeddings))
    cls.load_weights(fake, iter(p for b in by_backend[backend] for p in b))
    ref = {n: t.detach() for n, t in build_model(folder).state_dict().items()}
    landed = {name for name, _, _ in calls}
    assert landed == check.params - ({"lm_head.weight"} if "lm_head.weight" not in ref else set())
    experts: dict[tuple[str, str, int], torch.Tensor] = {}
    for name, weight, args in calls:
        if name.endswith(("experts.w13_weight", "experts.w2_weight")):
            shard, expert = args[-2], args[-1]
            experts[(name, shard, expert)] = weight
    num_experts = config.text_config.num_experts
    stacks = {n for n in ref if n.endswith("mlp.experts.gate_up_proj")}
    assert len(experts) == 3 * num_experts * len(stacks)
    for stack in stacks:
        layer = stack.replace("model.language_model.", "model.").rsplit(".gate_up_proj", 1)[0]
        gate_up, down = ref[stack], ref[stack.replace("gate_up_proj", "down_proj")]
        half = gate_up.shape[1] // 2
        for e in range(num_experts):
            assert torch.equal(experts[(f"{layer}.w13_weight", "w1", e)], gate_up[e, :half])
            assert torch.equal(experts[(f"{layer}.w13_weight", "w3", e)], gate_up[e, half:])
            assert torch.equal(experts[(f"{layer}.w2_weight", "w2", e)], down[e])


def test_name_check_refuses_what_sglang_skips(sent):
    """Stacked names against a per-expert checkpoint, and Qwen3.5's ``mtp.*`` (skipped by its
    loader), are refused; the wire's names pass."""
    folder, by_backend = sent
    check = WeightNameCheck.from_checkpoint(folder)
    assert check is not None
    assert check.unknown(_names(by_backend["fsdp"])) == []
    assert check.unknown(["model.language_model.layers.0.mlp.experts.gate_projection"]) != []
    if check.family == "qwen3_5":
        assert check.unknown(["mtp.fc.weight"]) == ["mtp.fc.weight"]
