"""Policy / KL / SFT losses and aggregation: hand-computed values and metrics."""

import itertools
import math

import pytest
import torch

from rl_algos import GrpoLossConfig, aggregate_loss, grpo_loss, kl_penalty, policy_loss, sft_loss

LN = math.log


def _ones(n):
    return torch.ones(n)


def test_aggregation_modes_hand_values():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mask = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    cu = [0, 3, 5]
    agg = aggregate_loss
    torch.testing.assert_close(agg(values, mask, cu, "token-mean"), torch.tensor(10 / 3))
    torch.testing.assert_close(agg(values, mask, cu, "seq-mean-token-mean"), torch.tensor(2.75))
    torch.testing.assert_close(  # (1 + 9) / (2 samples * 4)
        agg(values, mask, cu, "seq-mean-token-sum-norm", norm_length=4), torch.tensor(1.25)
    )
    torch.testing.assert_close(  # default norm: longest masked span (2)
        agg(values, mask, cu, "seq-mean-token-sum-norm"), torch.tensor(2.5)
    )
    # A sample without loss tokens does not count in seq-mean-token-mean.
    cu3 = [0, 1, 3, 5]
    mask3 = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(agg(values, mask3, cu3, "seq-mean-token-mean"), torch.tensor(2.75))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg(values, mask, cu, "sum")


def test_ppo_clip_higher_and_dual_clip_hand_values():
    # ratios 1.5, 1.5, 0.5, 0.5, 1.25, 5 with advantages +1, -1, +1, -1, +1, -1
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.25, 5.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    lp = torch.log(ratios).requires_grad_()
    old = torch.zeros(6)
    cfg = GrpoLossConfig(eps_clip=0.2, eps_clip_high=0.28)
    kw = {"old_logprobs": old, "advantages": adv, "loss_mask": _ones(6), "cu_seqlens": [0, 6]}
    loss, m = policy_loss(lp, config=cfg, **kw)
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    per_token = torch.tensor([-1.28, 1.5, -0.5, 0.8, -1.25, 5.0])
    torch.testing.assert_close(loss, per_token.mean())
    torch.testing.assert_close(m["clip_frac"], torch.tensor(2 / 6))  # tokens 0 and 3
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(1 / 6))
    torch.testing.assert_close(m["clip_frac_low"], torch.tensor(1 / 6))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(5.0))
    torch.testing.assert_close(m["ppo_kl"], -torch.log(ratios).mean())
    k3 = (1 / ratios) + torch.log(ratios) - 1
    torch.testing.assert_close(m["approx_kl"], k3.mean())
    # Gradient: clipped tokens get none; unclipped get -A * r / T.
    loss.backward()
    expected = torch.tensor([0.0, 1.5, -0.5, 0.0, -1.25, 5.0]) / 6
    torch.testing.assert_close(lp.grad, expected)

    # Symmetric clip (eps_high = 0.2) clips the 1.25 ratio too.
    loss_sym, _ = policy_loss(lp, config=GrpoLossConfig(eps_clip_high=0.2), **kw)
    torch.testing.assert_close(loss_sym, torch.tensor([-1.2, 1.5, -0.5, 0.8, -1.2, 5.0]).mean())
    # Dual clip caps the negative-advantage loss at c * |A|.
    loss_dual, m = policy_loss(lp, config=GrpoLossConfig(dual_clip_c=3.0), **kw)
    torch.testing.assert_close(loss_dual, torch.tensor([-1.28, 1.5, -0.5, 0.8, -1.25, 3.0]).mean())
    torch.testing.assert_close(m["dual_clip_frac"], torch.tensor(1 / 6))


def test_loss_mask_excludes_tokens():
    lp = torch.tensor([0.0, 5.0, 0.0])
    loss, m = policy_loss(
        lp,
        old_logprobs=torch.zeros(3),
        advantages=torch.tensor([1.0, 100.0, 1.0]),
        loss_mask=torch.tensor([1.0, 0.0, 1.0]),
        cu_seqlens=[0, 3],
        config=GrpoLossConfig(),
    )
    torch.testing.assert_close(loss, torch.tensor(-1.0))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.0))


def test_gspo_sequence_ratio():
    # Sample 0: token log-ratios 0.1, 0.3 -> sequence ratio exp(0.2) on both tokens.
    # Sample 1: log-ratio 0.0 on its one masked token (the second is masked out).
    lp = torch.tensor([0.1, 0.3, 0.0, 9.0], requires_grad=True)
    cfg = GrpoLossConfig(gspo=True, eps_clip=0.5, eps_clip_high=0.5)
    loss, m = policy_loss(
        lp,
        old_logprobs=torch.zeros(4),
        advantages=torch.tensor([1.0, 1.0, 2.0, 2.0]),
        loss_mask=torch.tensor([1.0, 1.0, 1.0, 0.0]),
        cu_seqlens=[0, 2, 4],
        config=cfg,
    )
    r = math.exp(0.2)
    torch.testing.assert_close(loss, torch.tensor((-r - r - 2.0) / 3))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(r))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-r / 3, -r / 3, -2 / 3, 0.0]))


