"""The transformers engine's CUDA-graph decode on a GPU: same results as the eager step.

Tiny Qwen3-VL in float32, synthetic prompts with one image each (no shared files needed):

    uv run pytest -q -m gpu packages/rollout-sglang/tests/test_hf_engine_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.types import GenerateRequest, SamplingParams
from vlm_models.build import build_model
from vlm_models.presets import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _requests(config, n: int) -> list[GenerateRequest]:
    """Prompts of different lengths, each with one 4x4-patch image (4 image tokens)."""
    g = torch.Generator().manual_seed(0)
    vision = config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    out = []
    for i in range(n):
        head = [151644, 872, 198, config.vision_start_token_id] + [config.image_token_id] * 4
        text = torch.randint(1000, 50000, (5 + 3 * i,), generator=g).tolist()
        ids = torch.tensor([*head, config.vision_end_token_id, *text, 151645, 198])
        out.append(
            GenerateRequest(
                input_ids=ids,
                pixel_values=torch.randn(16, patch_dim, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]]),
                mm_token_type_ids=(ids == config.image_token_id).long(),
                request_id=f"r{i}",
            )
        )
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = build_model(tiny_config(), device="cuda").eval()
    with torch.no_grad():  # peaked next-token distributions (top token ~0.8), as a trained
        model.lm_head.weight.mul_(12)  # model's: at random init they are flat over 152k ids
    return model


def _forward_logprobs(model, request, completion) -> torch.Tensor:
    response = torch.tensor(completion.token_ids)
    ids = torch.cat([request.input_ids, response])[None].cuda()
    types = torch.cat([request.mm_token_type_ids, torch.zeros_like(response)])[None].cuda()
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=request.pixel_values.cuda(),
            image_grid_thw=request.image_grid_thw.cuda(),
            mm_token_type_ids=types,
        ).logits[0]
    start = request.prompt_length - 1
    scores = logits[start : start + len(response)].float().log_softmax(-1)
    return scores.gather(-1, response.cuda()[:, None]).squeeze(-1).cpu()


@pytest.mark.parametrize(
    "settings",
    [{}, {"decode_attention": "sdpa"}, {"decode_attention": "matmul"}, {"compile": True}],
    ids=["graph", "graph-sdpa", "graph-matmul", "graph-compile"],
)
def test_graph_decode_equals_eager_and_a_forward_pass(model, settings):
    # Tokens are compared greedily: GPU kernels of another shape or fusion round differently,
    # and a sampled draw near a boundary of the distribution may then pick the neighbour.
    requests = _requests(model.config, 6)
    eager_settings = {k: v for k, v in settings.items() if k != "compile"}
    eager = HFEngine(model, max_batch_size=4, cuda_graphs=False, **eager_settings)
    engine = HFEngine(model, max_batch_size=4, **settings)
    # the default on CUDA: the Triton split-KV attention (where triton imports)
    assert engine.decoder.attention == settings.get("decode_attention", "triton")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    graphed = engine.generate(requests, greedy)
    assert engine.runner is not None and engine.runner.num_graphs > 0
    stats = engine.last_stats  # the device's share of the decode steps' wall time
    assert 0 < stats["decode_device_s"] <= stats["decode_s"]
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager.generate(requests, greedy)]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    for request, completion in zip(requests, engine.generate(requests, sampled), strict=True):
        expected = _forward_logprobs(model, request, completion)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_graphs_survive_stops_compaction_and_release(model):
    requests = _requests(model.config, 8)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    engine = HFEngine(model, max_batch_size=3)
    free = engine.generate(requests, params)
    stop = (free[0].token_ids[2],)
    with_stop = SamplingParams(**{**vars(params), "stop_token_ids": stop})
    stopped = engine.generate(requests, with_stop)
    alone = [
        HFEngine(model, max_batch_size=1, cuda_graphs=False).generate([r], with_stop)[0]
        for r in requests
    ]
    assert [c.token_ids for c in stopped] == [c.token_ids for c in alone]
    assert stopped[0].finish_reason == "stop"
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, seed=9)
    before = engine.generate(requests, sampled)
    engine.release_memory()
    engine.resume_memory()
    after = engine.generate(requests, sampled)  # same shapes, graphs captured again
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_qwen35_graph_decode_equals_eager():
    # Graph warm-ups are dry runs: Qwen3.5's recurrent states advance once per step, not once
    # per warm-up too (they did: the first step of every captured shape ran three times)
    torch.manual_seed(0)
    model = build_model("qwen3.5-tiny", device="cuda").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # peaked distributions, as in the fixture above
    g = torch.Generator().manual_seed(0)
    requests = [
        GenerateRequest(input_ids=torch.randint(100, 5000, (n,), generator=g)) for n in (9, 14, 23)
    ]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    graphed = HFEngine(model, max_batch_size=4).generate(requests, greedy)
    eager = HFEngine(model, max_batch_size=4, cuda_graphs=False).generate(requests, greedy)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    torch.testing.assert_close(
        torch.tensor([c.logprobs for c in graphed]),
        torch.tensor([c.logprobs for c in eager]),
        atol=1e-4,  # the same kernels on the same shapes; room for a GEMM picked otherwise
        rtol=0,
    )
