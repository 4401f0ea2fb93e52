"""The Megatron actor's optimizer step.

AdamW (megatron-core's torch fallback, no Apex / Transformer Engine) steps in torch's fused
kernel with the arithmetic of torch's default ``foreach`` AdamW; flat masters
(``MegatronConfig.flat_masters``) step exactly as megatron-core's own per-parameter path of the
distributed optimizer: the same masters, weights and norms, in bfloat16 (masters copied back to
the weights) and float32 (the masters are the weights' views).
"""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch

from rl_algos import TrainBatch
from rl_algos.optimizer import OptimConfig
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor
from trainers_megatron.flat_masters import FlatMasters
from trainers_megatron.optim import hybrid_optimizer, optimizers


def _batch(vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in (12, 9)]
    masks = [torch.cat([torch.zeros(len(t) - 4), torch.ones(4)]) for t in ids]
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        advantages=[m * s for m, s in zip(masks, (1.0, -0.5), strict=True)],
    )


OPTIM = dict(lr=1e-2, weight_decay=0.1)


def _steps(steps: int = 1, *, fused: bool = True, max_grad_norm: float = 1.0, **config):
    """GRPO steps of a tiny actor: (the actor, the steps' metrics, weights before, weights and
    masters after). ``fused=False`` puts torch's default (foreach) AdamW back, as
    megatron-core builds it."""
    optim = OptimConfig(**OPTIM, max_grad_norm=max_grad_norm)
    settings = dict(model="qwen3-vl-tiny", optim=optim, seed=0) | config
    actor = MegatronActor(MegatronConfig(**settings))
    groups = [g for opt in optimizers(actor.optimizer) for g in opt.optimizer.param_groups]
    assert groups and all(g["fused"] for g in groups)
    if not fused:
        for g in groups:
            g["fused"], g["foreach"] = False, True

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in actor.module.named_parameters()}

    before = weights()
    batch = _batch(actor.hf_config.text_config.vocab_size)
    batch.old_logprobs = actor.compute_logprobs(batch)
    metrics = [actor.train_step(batch, loss="grpo") for _ in range(steps)]
    masters = [p.detach().clone() for o in optimizers(actor.optimizer) for p in o.get_parameters()]
    return actor, metrics, before, weights(), masters


