"""The replaying MoE router (vlm_models.routing_replay) on transformers' tiny MoE models."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from vlm_models.build import build_model
from vlm_models.presets import PRESETS
from vlm_models.routing_replay import clear_routes, replay_routers, replaying, set_routes

SMALL_VOCAB = dict(vocab_size=512, image_token_id=500, video_token_id=501)
MOE = [
    pytest.param(
        p, marks=pytest.mark.skipif(p not in PRESETS, reason=f"{p} needs a newer transformers")
    )
    for p in ("qwen3-vl-moe-tiny", "qwen3.5-moe-tiny")
]


def _model(preset: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(preset, routing_replay=True, **SMALL_VOCAB, **kwargs).eval()


def _random_routes(tokens: int, model, seed: int = 0) -> torch.Tensor:
    text = model.config.text_config
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, text.num_hidden_layers, text.num_experts, generator=g)
    return scores.argsort(-1)[..., : text.num_experts_per_tok]


@pytest.mark.parametrize("preset", MOE)
def test_every_moe_layer_gets_a_replaying_router_and_its_column(preset):
    model = _model(preset)
    routers = replay_routers(model)
    assert sorted(routers) == list(range(model.config.text_config.num_hidden_layers))
    assert replay_routers(build_model(preset, **SMALL_VOCAB)) == {}  # the option is off
    routes = _random_routes(7, model).int()
    with replaying(model, routes):
        for layer, router in routers.items():
            assert router.replay_ids.dtype == torch.long
            assert torch.equal(router.replay_ids, routes[:, layer].long())
    assert all(r.replay_ids is None for r in routers.values())
    with pytest.raises(ValueError, match=r"expected \[T, 4, top_k\]"):
        set_routes(model, routes[:, :3])
    with pytest.raises(ValueError, match="3 experts per token, layer 0 routes to 2"):
        set_routes(model, torch.zeros(7, 4, 3, dtype=torch.long))
    set_routes(model, routes)
    with pytest.raises(ValueError, match="7 tokens of expert ids for 5 tokens"):
        model(input_ids=torch.arange(5)[None], use_cache=False)
    clear_routes(model)


@pytest.mark.parametrize("preset", MOE)
def test_the_router_weights_the_replayed_experts_by_its_own_probabilities(preset):
    """Replayed ids: the router's float32 softmax over all experts at those ids,
    renormalised; its own top-k replayed: transformers' output, bit for bit."""
    model = _model(preset)
    router = replay_routers(model)[0]
    x = torch.randn(6, model.config.text_config.hidden_size)
    logits, scores, own = router(x)
    ids = _random_routes(6, model)[:, 0]
    router.replay_ids = ids
    try:
        replay_logits, replay_scores, replay_ids = router(x)
        router.replay_ids = own
        assert all(torch.equal(a, b) for a, b in zip(router(x), (logits, scores, own), strict=True))
    finally:
        router.replay_ids = None
    probs = torch.softmax(logits.float(), -1).gather(-1, ids)
    torch.testing.assert_close(replay_scores, probs / probs.sum(-1, keepdim=True))
    assert torch.equal(replay_ids, ids) and torch.equal(replay_logits, logits)


@pytest.mark.slow  # dynamo traces the decoder layers
def test_compiled_layers_compile_replay_once_not_every_step():
    """The ids are a module attribute toggled per forward: dynamo guards on None or a tensor
    (two graphs) and the token count is dynamic, so new lengths and toggling reuse them."""
    model = _model("qwen3-vl-moe-tiny")
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()

    def step(tokens: int, replay: bool) -> None:
        routes = _random_routes(tokens, model) if replay else None
        with replaying(model, routes):
            model(input_ids=torch.randint(0, 400, (1, tokens)), use_cache=False).logits.sum()

    for tokens in (9, 13):
        step(tokens, True)
        step(tokens, False)
    graphs = counters["stats"]["unique_graphs"]
    for tokens in (17, 23, 31):
        step(tokens, True)
        step(tokens, False)
    assert counters["stats"]["unique_graphs"] == graphs
