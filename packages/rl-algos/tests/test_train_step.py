"""The backend-neutral trainer step: metrics reductions (over micro-batches and two gloo
ranks, one host read), loss objects, loss scaling and the non-finite skip, on a toy backend."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rl_algos import (
    GrpoLoss,
    GrpoLossConfig,
    MicroBatches,
    SftLoss,
    StepMetrics,
    TrainBatch,
    grpo_loss,
    resolve_loss,
    run_sequentially,
    sft_loss,
    train_step,
)

WORKER = Path(__file__).with_name("metrics_worker.py")
SPECS = {"m": "mean", "s": "sum", "lo": "min", "hi": "max", "never": "max"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_reduce_over_micro_batches_and_ranks(tmp_path):
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path / f"{r}.json")],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["m"] == pytest.approx((1 * 1 + 3 * 3 + 5 * 4) / 8)  # weighted mean
        assert got["s"] == 9.0 and got["lo"] == 1.0 and got["hi"] == 5.0
        assert "never" not in got  # produced by no rank
        assert got["x"] == float(rank)  # extras are read, not reduced


def test_undeclared_metric_is_refused():
    with pytest.raises(ValueError, match="not declared"):
        StepMetrics({"a": "mean"}, "cpu").add("b", 1.0)
    with pytest.raises(ValueError, match="reduction"):
        StepMetrics({"a": "median"}, "cpu")


def test_metrics_are_read_once(monkeypatch):
    """No host read per micro-batch: only read() moves values to the host (one tolist)."""
    metrics = StepMetrics(SPECS, "cpu")
    calls = []
    monkeypatch.setattr(Tensor, "item", lambda self: calls.append("item"))
    for v in (1.0, 2.0, 3.0):
        metrics.update({"m": torch.tensor(v), "hi": torch.tensor(v)}, 2.0)
    assert calls == []
    assert metrics.read()["hi"] == 3.0


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 9, 5, 8]
    masks = [torch.cat([torch.zeros(n // 2), torch.ones(n - n // 2)]) for n in lengths]
    return TrainBatch(
        input_ids=[torch.randint(0, 50, (n,), generator=gen) for n in lengths],
        loss_mask=masks,
        advantages=[m * s for m, s in zip(masks, (1.0, -1.0, 0.5, 2.0), strict=True)],
        old_logprobs=[-torch.rand(n, generator=gen) for n in lengths],
    )


@dataclass
class _MB:
    """The MicroBatch fields the step reads."""

    indices: list[int]
    lengths: list[int]
    fields: dict[str, Tensor]
    loss_tokens: list[int]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def real_cu_seqlens(self) -> list[int]:
        return [0, *torch.tensor(self.lengths).cumsum(0).tolist()]


@dataclass
class ToyBackend:
    """A backend whose 'model' is one log-prob per token position (a parameter)."""

    batch: TrainBatch
    max_tokens: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: object = None
    step: int = 0
    params: list[Tensor] = field(default_factory=list)
    updates: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = [torch.full((n,), -1.0, requires_grad=True) for n in self.batch.lengths]

    def micro_batches(self, batch, fields):
        plan, cur = [], []
        for i, n in enumerate(batch.lengths):
            if cur and sum(batch.lengths[j] for j in cur) + n > self.max_tokens:
                plan.append(cur)
                cur = []
            cur.append(i)
        plan.append(cur)

        def build(idx):
            return _MB(
                indices=list(idx),
                lengths=[batch.lengths[i] for i in idx],
                fields={
                    f: torch.cat([getattr(batch, f)[i] for i in idx])
                    for f in fields
                    if getattr(batch, f) is not None
                },
                loss_tokens=[int(batch.loss_mask[i].sum()) for i in idx],
            )

        return MicroBatches(plan, build)

    def run_micro_batches(self, micro_batches, loss_fn, *, entropy):
        def forward(mb):
            return torch.cat([self.params[i] * 1.0 for i in mb.indices]), None

        run_sequentially(micro_batches, forward, Tensor.backward, loss_fn)

    def finish_grads(self) -> Tensor:
        return torch.cat([p.grad for p in self.params]).norm()

    def apply_update(self, grad_norm):
        self.updates.append(grad_norm)
        for p in self.params:
            p.grad = None
        return 0.1


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", ["grpo", "sft"])
def test_micro_batches_sum_to_the_whole_batch_loss(name, mode):
    """Scaled micro-batch losses add up to the loss (and gradient) of one big batch."""
    batch = _batch()
    loss = resolve_loss(name, grpo=GrpoLossConfig(loss_agg_mode=mode), sft_agg_mode=mode)
    whole = ToyBackend(batch, max_tokens=100)
    split = ToyBackend(batch, max_tokens=10)
    a = train_step.train_step(whole, batch, loss)
    b = train_step.train_step(split, batch, loss)
    assert a["num_micro_batches"] == 1 and b["num_micro_batches"] == 4
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    # the loss of the whole batch, as the functional losses compute it
    lp = torch.cat([p.detach() for p in whole.params])
    cu = [0, *torch.tensor(batch.lengths).cumsum(0).tolist()]
    mask = torch.cat(batch.loss_mask)
    norm = max(int(m.sum()) for m in batch.loss_mask)
    if name == "grpo":
        cfg = GrpoLossConfig(loss_agg_mode=mode, norm_length=norm)
        expected, _ = grpo_loss(
            lp,
            old_logprobs=torch.cat(batch.old_logprobs),
            advantages=torch.cat(batch.advantages),
            loss_mask=mask,
            cu_seqlens=cu,
            config=cfg,
        )
    else:
        expected = sft_loss(lp, mask, cu, mode, norm_length=norm)
    assert a["loss"] == pytest.approx(float(expected), rel=1e-6)
    assert a["tokens"] == batch.num_tokens and a["lr"] == 0.1 and a["step"] == 1.0


def test_nonfinite_gradient_skips_the_update():
    batch = _batch()
    backend = ToyBackend(batch, max_tokens=10)
    bad = TrainBatch(
        **{**batch.__dict__, "advantages": [a * float("nan") for a in batch.advantages]}
    )
    out = train_step.train_step(backend, bad, GrpoLoss())
    assert out["update_skipped"] == 1.0 and out["step"] == 1.0
    assert backend.updates == [None]  # the backend was told to drop the gradients
    out = train_step.train_step(backend, batch, GrpoLoss())
    assert out["update_skipped"] == 0.0 and backend.updates[-1] == pytest.approx(out["grad_norm"])


def test_the_step_is_timed_under_a_name_of_its_own():
    """The trainer's step time is ``perf/train_step_s``: a GRPO row holds the loop's whole step
    (``perf/grpo_step_s``) beside it, and neither is a bare ``step_time_s`` / ``time_step_s``."""
    batch = _batch()
    out = train_step.train_step(ToyBackend(batch, max_tokens=10), batch, GrpoLoss())
    assert out["perf/train_step_s"] > 0 and out["tokens_per_s"] > 0
    assert not {"step_time_s", "time_step_s"} & out.keys()


def test_a_long_step_logs_its_micro_batch_progress(caplog):
    """``train: micro-batch i/N`` lines from the rank that reports (here every micro-batch: an
    interval of 0 s); none from a rank that does not, none from a step shorter than the
    interval (the default 10 s)."""
    batch = _batch()
    with caplog.at_level(logging.INFO, logger="glimpse.progress"):
        train_step.accumulate(ToyBackend(batch, 10), batch, GrpoLoss(), progress_every_s=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "glimpse.progress"]
    assert [line.split(" after ")[0] for line in lines] == [
        f"train: micro-batch {i}/4" for i in range(1, 5)
    ]
    caplog.clear()
    silent = ToyBackend(batch, 10)
    silent.reports_progress = False  # e.g. a Megatron rank off the last pipeline stage
    with caplog.at_level(logging.INFO, logger="glimpse.progress"):
        train_step.accumulate(silent, batch, GrpoLoss(), progress_every_s=0)
        train_step.train_step(ToyBackend(batch, 10), batch, GrpoLoss())
    assert not [r for r in caplog.records if r.name == "glimpse.progress"]


def test_bad_requests_are_clear():
    batch = _batch()
    with pytest.raises(ValueError, match="loss must be"):
        resolve_loss("dpo", grpo=GrpoLossConfig())
    no_adv = TrainBatch(input_ids=batch.input_ids, loss_mask=batch.loss_mask)
    with pytest.raises(ValueError, match="advantages"):
        train_step.train_step(ToyBackend(no_adv, 10), no_adv, GrpoLoss())
    with pytest.raises(ValueError, match="ref_logprobs"):
        train_step.train_step(ToyBackend(batch, 10), batch, GrpoLoss(GrpoLossConfig(kl_coef=0.1)))
    assert isinstance(resolve_loss("sft", grpo=GrpoLossConfig()), SftLoss)


def test_peak_host_memory_follows_what_the_process_touched():
    """``perf/host_peak_gib`` (every train step's row) is the process's peak resident memory:
    in a fresh process, writing half a GiB more than its peak so far (the imports' transient
    peak can lie above what stays resident) raises the peak by at least half a GiB and by no
    more than that block on top of the peak, with half a GiB of slack."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from rl_algos.metrics import peak_rss_gib\n"
        "before = peak_rss_gib()\n"
        "block = np.ones(int((before + 0.5) * 2**30) // 8)\n"  # written: resident
        "print(before, peak_rss_gib())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    assert before + 0.45 <= after <= 2 * before + 1.0, (before, after)
