"""Every phase of a GRPO step says when it starts and ends, with its figure, and a long one says
it is still running: the real loop against groups that answer as the Ray groups do (issue 49: a
launcher that was silent for minutes while a step went nowhere)."""

from __future__ import annotations

import logging
import re
import time
from types import SimpleNamespace

import pytest
import torch

from rl_runtime import CheckpointManager, GrpoLoopConfig, GrpoParts, RunLogger, run_grpo

PUSHED_BYTES = 3 * 10**8  # what the trainer double says it pushed: 0.3 GB


class Trainer:
    """The TrainGroup surface `run_grpo` calls; `train_s` / `push_s`: how long those take."""

    def __init__(self, train_s: float = 0.0, push_s: float = 0.0) -> None:
        self.train_s, self.push_s = train_s, push_s
        self.last_push_bytes: int | None = None

    def compute_logprobs(self, batch, *, reference=False):
        return [torch.full((len(ids),), -2.0) for ids in batch.input_ids]

    def train_step(self, batch, *, loss="grpo"):
        time.sleep(self.train_s)
        return {"loss": 0.0, "grad_norm": 1.0}

    def push_weights(self, rollout, bucket_bytes):
        time.sleep(self.push_s)
        self.last_push_bytes = PUSHED_BYTES
        return 3

    def release_cache(self):
        pass

    def offload(self):
        return {"perf/offload_gb": 2.0, "perf/offload_s": 0.1, "perf/offload_gbps": 20.0}

    def onload(self):
        return {"perf/onload_gb": 2.0, "perf/onload_s": 0.05, "perf/onload_gbps": 40.0}

    def save_checkpoint(self, path):
        (path / "state.txt").write_text("trainer")


class Engine:
    """The RolloutGroup surface: three tokens per response; it captured two CUDA graphs."""

    def generate(self, prompts, *, n, seed, **sampling):
        done = SimpleNamespace(token_ids=[5, 6, 7], logprobs=[-1.0] * 3, finish_reason="stop")
        return [[SimpleNamespace(**vars(done), error=None) for _ in range(n)] for _ in prompts]

    def engine_stats(self):
        return {"seconds": 0.5, "graph_captures": 2.0, "capture_s": 1.5}

    def release_memory(self):
        pass

    def resume_memory(self, tags=None):
        pass


class Prompts:
    skipped = malformed_lines = 0

    def __len__(self) -> int:
        return 8

    def get(self, i):
        return SimpleNamespace(
            input_ids=[1, 2, 3, 4], pixel_values=None, image_grid_thw=None, answer=str(i)
        )


def _parts(tmp_path, trainer: Trainer) -> GrpoParts:
    calls = iter(range(1_000_000))
    return GrpoParts(
        train=trainer,
        rollout=Engine(),
        train_prompts=Prompts(),
        eval_prompts=Prompts(),
        decode=lambda ids: " ".join(map(str, ids)),
        # alternate 0 / 1 so each group has a learning signal and the train phase runs
        score=lambda texts, labels: [float(next(calls) % 2) for _ in texts],
        logger=RunLogger(tmp_path),
        checkpoints=CheckpointManager(tmp_path / "checkpoints"),
        offload_between_phases=True,
    )


def _config(**kw) -> GrpoLoopConfig:
    kw = {
        "num_rollout": 1,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "global_batch_size": 4,
        "eval_interval": 1,
        "eval_before_train": False,
        "use_ref_logprobs": True,
        **kw,
    }
    return GrpoLoopConfig(**kw)


def _step_lines(caplog, step: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"step {step}: ")]


