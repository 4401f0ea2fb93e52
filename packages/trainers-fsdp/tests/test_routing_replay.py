"""Rollout routing replay through the FSDP actor (CPU, float32, world of one).

Replaying the actor's own top-k changes nothing, bit for bit: the replaying router gathers the
very probabilities ``topk`` returns, renormalises them with the same ops, and the experts
loop adds each expert's rows in expert order whatever the order of the ``k``. Replaying other
experts gives the log-probs of plain transformers with the router swapped for the rollout
engine's own replay (``rollout_sglang.hf.moe.route(ids=...)``), each sample alone. Training
routes the same way forward and in the backward's recompute.
"""

from __future__ import annotations

import pytest
import torch

from rl_algos.run_context import RunContext
from trainers_fsdp.actor import FsdpActor
from trainers_fsdp.synthetic import TINY_OVERRIDES
from vlm_models.build import build_model
from vlm_models.presets import PRESETS, tiny_config
from vlm_models.routing_replay import replay_routers

moe = pytest.importorskip("rollout_sglang.hf.moe")
PRESETS_MOE = [
    pytest.param(
        p, marks=pytest.mark.skipif(p not in PRESETS, reason=f"{p} needs a newer transformers")
    )
    for p in ("qwen3-vl-moe-tiny", "qwen3.5-moe-tiny")
]


def _other_experts(batch, config, seed: int = 1) -> list[torch.Tensor]:
    """Distinct random experts per token and layer (int16, as an engine sends them)."""
    text = config.text_config
    g = torch.Generator().manual_seed(seed)
    shape = (text.num_hidden_layers, text.num_experts)
    return [
        torch.rand(n, *shape, generator=g).argsort(-1)[..., : text.num_experts_per_tok].short()
        for n in batch.lengths
    ]


def _own_experts(actor: FsdpActor, batch) -> list[torch.Tensor]:
    """The experts the actor's routers choose for each sample (one packed row)."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        router.register_forward_hook(lambda m, i, out, at=layer: chosen.__setitem__(at, out[2]))
        for layer, router in replay_routers(actor.model).items()
    ]
    try:
        actor.compute_logprobs(batch)
    finally:
        for h in hooks:
            h.remove()
    row = torch.stack([chosen[layer] for layer in sorted(chosen)], dim=1)
    assert row.shape[0] == batch.num_tokens  # one row, no fillers
    return list(row.split(batch.lengths))


def _engine_routed_logprobs(preset: str, batch, routes) -> list[torch.Tensor]:
    """Transformers' model (the actor's initial weights), each MoE block's router replaced by
    the rollout engine's replay, one sample per forward; aligned log-probs."""
    torch.manual_seed(0)
    model = build_model(preset, **TINY_OVERRIDES).eval()
    current: dict[str, torch.Tensor] = {}
    for layer, block in enumerate(model.get_decoder().layers):
        gate = block.mlp.gate

        def forward(x, gate=gate, layer=layer):
            x = x.reshape(-1, gate.hidden_dim)
            ids = current["ids"][:, layer].long()
            weights, ids = moe.route(x, gate.weight, gate.top_k, True, ids=ids)
            return None, weights, ids

        gate.forward = forward
    out = []
    for i, ids in enumerate(batch.input_ids):
        current["ids"] = routes[i]
        kwargs = dict(input_ids=ids[None], use_cache=False)
        if batch.pixel_values is not None and batch.pixel_values[i] is not None:
            kwargs.update(
                pixel_values=batch.pixel_values[i],
                image_grid_thw=batch.image_grid_thw[i],
                mm_token_type_ids=(ids == model.config.image_token_id).int()[None],
            )
        with torch.no_grad():
            logits = model(**kwargs).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).squeeze(1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return out


@pytest.mark.parametrize("preset", PRESETS_MOE)
def test_replaying_the_actors_own_experts_changes_nothing(make_config, make_small_batch, preset):
    actor = FsdpActor(make_config(model=preset, routing_replay=True, logprobs_scope="all"))
    batch = make_small_batch(preset)
    actor.config.max_tokens_per_gpu = batch.num_tokens  # one row
    own = _own_experts(actor, batch)
    plain = actor.compute_logprobs(batch)
    batch.routed_experts = own
    replayed = actor.compute_logprobs(batch)
    for a, b in zip(replayed, plain, strict=True):
        assert torch.equal(a, b)
    assert all(r.replay_ids is None for r in replay_routers(actor.model).values())


@pytest.mark.parametrize("preset", PRESETS_MOE)
def test_replaying_other_experts_matches_the_engines_routing(make_config, make_small_batch, preset):
    """Log-probs (policy and reference model) routed to other experts move far from the
    actor's own routing and agree with transformers routed by the engine's replay."""
    cfg = make_config(model=preset, routing_replay=True, logprobs_scope="all", reference_model=True)
    actor = FsdpActor(cfg)
    batch = make_small_batch(preset)
    own = actor.compute_logprobs(batch)
    batch.routed_experts = _other_experts(batch, actor.model_config)
    expected = _engine_routed_logprobs(preset, batch, batch.routed_experts)
    for reference in (False, True):
        replayed = actor.compute_logprobs(batch, reference=reference)
        moved = max(float((r - o).abs().max()) for r, o in zip(replayed, own, strict=True))
        assert moved > 1e-2, moved  # without replay the actor gives `own`
        for r, e in zip(replayed, expected, strict=True):
            torch.testing.assert_close(r, e, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS_MOE)
def test_a_replayed_step_recomputes_with_the_same_experts(make_config, make_small_batch, preset):
    """Activation checkpointing recomputes each layer in backward with the replayed experts:
    the gradients equal those without checkpointing, the router's included (its probabilities
    at the replayed ids carry it), and differ from the gradients of the actor's own routing.
    Several micro-batches: each backward follows its own forward's routes."""
    batch = make_small_batch(preset)
    routes = _other_experts(batch, tiny_config(preset, **TINY_OVERRIDES))
    grads = {}
    for name, ac, replay in (("ac", True, True), ("plain", False, True), ("own", False, False)):
        actor = FsdpActor(
            make_config(model=preset, routing_replay=True, activation_checkpointing=ac)
        )
        actor.config.max_tokens_per_gpu = max(batch.lengths)  # a micro-batch per sample or two
        batch.routed_experts = routes if replay else None
        metrics = actor.forward_backward(batch, loss="grpo")
        assert metrics["num_micro_batches"] >= 2
        grads[name] = actor.full_gradients()
        assert all(r.replay_ids is None for r in replay_routers(actor.model).values())
    router = "model.language_model.layers.0.mlp.gate.weight"
    assert float(grads["ac"][router].abs().max()) > 0
    for name, g in grads["plain"].items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(grads["ac"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.allclose(grads["own"][router], grads["plain"][router], atol=1e-4)


def test_routing_replay_is_the_runs_and_refuses_a_dense_model(make_config):
    run = RunContext(model="qwen3-vl-moe-tiny", seed=0, use_gpu=False, routing_replay=True)
    assert make_config().for_run(run).routing_replay  # the loop's --routing-replay
    with pytest.raises(ValueError, match="routing_replay needs an MoE model; qwen3_vl"):
        FsdpActor(make_config(routing_replay=True))