def test_tis_weights_and_rollout_gap():
    cfg = GrpoLossConfig(use_tis=True, tis_cap=2.0)
    old = torch.zeros(2)
    rollout = torch.tensor([-LN(3.0), -LN(1.5)])  # weights 3 -> capped 2, and 1.5
    lp = torch.zeros(2, requires_grad=True)
    loss, m = policy_loss(
        lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0, 1.0]),
        loss_mask=_ones(2),
        cu_seqlens=[0, 2],
        config=cfg,
        rollout_logprobs=rollout,
    )
    torch.testing.assert_close(loss, torch.tensor((-2.0 - 1.5) / 2))
    torch.testing.assert_close(m["tis_clip_frac"], torch.tensor(0.5))
    torch.testing.assert_close(m["tis_weight_mean"], torch.tensor(1.75))
    torch.testing.assert_close(m["rollout_logprob_abs_diff"], torch.tensor((LN(3) + LN(1.5)) / 2))
    torch.testing.assert_close(m["rollout_logprob_abs_diff_max"], torch.tensor(LN(3.0)))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(
            lp,
            old_logprobs=old,
            advantages=torch.ones(2),
            loss_mask=_ones(2),
            cu_seqlens=[0, 2],
            config=cfg,
        )


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([LN(2.0)]))
    torch.testing.assert_close(kl_penalty(lp, ref, "kl"), torch.tensor([LN(2.0)]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * LN(2.0) ** 2]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.5 + LN(2.0) - 1]))
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor([0.5 + LN(2.0) - 1]))
    # clamped: a reference far more likely than the policy cannot blow up
    big = kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0
    assert kl_penalty(torch.tensor([0.3]), torch.tensor([0.3]), "k3").item() == 0.0
    with pytest.raises(ValueError, match="kl kind"):
        kl_penalty(lp, ref, "k4")


def test_grpo_loss_combines_terms():
    torch.manual_seed(0)
    n = 7
    lp = (torch.randn(n) * 0.1).requires_grad_()
    old = lp.detach() + 0.05 * torch.randn(n)
    ref = lp.detach() + 0.2 * torch.randn(n)
    ent = torch.rand(n, requires_grad=True)
    adv = torch.randn(n)
    mask = torch.tensor([0.0, 1, 1, 1, 0, 1, 1])
    cu = [0, 4, 7]
    cfg = GrpoLossConfig(
        kl_coef=0.1, kl_type="k3", entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean"
    )
    loss, m = grpo_loss(
        lp,
        old_logprobs=old,
        advantages=adv,
        loss_mask=mask,
        cu_seqlens=cu,
        config=cfg,
        ref_logprobs=ref,
        entropy=ent,
    )
    pg, _ = policy_loss(
        lp, old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=cfg
    )
    kl = aggregate_loss(kl_penalty(lp, ref, "k3"), mask, cu, "seq-mean-token-mean")
    e = aggregate_loss(ent, mask, cu, "seq-mean-token-mean")
    torch.testing.assert_close(loss, pg + 0.1 * kl - 0.01 * e)
    torch.testing.assert_close(m["kl_loss"], kl.detach())
    torch.testing.assert_close(m["entropy"], e.detach())
    torch.testing.assert_close(m["loss"], loss.detach())
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    assert lp.grad is not None and ent.grad is not None
    assert lp.grad[0] == 0 and lp.grad[4] == 0  # masked tokens get no gradient


def test_grpo_loss_argument_errors():
    kw = {
        "old_logprobs": torch.zeros(2),
        "advantages": torch.zeros(2),
        "loss_mask": _ones(2),
        "cu_seqlens": [0, 2],
    }
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(torch.zeros(2), config=GrpoLossConfig(kl_coef=0.1), **kw)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(torch.zeros(2), config=GrpoLossConfig(entropy_coef=0.1), **kw)
    with pytest.raises(ValueError, match="expected"):
        grpo_loss(torch.zeros(3), config=GrpoLossConfig(), **kw)
    with pytest.raises(ValueError, match="dual_clip_c"):
        GrpoLossConfig(dual_clip_c=0.5)


