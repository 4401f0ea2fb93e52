"""An alarm for a silent engine/trainer mismatch, judged on the log-prob gap of every step.

The trainer recomputes the log-probs of each rollout's responses before the update; the engine
reported its own when it sampled them. With the same weights, inputs and sampling temperature
the two differ only by rounding, which the compute dtype bounds. A stale or unpushed weight, a
wrong checkpoint or weight-name mapping, dropped or misaligned M-RoPE position ids or image
tokens, a dtype or a temperature / top-p that differs between the two sides changes the model
one side evaluates, and the gap leaves the dtype's band at the first step it happens.

The statistic is the trainer's ``rollout_logprob_abs_diff``: the mean over the step's response
tokens (the loss mask) of ``|old - rollout|``, weighted by tokens across micro-batches and ranks
(``rl_algos.GRPO_METRICS``). Why that one:

- absolute, not signed: a fault that raises some tokens' log-probs and lowers others' (a wrong
  temperature sharpens or flattens every distribution) cancels in a signed mean;
- a mean, not the maximum: the maximum over a step's thousands of tokens is an extreme value,
  set by a few near-tied logits and growing with the batch (bf16 on the H200: the 2B engine's
  maximum 0.06-0.08 where its mean was 1.2-1.8e-3; Qwen3.5's maximum 1.34), so a threshold on
  it fires on healthy runs or is too loose to see a fault, which moves every token;
- over response tokens only: the engine reports log-probs only for what it sampled (the prompt
  positions hold zeros, ``rl_runtime.rollout_batch``), so a mean over the prompt would measure
  the prompt's log-probs, not a gap;
- one step is enough: a mean over thousands of tokens moves little from step to step, while
  each fault above moves it by one or more orders of magnitude.

The bands are in :data:`BANDS`, with where each figure was measured (``docs/reliability.md``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rl_runtime.faults import LogprobMismatch

log = logging.getLogger(__name__)

#: The row metric judged (the trainer's, from ``rl_algos.grpo_loss``).
GAP_METRIC = "rollout_logprob_abs_diff"

LIKELY_CAUSES = (
    "stale or unpushed weights in the engine, a wrong checkpoint or weight-name mapping, "
    "dropped or misaligned M-RoPE position ids or image tokens, a dtype mismatch between "
    "engine and trainer, or a sampling temperature / top-p mismatch"
)


@dataclass(frozen=True)
class GapBand:
    """The healthy gap of one compute dtype (mean |trainer - engine| log-prob a response
    token, in nats) and the levels the alarm acts at."""

    dtype: str
    measured: str  # the healthy figure and where it was measured
    warn: float
    stop: float
    family: str = ""  # a model family whose own rounding sets the band ("": any model)

    @property
    def name(self) -> str:
        return f"the {self.dtype} band" + (f" of {self.family} models" if self.family else "")


#: Healthy means measured with engine and trainer in the same dtype and the same weights; the
#: warning sits 5-50x above the largest, the stop 10x above the warning (no rounding of the
#: dtype moves every token that far). CPU figures: ``tools/logprob_gap.py`` on the tiny preset's
#: trained weights (16 x 8 colour-task responses, 2026-12-04). The float32 levels leave room
#: for GPU kernels, which no float32 run has measured yet.
BANDS: dict[str, GapBand] = {
    band.dtype: band
    for band in (
        GapBand(
            "float32",
            "2.1e-7 (CPU, tiny preset); 2.3e-7 at step 1 of the tiny preset's run",
            warn=1e-5,
            stop=1e-4,
        ),
        GapBand(
            "bfloat16",
            "1.2-1.8e-3 on the Qwen3-VL-2B shape (H200, 2026-12-03, docs/guide.md 'Old "
            "log-probs'); 1.4e-3 (CPU, tiny preset); 0.7-3.6e-3 over steps 2-30 of the tiny "
            "preset's run, whose float32 engine holds the bfloat16 weights the trainer pushes",
            warn=1e-2,
            stop=1e-1,
        ),
        GapBand(
            "float16",
            "1.7e-4 (CPU, tiny preset): 8x below bfloat16's, as its 3 more mantissa bits give",
            warn=2e-3,
            stop=2e-2,
        ),
    )
}


#: The family of a model with gated-delta-net (linear-attention) layers.
LINEAR_ATTENTION = "linear-attention"

#: Families whose healthy gap sits above their dtype's band, with the evidence. Qwen3.5's
#: gated-delta-net layers: the engine's decode step and the trainers' chunked kernel compute
#: the recurrence in different orders (fla's chunk kernel runs its dots in TF32 even on float32
#: inputs) and the bf16 rounding of the MoE layers after them compounds over depth; with
#: routing replay and the float32 delta rule the random-init 8-layer cut of Qwen3.5-35B-A3B
#: stays at 0.0165 (H200) where the dense and Qwen3-VL MoE shapes of that depth stay under
#: 0.01 (docs/reliability.md, docs/benchmarks/2026-12-05-logprob-microscope.md).
FAMILY_BANDS: dict[tuple[str, str], GapBand] = {
    (band.dtype, band.family): band
    for band in (
        GapBand(
            "bfloat16",
            "0.0165 (engine decode against the forward, routing replayed, float32 delta rule; "
            "Qwen3.5-35B-A3B cut to 8 layers, random init, H200, 2026-12-06); 0.0186 before "
            "the float32 delta rule (H100, 2026-12-05); 0.118-0.23 without routing replay",
            warn=4e-2,
            stop=1e-1,
            family=LINEAR_ATTENTION,
        ),
    )
}


def band_of(dtype: str, family: str | None = None) -> GapBand:
    """The band of a compute dtype given by its torch name, a family's own where it has one."""
    if family and (dtype, family) in FAMILY_BANDS:
        return FAMILY_BANDS[dtype, family]
    try:
        return BANDS[dtype]
    except KeyError:
        raise ValueError(
            f"no log-prob gap band for dtype {dtype!r}; known: {sorted(BANDS)}"
        ) from None