def test_adamw_runs_fused_and_updates_as_the_foreach_default():
    _, _, before, fused, _ = _steps(fused=True)
    _, _, _, reference, _ = _steps(fused=False)
    changed = [n for n, w in fused.items() if not torch.equal(w, before[n])]
    assert len(changed) > len(fused) // 2  # the step moved the weights
    for name, w in fused.items():
        torch.testing.assert_close(w, reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_flat_masters_step_exactly_as_the_per_parameter_path(dtype):
    common = dict(steps=3, param_dtype=dtype, max_grad_norm=0.0)
    flat, flat_metrics, before, flat_weights, flat_masters = _steps(flat_masters=True, **common)
    plain, metrics, _, weights, masters = _steps(flat_masters=False, **common)
    assert flat._step.flat and not plain._step.flat
    assert [m["grad_norm"] for m in flat_metrics] == [m["grad_norm"] for m in metrics]
    changed = [n for n, w in weights.items() if not torch.equal(w, before[n])]
    assert len(changed) > len(weights) // 2  # the steps moved the weights
    differ = [n for n, w in weights.items() if not torch.equal(w, flat_weights[n])]
    assert not differ, differ
    for got, expected in zip(flat_masters, masters, strict=True):
        assert torch.equal(got, expected)


def test_clipping_inside_fused_adamw_matches_a_separate_multiply():
    common = dict(steps=3, param_dtype="float32", max_grad_norm=0.05)
    _, flat_metrics, _, _, flat_masters = _steps(flat_masters=True, **common)
    _, metrics, _, _, masters = _steps(flat_masters=False, **common)
    norms = [m["grad_norm"] for m in metrics]
    assert all(n > 0.05 for n in norms)  # every step was clipped
    assert flat_metrics[0]["grad_norm"] == norms[0]
    for got, expected in zip(flat_masters, masters, strict=True):
        # g / (norm / max) against g * (max / norm): one rounding apart before AdamW
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_bf16_weights_are_the_flat_masters_rounded():
    actor = _steps(param_dtype="bfloat16", max_grad_norm=1.0)[0]
    [(opt, flat)] = actor._step.parts
    assert isinstance(flat, FlatMasters)
    flats = list(flat.tensors())
    storages = {t.untyped_storage().data_ptr() for t in flats}
    for main in opt.get_parameters():  # every master is a view of a bucket's flat tensor
        assert main.untyped_storage().data_ptr() in storages
    groups = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
    for model_group, main_group in groups:
        for param, main in zip(model_group, main_group, strict=True):
            assert torch.equal(param.detach().view(-1), main.to(torch.bfloat16))
    assert sum(t.numel() for t in flats) >= sum(p.numel() for p in actor.module.parameters())


# ------------------------------------------------------------------------------------------
# The optimizer on the host (``optimizer_offload``, the launchers' --optimizer-cpu-offload):
# megatron-core's HybridDeviceOptimizer under its precision-aware distributed optimizer.
#
# Without CUDA the CPU plays the device (``vlm_models.megatron._cpu_compat``: the first
# ``offload_fraction`` of the elements get host copies, stepped by torch's fused CPU AdamW and
# copied back, as CUDA parameters would; the CUDA streams of the overlap do nothing), so these
# tests check megatron-core's offload path as we drive it: gradients handed over as
# ``decoupled_grad``, clipping as each AdamW's ``grad_scale``, the host half stepped in pieces
# (trainer_core.host_adamw) or by megatron-core's own step, the weights written back, and the
# checkpoint round trip (a fresh hybrid optimizer initialises its state by a step on random
# gradients). The pieces' pinned copies on two streams run on a GPU only.

# bf16 weights (megatron-core's precision-aware optimizer takes no float32 ones); clipping in
# every step (the norms are above 0.05)
COMMON = dict(param_dtype="bfloat16", optim=OptimConfig(**OPTIM, max_grad_norm=0.05))


@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "megatron-core"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_host_step_equals_the_device_step(fraction, pieces):
    """Three steps with half or all of the optimizer on the host give the weights of the
    optimizer on the device (flat masters, torch's fused AdamW), whether the host half steps in
    pieces (trainer_core.host_adamw, the default) or by megatron-core's own step
    (``overlap_cpu_optimizer_d2h_h2d`` off). All run torch's fused AdamW kernel on the same
    float32 values with the clip factor as its ``grad_scale``, so they agree to the bit; the
    bound is the issue's 1e-6 (any float32 difference would reach the bf16 weights and the
    next gradients, far above it after three steps at lr 1e-2). In pieces the host keeps no
    float32 copy of the gradients (megatron-core's own step keeps one per parameter)."""
    device, expected, before, weights, _ = _steps(steps=3, **COMMON)
    host, got, _, host_weights, _ = _steps(
        steps=3, optimizer_offload=fraction, overlap_cpu_optimizer_d2h_h2d=pieces, **COMMON
    )
    hybrid = hybrid_optimizer(host.optimizer)
    assert device._step.flat and hybrid is not None
    assert (host._step.host_adamw is not None) == pieces
    copies = [hybrid.cpu_copy_map_grad.get(p) for sub in hybrid.cpu_optimizers for p in sub.state]
    assert all(c is None for c in copies) if pieces else all(c is not None for c in copies)
    norms = [m["grad_norm"] for m in got]
    assert norms == [m["grad_norm"] for m in expected] and min(norms) > 0.05
    assert all(m["perf/optimizer_s"] > 0 for m in got)
    changed = [n for n, w in host_weights.items() if not torch.equal(w, before[n])]
    assert len(changed) > len(host_weights) // 2  # the steps moved the weights
    for name, w in host_weights.items():
        torch.testing.assert_close(w, weights[name], rtol=0, atol=1e-6, msg=name)
    # the hybrid optimizer owns the state its host half stepped (its checkpoints read it)
    for sub in hybrid.cpu_optimizers:
        for master, state in sub.state.items():
            assert hybrid.state[hybrid.inner_param_to_orig_param[master]] is state
            assert state["step"].item() == 3


def test_the_fraction_splits_host_and_device_optimizers():
    """Half offloaded: host copies of the first parameters up to half of the elements, each
    stepped by its own AdamW (the overlap's one optimizer per parameter), the rest by one
    device AdamW."""
    actor = MegatronActor(MegatronConfig(model="qwen3-vl-tiny", optimizer_offload=0.5, **COMMON))
    [opt] = optimizers(actor.optimizer)
    hybrid = hybrid_optimizer(opt)
    host = [p for sub in hybrid.cpu_optimizers for g in sub.param_groups for p in g["params"]]
    total = sum(p.numel() for g in hybrid.param_groups for p in g["params"])
    assert len(hybrid.cpu_optimizers) == len(host) > 1
    # the first parameters up to half of the elements: the last one crosses the half
    offloaded = sum(p.numel() for p in host)
    assert offloaded - host[-1].numel() < 0.5 * total <= offloaded < total
    assert hybrid.gpu_optimizer is not None
    assert all(p.dtype == torch.float32 for p in host)
    # the distributed optimizer keeps no float32 masters of its own in this form
    assert all(m is None for group in opt.shard_fp32_from_float16_groups for m in group)


def test_offloaded_checkpoint_resumes_exactly(tmp_path):
    """Save after one step; the second step from the checkpoint, in the same actor and in a
    fresh one (whose empty hybrid optimizer first steps on random gradients), is the second
    step taken without stopping, to the bit."""
    config = MegatronConfig(model="qwen3-vl-tiny", optimizer_offload=1.0, **COMMON)
    actor = MegatronActor(config)
    batch = _batch(actor.hf_config.text_config.vocab_size)
    batch.old_logprobs = actor.compute_logprobs(batch)
    actor.train_step(batch, loss="grpo")
    actor.save_checkpoint(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "rank00000.pt", weights_only=True)
    assert saved["optimizer"] is not None
    second = actor.train_step(batch, loss="grpo")
    expected = {n: p.detach().clone() for n, p in actor.module.named_parameters()}

    for resumed in (actor, MegatronActor(config)):
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.step == 1
        got = resumed.train_step(batch, loss="grpo")
        assert got["grad_norm"] == second["grad_norm"] and got["lr"] == second["lr"]
        for name, p in resumed.module.named_parameters():
            assert torch.equal(p, expected[name]), name


def test_offload_needs_the_distributed_optimizer_and_bf16():
    with pytest.raises(ValueError, match="distributed optimizer"):
        MegatronConfig(optimizer_offload=1.0, distributed_optimizer=False)
    with pytest.raises(ValueError, match="bf16"):
        MegatronActor(MegatronConfig(model="qwen3-vl-tiny", optimizer_offload=1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_host_masters_move_to_pinned_memory_of_their_own_size():
    """megatron-core pins each host master through the caching host allocator (a 192 MiB
    tensor locks 256 MiB); the large ones move, keeping their objects and values."""
    from types import SimpleNamespace

    from trainers_megatron.optim import exact_pinned_masters

    big = torch.arange(3 * (1 << 24) + 5, dtype=torch.float32).pin_memory()
    small = torch.ones(10).pin_memory()
    expected = big.clone()
    hybrid = SimpleNamespace(cpu_copys_map_gpu_param={big: None, small: None})
    assert exact_pinned_masters(hybrid) == big.numel() * 4
    gc.collect()  # the registration outlives the temporary tensor that made it
    assert big.is_pinned() and small.is_pinned() and torch.equal(big, expected)
    assert big in hybrid.cpu_copys_map_gpu_param  # the same object, new storage
    assert exact_pinned_masters(hybrid) == 0  # (as its post-load hook: moved once only)


def _hybrid(device: str, sizes: list[int], fraction: float):
    """A HybridDeviceOptimizer over bf16 shards with float32 gradients, as
    ``get_megatron_optimizer`` builds it for --optimizer-cpu-offload (fused torch AdamW, one
    host optimizer per parameter), from seeded values."""
    import megatron.core.optimizer as mcore_optimizer

    from trainers_megatron.optim import exact_pinned_masters

    gen = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter((0.02 * torch.randn(n, generator=gen)).bfloat16().to(device))
        p.decoupled_grad = (1e-3 * torch.randn(n, generator=gen)).to(device)
        params.append(p)
    hybrid = mcore_optimizer.HybridDeviceOptimizer(
        [{"params": params, "wd_mult": 1.0, "lr_mult": 1.0}],
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        overlap_cpu_optimizer_d2h_h2d=True,
        pin_cpu_grads=False,
        pin_cpu_params=device == "cuda",
        param_update_in_fp32=True,
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    exact_pinned_masters(hybrid)
    return hybrid, params


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plays device")
        ),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_pieces_step_exactly_as_megatron_cores_own_step(device):
    """The host half in pieces (``host_step.step_in_pieces``: pinned buffers, two CUDA streams
    on a GPU) and megatron-core's own HybridDeviceOptimizer step, from the same values, over
    parameters larger than a piece (``chunk`` cut to 1,000 elements), the device half too, with
    a gradient scale: three steps give the same bf16 weights, float32 masters and moments, to
    the bit (the same fused AdamW kernel on the same float32 values)."""
    if device == "cpu":
        from vlm_models.megatron import apply_cpu_compat

        apply_cpu_compat()
    from trainers_megatron.host_step import host_adamw_for, step_in_pieces

    sizes = [2500, 700, 1000, 3, 1800]
    own, own_params = _hybrid(device, sizes, fraction=0.6)
    ours, our_params = _hybrid(device, sizes, fraction=0.6)
    adamw = host_adamw_for(ours)
    adamw.chunk = 1000  # several pieces a parameter
    before = [p.detach().clone() for p in our_params]
    for _ in range(3):
        # the scale as OptimizerStep._hybrid_step gives it: every AdamW's grad_scale (the
        # pieces read theirs from the call)
        for sub in [*own.sub_optimizers, ours.gpu_optimizer]:
            sub.grad_scale = torch.full((), 2.0, device=sub.param_groups[0]["params"][0].device)
        own.step()
        step_in_pieces(ours, adamw, 2.0)
    if device == "cuda":
        torch.cuda.synchronize()
    assert ours.cpu_optimizers and ours.gpu_optimizer is not None
    for mine, theirs, first in zip(our_params, own_params, before, strict=True):
        assert torch.equal(mine, theirs)
        assert not torch.equal(mine, first)  # the steps moved it
    for a, b in zip(ours.sub_optimizers, own.sub_optimizers, strict=True):
        for p, q in zip(a.state, b.state, strict=True):
            assert torch.equal(p, q)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(a.state[p][key], b.state[q][key]), key