def test_sft_loss_hand_values():
    lp = torch.tensor([0.0, LN(0.5), LN(0.25), 0.0, LN(0.5)])
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    cu = [0, 3, 5]
    torch.testing.assert_close(sft_loss(lp, mask, cu), torch.tensor((LN(2) + LN(4) + LN(2)) / 3))
    torch.testing.assert_close(
        sft_loss(lp, mask, cu, "seq-mean-token-mean"),
        torch.tensor(((LN(2) + LN(4)) / 2 + LN(2)) / 2),
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_denominator_makes_micro_batches_sum_to_full_batch(mode):
    torch.manual_seed(3)
    lengths = [3, 5, 2, 4]
    total = sum(lengths)
    lp = torch.randn(total) * 0.1
    old = lp + 0.05 * torch.randn(total)
    adv = torch.randn(total)
    mask = (torch.rand(total) > 0.3).float()
    cu = [0, 3, 8, 10, 14]
    cfg = GrpoLossConfig(loss_agg_mode=mode, norm_length=6)
    full, _ = grpo_loss(
        lp, old_logprobs=old, advantages=adv, loss_mask=mask, cu_seqlens=cu, config=cfg
    )
    seq_has = [mask[a:b].sum() > 0 for a, b in itertools.pairwise(cu)]
    if mode == "token-mean":
        denom = float(mask.sum())
    elif mode == "seq-mean-token-mean":
        denom = float(sum(seq_has))
    else:
        denom = float(len(lengths))
    parts = []
    for lo, hi, sub_cu in ((0, 8, [0, 3, 8]), (8, 14, [0, 2, 6])):
        loss, _ = grpo_loss(
            lp[lo:hi],
            old_logprobs=old[lo:hi],
            advantages=adv[lo:hi],
            loss_mask=mask[lo:hi],
            cu_seqlens=sub_cu,
            config=cfg,
            denominator=denom,
        )
        parts.append(loss)
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_sft_loss_matches_shifted_cross_entropy():
    """aligned_logprobs + sft_loss == the usual shift-by-one cross-entropy on one sample."""
    from rl_algos import aligned_logprobs

    torch.manual_seed(4)
    logits = torch.randn(9, 13)
    ids = torch.randint(0, 13, (9,))
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 1.0])
    ours = sft_loss(aligned_logprobs(logits, ids, [0, 9]), mask, [0, 9])
    labels = torch.where(mask[1:] > 0, ids[1:], torch.tensor(-100))
    ref = torch.nn.functional.cross_entropy(logits[:-1], labels, ignore_index=-100)
    torch.testing.assert_close(ours, ref)


def test_non_finite_values_outside_mask_do_not_leak():
    lp = torch.tensor([float("-inf"), -0.5, float("nan")], requires_grad=True)
    kw = {
        "old_logprobs": torch.tensor([0.0, -0.5, 0.0]),
        "advantages": torch.ones(3),
        "loss_mask": torch.tensor([0.0, 1.0, 0.0]),
        "cu_seqlens": [0, 3],
    }
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = GrpoLossConfig(loss_agg_mode=mode, gspo=mode == "seq-mean-token-mean")
        loss, _ = grpo_loss(lp, config=cfg, **kw)
        assert torch.isfinite(loss)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(grad[1]) and grad[1] != 0


def test_loss_denominator_counts_tokens_samples_with_tokens_and_samples() -> None:
    from rl_algos import loss_denominator

    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    assert loss_denominator(masks, "token-mean") == 3.0
    assert loss_denominator(masks, "seq-mean-token-mean") == 2.0
    assert loss_denominator(masks, "seq-mean-token-sum-norm") == 3.0
    with pytest.raises(ValueError, match="aggregation mode"):
        loss_denominator(masks, "sum")


def test_grpo_loss_and_metrics_never_read_the_device():
    """No op whose output size or value comes from the data (a host sync on CUDA) in the loss,
    its metrics or its backward; ``ratio_min`` / ``ratio_max`` once indexed by the mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default}
    found: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            by_mask = func is torch.ops.aten.index.Tensor and any(
                t is not None and t.dtype == torch.bool for t in args[1]
            )
            if func in reads or by_mask:
                found.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(12, generator=gen, requires_grad=True)
    old = logprobs.detach() + 0.1 * torch.randn(12, generator=gen)
    mask = torch.tensor([1.0] * 3 + [0.0] * 2 + [1.0] * 7)
    with Reads():
        loss, metrics = grpo_loss(
            logprobs,
            old_logprobs=old,
            advantages=torch.randn(12, generator=gen),
            loss_mask=mask,
            cu_seqlens=[0, 5, 12],
            config=GrpoLossConfig(),
        )
        loss.backward()
    assert found == []
    ratio = torch.exp(logprobs.detach() - old)[mask > 0]
    assert metrics["ratio_max"].item() == pytest.approx(ratio.max().item())
    assert metrics["ratio_min"].item() == pytest.approx(ratio.min().item())
