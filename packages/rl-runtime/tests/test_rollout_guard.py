"""The rule that stops a run whose rollout cannot run: a KV cache too small for requests that fit
the model stops it, and so does a rollout of no tokens; a few requests failing for bad input
(a prompt over the limit) beside good ones do not."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rl_runtime import RunStopped
from rl_runtime.faults import RolloutFailed
from rl_runtime.rollout_guard import capacity_figures, check_rollout, rollout_problem


@dataclass
class Done:
    """A completion as the engines return one (`rollout_sglang.types.Completion`'s fields)."""

    token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    finish_reason: str = "stop"
    error: str | None = None


def failed(error: str) -> Done:
    return Done([], "error", error)


# the transformers engine's words (rollout_sglang.hf.engine.HFEngine.generate)
TOO_BIG = "request {i} (7): needs {need} KV-cache tokens, the cache holds 1 (kv_cache_fraction 0.5)"
TOO_LONG = "request 3: prompt has 900 tokens, more than the limit 511"


def test_capacity_errors_are_read_from_the_engines_words():
    assert capacity_figures(failed(TOO_BIG.format(i=0, need=487))) == (487, 1)
    assert capacity_figures(failed(TOO_LONG)) is None
    assert capacity_figures(Done()) is None


def test_bad_input_beside_good_completions_goes_on():
    assert rollout_problem([Done(), failed(TOO_LONG), Done()], 4096) is None
    assert rollout_problem([], 4096) is None  # nothing asked, nothing to judge


def test_one_request_the_cache_cannot_hold_stops_naming_the_largest_and_the_settings():
    groups = [
        [Done(), failed(TOO_BIG.format(i=1, need=300))],
        [failed(TOO_BIG.format(i=2, need=487)), failed(TOO_LONG)],
    ]
    with pytest.raises(RolloutFailed) as err:
        check_rollout(
            groups, where="step 4: rollout", ending="stopping before its update", max_response_len=8
        )
    message = str(err.value)
    assert isinstance(err.value, RunStopped) and "\n" not in message
    assert message.startswith(
        "step 4: rollout: the rollout engine's KV cache cannot hold 2 of 4 requests that fit "
        "the model; the largest: request 2 (7): needs 487 KV-cache tokens, the cache holds 1 "
        "(kv_cache_fraction 0.5): give the KV cache more memory (--kv-cache-fraction"
    )
    for setting in (
        "--rollout-cache-tokens",
        "--sglang-mem-fraction-static",
        "--rollout-max-response-len 8",
        "--offload-train",
        "--optimizer-offload-fraction",
    ):
        assert setting in message
    assert message.endswith("; stopping before its update")


def test_a_rollout_of_no_tokens_stops_whatever_the_reason():
    problem = rollout_problem([failed(TOO_LONG), failed("request 4: empty prompt")], 16)
    assert problem is not None
    assert problem.startswith(
        f"the rollout returned no tokens: 2 of 2 requests failed (the first: {TOO_LONG}); "
        "if the engine ran short of memory: give the KV cache more memory"
    )
    empty = rollout_problem([Done([], "stop"), Done([], "length")], 16)
    assert empty == "the rollout returned no tokens: all 2 responses are empty"