def test_each_phase_logs_start_and_end_with_its_figure_in_order(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        run_grpo(_config(), _parts(tmp_path, Trainer()))
    messages = [r.getMessage() for r in caplog.records]
    assert "initial weight push ..." in messages
    lines = _step_lines(caplog, 1)
    # 2 prompts x 2 samples x 3 tokens; the train batch holds the 4 prompt tokens too
    expected = [
        ("rollout ...", None),
        (
            "rollout done in",
            r"12 tokens, [\d,]+ tokens/s, 4 samples, 2 CUDA graph\(s\) captured in 1\.5 s",
        ),
        ("reward ...", None),
        ("reward done in", r"4 samples"),
        ("onload ...", None),
        ("onload done in", r"onloaded 2\.00 GB at 40\.00 GB/s"),
        ("old log-probs ...", None),
        ("old log-probs done in", r"28 tokens, [\d,]+ tokens/s"),
        ("reference log-probs ...", None),
        ("reference log-probs done in", r"28 tokens, [\d,]+ tokens/s"),
        ("train ...", None),
        ("train done in", r"28 tokens, [\d,]+ tokens/s, 1 optimizer step"),
        ("sync ...", None),
        ("sync done in", r"pushed 0\.30 GB at [\d.]+ GB/s, offloaded 2\.00 GB at 20\.00 GB/s"),
        ("eval ...", None),
        ("eval done in", r"8 prompts, accuracy 0\.\d+"),
        ("save ...", None),
        ("save done in", r"step_0+1"),
    ]
    shown = [line for line in lines if "still running" not in line]
    assert len(shown) == len(expected), shown
    for line, (start, figure) in zip(shown, expected, strict=True):
        assert line.startswith(f"step 1: {start}"), (line, start)
        if figure:
            assert re.search(figure, line), (line, figure)
    # the sync's parts are logged below INFO: the sync line stands for them
    assert not [line for line in lines if "sync push" in line]


def test_a_long_phase_says_it_is_still_running(tmp_path, caplog):
    """A train phase of 0.4 s with a heartbeat every 0.05 s: lines in between that name it."""
    with caplog.at_level(logging.INFO):
        run_grpo(_config(progress_interval_s=0.05), _parts(tmp_path, Trainer(train_s=0.4)))
    lines = _step_lines(caplog, 1)
    start, end = (
        lines.index("step 1: train ..."),
        next(i for i, line in enumerate(lines) if line.startswith("step 1: train done in")),
    )
    beats = [line for line in lines[start:end] if "still running" in line]
    assert beats and all(
        re.fullmatch(r"step 1: train still running after [\d.]+ s", b) for b in beats
    )
    # a heartbeat of 0 never fires
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run_grpo(_config(progress_interval_s=0), _parts(tmp_path / "quiet", Trainer(train_s=0.2)))
    assert not [line for line in _step_lines(caplog, 1) if "still running" in line]


def test_the_step_row_holds_the_weight_push_rate(tmp_path):
    """``perf/sync_gb``: the bytes the trainer group counted; ``perf/sync_gbps``: over the push's
    time (``time_sync_push_s``)."""
    rows = run_grpo(_config(eval_interval=0), _parts(tmp_path, Trainer(push_s=0.1)))
    row = rows[-1]
    assert row["perf/sync_gb"] == pytest.approx(0.3)
    assert row["perf/sync_gbps"] == pytest.approx(0.3 / row["time_sync_push_s"], rel=0.05)
    assert row["perf/sync_gbps"] < 0.3 / 0.1  # the push's 0.1 s at least


def test_a_failed_phase_says_when_it_stopped(caplog):
    from rl_runtime.progress import phase

    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError), phase("rollout"):
        raise RuntimeError("engine died")
    assert re.fullmatch(r"rollout failed after [\d.]+ s", caplog.records[-1].getMessage())


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Interrupted"])
def test_an_interrupted_phase_says_interrupted_not_failed(caplog, stop):
    """Ctrl-C logged `step 5: old log-probs failed after 0.811 s` before the interrupt line."""
    from rl_runtime.faults import Interrupted
    from rl_runtime.progress import phase

    error = Interrupted("interrupted") if stop == "Interrupted" else KeyboardInterrupt()
    with caplog.at_level(logging.INFO), pytest.raises(type(error)), phase("old log-probs"):
        raise error
    assert re.fullmatch(
        r"old log-probs interrupted after [\d.]+ s", caplog.records[-1].getMessage()
    )
