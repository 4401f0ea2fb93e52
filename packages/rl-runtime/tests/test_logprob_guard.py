"""The log-prob gap alarm's decisions: the bands per dtype, a warning once outside the band, a
one-line stop far outside it, the settings that move or switch off the levels."""

from __future__ import annotations

import logging

import pytest

from rl_runtime import RunStopped
from rl_runtime.faults import LogprobMismatch
from rl_runtime.logprob_guard import (
    BANDS,
    GAP_METRIC,
    LogprobGapGuard,
    band_of,
    coarsest_dtype,
)


def _row(gap: float) -> dict[str, float]:
    return {"step": 1, GAP_METRIC: gap}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_bands_widen_with_the_dtypes_rounding():
    f32, f16, bf16 = (band_of(d) for d in ("float32", "float16", "bfloat16"))
    for band in BANDS.values():
        assert 0 < band.warn < band.stop, band
    assert f32.stop < f16.warn and f16.stop < bf16.stop and f16.warn < bf16.warn
    # the gap is judged by the coarser side, whichever it is
    assert coarsest_dtype("float32", "bfloat16") == coarsest_dtype("bfloat16", "float32")
    assert coarsest_dtype("bfloat16", "float32") == "bfloat16"
    assert coarsest_dtype("float16", "float32") == "float16"
    assert coarsest_dtype("float16", "bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match=r"float8.*known"):
        band_of("float8")


def test_a_gap_inside_the_band_says_nothing(caplog):
    guard = LogprobGapGuard("float32")
    with caplog.at_level(logging.WARNING):
        for step in range(1, 4):
            guard.check(step, _row(guard.warn / 2))
        guard.check(4, {"step": 4})  # no update that step: nothing to judge
    assert not _warnings(caplog)


def test_outside_the_band_warns_once(caplog):
    guard = LogprobGapGuard("bfloat16")
    between = (guard.warn + guard.stop) / 2
    with caplog.at_level(logging.WARNING):
        guard.check(1, _row(guard.warn / 2))
        guard.check(2, _row(between))
        guard.check(3, _row(between))
        guard.check(4, _row(guard.warn / 2))
        guard.check(5, _row(between))
    [message] = _warnings(caplog)
    assert message.startswith("step 2: ") and "bfloat16 band" in message
    assert "stale or unpushed weights" in message and "--logprob-gap-warn" in message


@pytest.mark.parametrize("dtype", sorted(BANDS))
def test_far_outside_the_band_stops_in_one_line(dtype):
    guard = LogprobGapGuard(dtype)
    guard.check(1, _row(guard.stop * 0.99))  # warns, does not stop
    with pytest.raises(LogprobMismatch) as err:
        guard.check(2, _row(guard.stop * 1.01))
    message = str(err.value)
    assert isinstance(err.value, RunStopped) and "\n" not in message
    assert message.startswith("step 2: the trainer's log-probs differ from the engine's")
    assert f"far outside the {dtype} band" in message and "--logprob-gap-stop" in message
    for cause in (
        "stale or unpushed weights",
        "wrong checkpoint or weight-name mapping",
        "M-RoPE position ids or image tokens",
        "dtype mismatch",
        "temperature / top-p mismatch",
    ):
        assert cause in message


def test_a_non_finite_gap_warns_and_leaves_the_stop_to_the_nonfinite_guard(caplog):
    guard = LogprobGapGuard("float32")
    with caplog.at_level(logging.WARNING):
        guard.check(1, _row(float("nan")))
        guard.check(2, _row(float("inf")))
    [message] = _warnings(caplog)
    assert message.startswith("step 1: ") and "by nan a response token" in message


def test_the_settings_replace_the_bands_levels(caplog):
    band = band_of("float32")
    guard = LogprobGapGuard("float32", warn=band.stop * 2, stop=band.stop * 10)
    with caplog.at_level(logging.WARNING):
        guard.check(1, _row(band.stop * 1.5))  # past the band's stop, inside the settings
    assert not _warnings(caplog)
    with pytest.raises(LogprobMismatch, match="stop above"):
        guard.check(2, _row(band.stop * 11))
    # a stop below the band's warning level: it stops there
    with pytest.raises(LogprobMismatch):
        LogprobGapGuard("bfloat16", stop=1e-3).check(1, _row(2e-3))


def test_stop_zero_never_stops_but_still_warns_once(caplog):
    guard = LogprobGapGuard("float32", stop=0)
    with caplog.at_level(logging.WARNING):
        for step, gap in enumerate((10.0, float("inf"), float("nan"), 1e6), start=1):
            guard.check(step, _row(gap))
    [message] = _warnings(caplog)
    assert message.startswith("step 1: ") and "the run never stops" in message


def test_linear_attention_models_are_judged_in_their_familys_band():
    """Qwen3.5's healthy bf16 gap (0.0165 on the H200 with routing replay) warns no more; a
    gap a fault makes still stops; other models keep the dtype's band."""
    from rl_runtime.logprob_guard import LINEAR_ATTENTION

    band = band_of("bfloat16", LINEAR_ATTENTION)
    assert band.family == LINEAR_ATTENTION and band.warn > 0.0165 * 2
    assert band_of("bfloat16", "no-such-family") is band_of("bfloat16")
    assert band_of("float32", LINEAR_ATTENTION) is band_of("float32")  # no family band there
    guard = LogprobGapGuard("bfloat16", family=LINEAR_ATTENTION)
    guard.check(1, {"rollout_logprob_abs_diff": 0.0165})
    assert not guard.warned
    dense = LogprobGapGuard("bfloat16")
    dense.check(1, {"rollout_logprob_abs_diff": 0.0165})
    assert dense.warned
    with pytest.raises(LogprobMismatch, match="bfloat16 band of linear-attention models"):
        guard.check(2, {"rollout_logprob_abs_diff": 0.5})
