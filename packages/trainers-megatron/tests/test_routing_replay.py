"""Rollout routing replay through the Megatron actor (float32, CPU).

In one process: replaying the actor's own experts changes nothing, bit for bit (the replayed
router gathers the very logits its top-k returns, in the same order, and takes the same
softmax over them); other experts move the log-probs far and give transformers' model routed
to them (``vlm_models.routing_replay``, which the FSDP tests hold to the engine's replay),
each sample alone; a step with full activation recompute gives the loss and gradients of one
without it (the recompute routes to the same experts). Two gloo ranks: the ids cut to each
rank's tokens under sequence parallelism, context parallelism (zigzag, padded samples),
pipeline stages (global layer numbers) and expert parallelism.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos import TrainBatch, aligned_logprobs
from rl_algos.optimizer import OptimConfig
from rl_algos.run_context import ParallelLayout, RunContext
from trainers_megatron import MegatronConfig
from vlm_models.build import build_model
from vlm_models.megatron.routing_replay import replay_routers
from vlm_models.presets import PRESETS, tiny_config
from vlm_models.routing_replay import replaying

WORKER = Path(__file__).with_name("routing_worker.py")
LENGTHS = [23, 14, 10]  # odd in all: sequence parallelism pads the row, CP each sample
ATOL = 1e-5
MOE = [
    pytest.param(
        p, marks=pytest.mark.skipif(p not in PRESETS, reason=f"{p} needs a newer transformers")
    )
    for p in ("qwen3-vl-moe-tiny", "qwen3.5-moe-tiny")
]


def _batch(preset: str, seed: int = 0) -> TrainBatch:
    """Text-only samples of LENGTHS, the second half of each scored, with expert ids drawn
    at random (distinct per token and layer: not the model's own)."""
    text = tiny_config(preset).text_config
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 150000, (n,), generator=g) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(n - n // 2), torch.ones(n // 2)]) for n in LENGTHS]
    shape = (text.num_hidden_layers, text.num_experts)
    routes = [
        torch.rand(n, *shape, generator=g).argsort(-1)[..., : text.num_experts_per_tok].int()
        for n in LENGTHS
    ]
    advantages = [m * s for m, s in zip(masks, (1.0, -1.0, 0.5), strict=True)]
    return TrainBatch(ids, masks, advantages=advantages, routed_experts=routes)


def _transformers_logprobs(preset: str, batch: TrainBatch) -> list[torch.Tensor]:
    """The actor's initial weights as transformers' model, each sample routed to its ids."""
    torch.manual_seed(0)  # as the actor before its random init
    model = build_model(tiny_config(preset), routing_replay=True).eval()
    out = []
    for ids, routes, mask in zip(
        batch.input_ids, batch.routed_experts, batch.loss_mask, strict=True
    ):
        with torch.no_grad(), replaying(model, routes):
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
        out.append(aligned_logprobs(logits, ids, [0, len(ids)]) * mask)  # the actor scores these
    return out


def _actor(preset: str, **kwargs):
    from trainers_megatron.actor import MegatronActor

    optim = OptimConfig(lr=1e-3, weight_decay=0.0)
    return MegatronActor(
        MegatronConfig(model=preset, optim=optim, seed=0, routing_replay=True, **kwargs)
    )


def _own_routes(actor, batch: TrainBatch) -> list[torch.Tensor]:
    """The experts the actor's routers choose (one packed row), in ascending expert order:
    the order of the k does not matter bitwise for k = 2 (a sum of two commutes)."""
    chosen: dict[int, torch.Tensor] = {}
    routers = replay_routers(actor.model)
    hooks = [
        r.register_forward_hook(lambda m, i, out, at=layer: chosen.__setitem__(at, out[1]))
        for layer, r in routers.items()
    ]
    try:
        actor.compute_logprobs(batch)
    finally:
        for h in hooks:
            h.remove()
    k = next(iter(routers.values())).topk
    row = torch.stack([chosen[n].nonzero()[:, 1].view(-1, k) for n in sorted(chosen)], dim=1)
    return list(row.split(batch.lengths))


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize("preset", MOE)
def test_replay_in_one_process(preset):
    actor = _actor(preset, reference_model=True)
    batch = _batch(preset)
    routes, batch.routed_experts = batch.routed_experts, None
    own = actor.compute_logprobs(batch)
    batch.routed_experts = _own_routes(actor, batch)
    for a, b in zip(actor.compute_logprobs(batch), own, strict=True):
        assert torch.equal(a, b)

    batch.routed_experts = routes
    expected = _transformers_logprobs(preset, batch)
    for reference in (False, True):
        replayed = actor.compute_logprobs(batch, reference=reference)
        moved = max(float((r - o).abs().max()) for r, o in zip(replayed, own, strict=True))
        assert moved > 1e-2, moved  # without replay the actor gives `own`
        for r, e in zip(replayed, expected, strict=True):
            torch.testing.assert_close(r, e, atol=ATOL, rtol=0)
    for router in replay_routers(actor.model).values():  # cleared after the call
        assert router.router_replay.target_topk_idx is None
        assert router.router_replay.router_replay_action is None


@pytest.mark.usefixtures("one_process")
def test_a_replayed_step_recomputes_with_the_same_experts():
    """Three micro-batches; full recompute reruns every router in backward. The router's
    gradient flows through its scores at the replayed ids; with the actor's own routing the
    gradients differ."""
    preset = "qwen3-vl-moe-tiny"
    batch = _batch(preset)
    results = {}
    for name, recompute, replay in (
        ("full", "full", True),
        ("none", "none", True),
        ("own", "none", False),
    ):
        actor = _actor(preset, recompute=recompute, max_tokens_per_gpu=max(LENGTHS))
        case = batch if replay else TrainBatch(batch.input_ids, batch.loss_mask, batch.advantages)
        metrics = actor.forward_backward(case, loss="grpo")
        assert metrics["num_micro_batches"] == 3
        grads = {
            n: p.main_grad.clone() for n, p in actor.module.named_parameters() if "visual" not in n
        }
        results[name] = (metrics["loss"], grads)
    router = "language_model.decoder.layers.0.mlp.router.weight"
    (loss, grads), (loss_plain, plain) = results["full"], results["none"]
    assert loss == pytest.approx(loss_plain, abs=1e-7)
    assert float(grads[router].abs().max()) > 0
    for name, g in plain.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.allclose(results["own"][1][router], plain[router], atol=1e-4)


def test_pipeline_stages_with_recomputed_routers_are_refused():
    """1F1B runs other micro-batches' forwards before a backward recomputes the routers."""
    with pytest.raises(NotImplementedError, match=r"routing_replay with pp=2 and recompute='full'"):
        MegatronConfig(pp=2, recompute="full", routing_replay=True)
    with pytest.raises(NotImplementedError, match="recompute_modules with moe"):
        MegatronConfig(pp=2, recompute="selective", recompute_modules=("moe",), routing_replay=True)
    MegatronConfig(pp=2, recompute="selective", routing_replay=True)  # core attention only
    MegatronConfig(pp=1, recompute="full", routing_replay=True)
    MegatronConfig(pp=2, recompute="full")
    replay = MegatronConfig(routing_replay=True)
    assert "cannot recompute the routers" in replay.supports(ParallelLayout(pp=2, recompute="full"))
    assert replay.supports(ParallelLayout(pp=2, recompute="selective")) is None
    assert replay.supports(ParallelLayout(pp=1, recompute="full")) is None
    run = RunContext(model="qwen3-vl-moe-tiny", seed=0, use_gpu=False, routing_replay=True)
    assert MegatronConfig().for_run(run).routing_replay  # the loop's --routing-replay
    with pytest.raises(NotImplementedError, match="pp=2"):
        MegatronConfig().for_run(
            dataclasses.replace(run, layout=ParallelLayout(pp=2, recompute="full"))
        )


# layout -> the MegatronConfig fields; each rank runs the whole batch but under ep2 (its own)
LAYOUTS = {
    "tp2_sp": dict(tp=2, sp=True, recompute="full"),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
}


@pytest.mark.slow
def test_replay_under_parallel_layouts(tmp_path, launch_ranks):
    """Each rank routes its own tokens to their ids: every layout's log-probs are
    transformers' routed to the same ids, and a training step runs."""
    preset = "qwen3-vl-moe-tiny"
    batch = _batch(preset)
    expected = _transformers_logprobs(preset, batch)
    torch.save(dict(batch=batch, layouts=LAYOUTS, preset=preset), tmp_path / "case.pt")
    results = launch_ranks(WORKER, tmp_path, 2, OMP_NUM_THREADS="1")
    for rank, result in enumerate(results):
        for layout in LAYOUTS:
            got = result[layout]
            mine = got["indices"]
            for i, lp in zip(mine, got["logprobs"], strict=True):
                torch.testing.assert_close(
                    lp, expected[i], atol=ATOL, rtol=0, msg=f"{layout} {rank}"
                )
            assert torch.isfinite(torch.tensor(got["loss"])) and got["grad_norm"] > 0, layout
