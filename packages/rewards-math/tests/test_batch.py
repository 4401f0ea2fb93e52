"""score_batch / BatchScorer: in-process for small batches, worker processes for large ones, and
the scorer is usable from threads (where math-verify's signal-based timeouts would raise)."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rewards_math import BatchScorer, compute_score, score_batch
from rewards_math.batch import _score_pairs

# (response, answer, expected math score); the sympy path is exercised, not just fast paths
CASES = [
    ("so \\boxed{4\\sqrt{2}}", "\\sqrt { 32 }", 1.0),
    ("so \\boxed{5.66}", "\\sqrt { 32 }", 0.0),
    ("so \\boxed{\\frac{40}{3}}", "\\frac { 40 } { 3 }", 1.0),
    ("so \\boxed{13}", "\\frac { 40 } { 3 }", 0.0),
    ("so \\boxed{10\\pi}", "10 \\pi", 1.0),
    ("no final answer", "3", 0.0),
    ("\\boxed{10^{10^{10}}}", "1", 0.0),
    ("\\boxed{x = 60}", "60", 1.0),
]


def _expected(n_repeat: int = 1):
    responses = [r for r, _, _ in CASES] * n_repeat
    answers = [a for _, a, _ in CASES] * n_repeat
    return responses, answers, [s for _, _, s in CASES] * n_repeat


def test_small_batch_in_process():
    responses, answers, expected = _expected()
    assert score_batch(responses, answers) == expected


def test_large_batch_in_worker_processes(capfd):
    """One pool start only (spawned workers import sympy: seconds on a small machine). Ctrl-C
    is the parent's to handle: a terminal sends SIGINT to the whole foreground group, workers
    included, which died each with a KeyboardInterrupt traceback."""
    responses, answers, expected = _expected(4)
    with BatchScorer("math", num_workers=2, min_pool_batch=8) as scorer:
        assert scorer(responses, answers) == expected
        assert scorer._pool is not None  # it really went through worker processes
        workers = [w.pid for w in scorer._pool._pool]
        for pid in workers:
            os.kill(pid, signal.SIGINT)
        assert scorer(responses[:8], answers[:8]) == expected[:8]  # the pool is reused
        assert [w.pid for w in scorer._pool._pool] == workers  # the same workers
    assert scorer._pool is None
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score_batch(["a", "b"], ["1"])


def test_scoring_inside_threads():
    """math-verify's default timeouts use signal.alarm, which raises outside the main thread."""
    responses, answers, expected = _expected()
    results: list[float] = []

    def work():
        results.extend(compute_score(r, a) for r, a in zip(responses, answers, strict=True))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == expected
    with ThreadPoolExecutor(max_workers=3) as pool:
        assert list(pool.map(compute_score, responses, answers)) == expected
        assert pool.submit(score_batch, responses, answers).result() == expected


def _slow_reward(response: str, answer: str) -> float:
    if response == "slow":
        time.sleep(30)
    return 1.0


def test_per_item_timeout_scores_zero_and_continues():
    """The worker-side alarm (main thread of a worker) cuts one slow item, not the batch."""
    start = time.monotonic()
    scores = _score_pairs(_slow_reward, [("a", "1"), ("slow", "1"), ("b", "1")], 0.2)
    assert scores == [1.0, 0.0, 1.0]
    assert time.monotonic() - start < 25  # the 30 s sleep was interrupted