def coarsest_dtype(*dtypes: str) -> str:
    """Of the engine's and the trainer's compute dtypes, the one whose rounding the gap shows:
    the one with the widest band."""
    return max(dtypes, key=lambda d: band_of(d).warn)


class LogprobGapGuard:
    """Judges each step's gap: warns once when it leaves the band, stops the run when it is
    far outside. ``warn`` / ``stop`` replace the band's levels; ``stop=0`` never stops;
    ``family`` (:data:`LINEAR_ATTENTION` or None) picks a family's band."""

    def __init__(
        self,
        dtype: str,
        warn: float | None = None,
        stop: float | None = None,
        family: str | None = None,
    ) -> None:
        self.band = band_of(dtype, family)
        self.warn = self.band.warn if warn is None else warn
        self.stop = self.band.stop if stop is None else stop
        self.warned = False

    def check(self, step: int, row: Mapping[str, Any]) -> None:
        """Judge the gap of ``step``'s logged row; a row without it (no update this step, an
        engine that reports no log-probs) is not judged. Raises :class:`LogprobMismatch`.
        A non-finite gap (a non-finite log-prob on one side) only warns: the trainer's
        non-finite log-probs make a non-finite loss, which ``--max-nonfinite-steps`` owns."""
        gap = row.get(GAP_METRIC)
        if gap is None:
            return
        gap = float(gap)
        what = (
            f"step {step}: the trainer's log-probs differ from the engine's by {gap:.3g} a "
            f"response token (mean |old - rollout|, {GAP_METRIC})"
        )
        band = self.band.name
        if self.stop and math.isfinite(gap) and gap > self.stop:
            raise LogprobMismatch(
                f"{what}, far outside {band} (stop above {self.stop:g}: --logprob-gap-stop, "
                f"0: never); likely causes: {LIKELY_CAUSES}; stopping before saving it"
            )
        if not self.warned and not (math.isfinite(gap) and gap <= self.warn):
            self.warned = True
            stop = f"stops above {self.stop:g}" if self.stop else "never stops"
            log.warning(
                "%s, outside %s (warn above %g: --logprob-gap-warn; the run %s: "
                "--logprob-gap-stop); likely causes: %s. Said once; the gap is logged every step",
                what,
                band,
                self.warn,
                stop,
                LIKELY_CAUSES,
            )
