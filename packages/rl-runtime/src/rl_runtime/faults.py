"""Faults a long run meets: dead actors, non-finite steps, failed saves.

Every fault that ends a run raises :class:`RunStopped` (or a subclass) with a one-line message
that names what failed and says which checkpoint is kept; the launchers print that line, not a
traceback. Calls to a group of Ray actors go through :func:`gather`, which notices a dead actor
as soon as Ray does, instead of waiting forever on its peers (a trainer rank blocked in a
collective whose partner died never returns on its own). An actor Ray's memory monitor killed
(``ray.exceptions.OutOfMemoryError``, with Ray's multi-line report of the node's memory) is
:class:`OutOfHostMemory`: one line with the node's figures and the settings that size what the
plan puts on the host.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: After the first failure, how long to wait for the other actors of the group to settle, so
#: that the message names the actor that died rather than its peers that lost their partner.
SETTLE_S = 10.0


class RunStopped(RuntimeError):
    """A fault the run cannot continue past; the message is the one line to show."""


class WorkerDied(RunStopped):
    """One or more actors of a group died (their process exited) during a call."""

    def __init__(self, message: str, indices: Sequence[int]) -> None:
        super().__init__(message)
        self.indices = list(indices)


class OutOfHostMemory(WorkerDied):
    """One or more actors of a group were killed because the node ran out of host memory."""


#: What to change when a node's host memory ran out: the settings that size the plan's share.
HOST_MEMORY_SETTINGS = (
    "put less of the optimizer on the host (a lower --optimizer-offload-fraction), give the "
    "node's real memory (--host-memory-gib), or use more GPUs"
)


def killed_for_memory(err: BaseException) -> bool:
    """Whether ``err`` says an actor was killed for host memory: Ray's ``OutOfMemoryError`` (its
    memory monitor's kill, also inside a task that called that actor), or an actor's death
    whose cause says the node ran low on memory."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    if isinstance(err, OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RayActorError) and any(
        mark in text for mark in ("running low on memory", "NODE_OUT_OF_MEMORY")
    )


def memory_note(err: BaseException) -> str:
    """The node's figures from Ray's report, in a few words (Ray's "GB" are GiB), or ""."""
    found = re.search(r"was ([\d.]+)GB(?: used)? / ([\d.]+)GB", str(err))
    if found is None:
        return ""
    return f"Ray's memory monitor: the node had {found[1]} of {found[2]} GiB in use"


class NonFiniteStop(RunStopped):
    """Too many steps in a row had a non-finite loss or gradient."""


class CheckpointFailed(RunStopped):
    """A save did not complete; its unfinished folder was removed."""


class LogprobMismatch(RunStopped):
    """The trainer's log-probs are far from the engine's: the two evaluate different models
    (rl_runtime.logprob_guard)."""


class RolloutFailed(RunStopped):
    """A rollout that cannot run: the engine's KV cache cannot hold requests that fit the
    model, or no request returned a token (rl_runtime.rollout_guard)."""


class Interrupted(RunStopped):
    """Ctrl-C (SIGINT): the step under way was abandoned; the launchers exit with status 130."""


def short_error(err: BaseException) -> str:
    """`Type: message` of the error, or of the exception a Ray task raised; for an actor
    whose constructor raised, that exception (the last line of the traceback Ray folds into
    ``ActorDiedError``'s message: it keeps no other reference to it)."""
    if getattr(err, "actor_init_failed", False):
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return f"its constructor raised {lines[-1]}"
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def gather(
    futures: Sequence[Any],
    names: Sequence[str],
    what: str,
    while_waiting: Callable[[int, Any], None] | None = None,
    *,
    still_waiting: Callable[[float, list[str]], None] | None = None,
    every_s: float = 60.0,
) -> list[Any]:
    """`ray.get` over one call per actor, in order, that fails as soon as an actor dies.

    ``while_waiting(i, result)`` is called for each result that arrives while other calls are
    still running (work that can overlap them); the last one is left to the caller.

    On the first failure, waits up to :data:`SETTLE_S` for the other calls; if any actor died,
    raises :class:`WorkerDied` naming it (peers that failed because of it are left out of the
    blame); if the call failed because an actor *it* called died (a trainer pushing weights to
    a dead engine), raises :class:`RunStopped`; otherwise re-raises the first error as it came.

    ``still_waiting(seconds, names)`` is called every ``every_s`` seconds without a result, with
    the names of the calls still running (a start-up that hangs says so, and who).
    """
    import ray  # here, not at the top: a launcher imports the faults' types before Ray
    from ray.exceptions import RayActorError

    index = {ref: i for i, ref in enumerate(futures)}
    results: list[Any] = [None] * len(futures)
    pending = list(futures)
    start = time.monotonic()
    while pending:
        timeout = every_s if still_waiting is not None else None
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            assert still_waiting is not None
            still_waiting(time.monotonic() - start, [names[index[r]] for r in pending])
            continue
        try:
            results[index[ready[0]]] = ray.get(ready[0])
        except Exception as first:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=SETTLE_S)
            ends = {index[r]: _ending(r) for r in [ready[0], *done]}
            dead = sorted(i for i, end in ends.items() if end is not None)
            if not dead and killed_for_memory(first):  # an actor it called was killed
                note = memory_note(first)
                raise RunStopped(
                    f"{names[index[ready[0]]]} failed during {what}: an actor it called was "
                    f"killed for host memory{f' ({note})' if note else ''}: "
                    f"{HOST_MEMORY_SETTINGS}"
                ) from first
            if not dead and isinstance(first, RayActorError):  # an actor it called died
                raise RunStopped(
                    f"{names[index[ready[0]]]} failed during {what}: an actor it called died "
                    f"({short_error(first)})"
                ) from first
            if not dead:
                raise
            who = ", ".join(names[i] for i in dead)
            killed = [ends[i] for i in dead if killed_for_memory(ends[i])]
            if killed:
                note = memory_note(killed[0])
                raise OutOfHostMemory(
                    f"{who} {'was' if len(dead) == 1 else 'were'} killed for host memory during "
                    f"{what}{f' ({note})' if note else ''}: {HOST_MEMORY_SETTINGS}",
                    dead,
                ) from first
            raise WorkerDied(f"{who} died during {what} ({short_error(first)})", dead) from first
        if pending and while_waiting is not None:
            while_waiting(index[ready[0]], results[index[ready[0]]])
    return results


def _ending(ref: Any) -> BaseException | None:
    """How the actor behind this finished call ended, if it died: Ray's error (a dead actor's,
    or the memory monitor's ``OutOfMemoryError``), else None. A task that failed because an
    actor it called died (a trainer pushing to a dead engine) raises a `RayTaskError` that is
    also that actor's error; that actor is alive."""
    import ray  # here, not at the top: a launcher imports the faults' types before Ray
    from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

    try:
        ray.get(ref, timeout=0)
    except RayTaskError:
        return None
    except (RayActorError, OutOfMemoryError) as err:
        return err
    except Exception:
        return None
    return None


def last_checkpoint_note(checkpoints: Any) -> str:
    """Which checkpoint a stopped run leaves behind, for the stop message."""
    latest = checkpoints.latest()
    if latest is None:
        root = getattr(checkpoints, "root", None)
        warmup = None if root is None else Path(root).parent / "sft_warmup" / "hf"
        if warmup is not None and (warmup / "config.json").is_file():
            # sft_warmup reuses a finished warm-up: the same command starts from it
            return (
                f"no checkpoint was saved yet (the SFT warm-up {warmup.parent} is kept and reused)"
            )
        return "no checkpoint was saved yet"
    return f"the last checkpoint {latest[1]} is intact (--resume continues from it)"


@contextmanager
def stop_with_checkpoint_note(checkpoints: Any) -> Iterator[None]:
    """Add the kept checkpoint to the message of a :class:`RunStopped` raised inside, and turn
    Ctrl-C into an :class:`Interrupted` whose one line says what ``--resume`` continues from;
    also a failure that follows Ctrl-C (an actor that died of the same signal: the stop is the
    user's, not a fault)."""
    from rl_runtime.interrupts import interrupted

    try:
        yield
    except KeyboardInterrupt:
        raise _interrupted_note(checkpoints) from None
    except Exception as err:
        if interrupted() and not isinstance(err, Interrupted):
            log.debug("failed after Ctrl-C", exc_info=True)
            raise _interrupted_note(checkpoints) from None
        if isinstance(err, RunStopped):
            note = last_checkpoint_note(checkpoints)
            if note not in str(err):
                err.args = (f"{err}; {note}",)
        raise


def _interrupted_note(checkpoints: Any) -> Interrupted:
    note = last_checkpoint_note(checkpoints)
    if checkpoints.latest() is None:
        note += "; the same command without --resume starts over"
    return Interrupted(f"interrupted: the step under way was abandoned; {note}")


class RestartingRollout:
    """The rollout group as the loop sees it: when an engine dies during `generate`, it is
    restarted, `resync()` gives it the current weights, and the same call (same prompts, same
    seed) is repeated, at most `retries` times per call; then the run stops. An engine that
    dies while the trainer pushes weights (:meth:`sync`) is restarted and pushed to again,
    within the same bound."""

    def __init__(self, rollout: Any, resync: Callable[[], None], retries: int) -> None:
        self.rollout = rollout
        self.resync = resync
        self.retries = retries
        self.restarts = 0  # over the run, for the metrics

    def generate(self, prompts: Sequence[Any], **kwargs: Any) -> list[list[Any]]:
        attempt = 0
        while True:
            try:
                return self.rollout.generate(prompts, **kwargs)
            except WorkerDied as err:
                if not getattr(self.rollout, "engines_restartable", True):
                    # An NCCL weight group is set up once; a new engine could not join it.
                    raise RunStopped(
                        f"{err}; engines on GPUs of their own are not restarted"
                    ) from err
                if attempt >= self.retries:
                    raise RunStopped(
                        f"{err}; gave up after {attempt} restart(s) (--max-rollout-retries)"
                    ) from err
                attempt += 1
                self.restarts += 1
                log.warning(
                    "%s; restarting it and repeating the rollout (%d of %d)",
                    err,
                    attempt,
                    self.retries,
                )
                self.rollout.restart(err.indices)
                self.resync()

    def sync(self, push: Callable[[], Any]) -> Any:
        """``push()`` (the trainer's weight push to every engine); when it fails because an
        engine died, the dead engines are restarted and the whole push repeated (a restarted
        engine starts from the factory's weights), at most `retries` times."""
        attempt = 0
        while True:
            try:
                return push()
            except RunStopped as err:
                if isinstance(err, WorkerDied):  # a trainer rank died: nothing to restart
                    raise
                dead = getattr(self.rollout, "dead_engines", list)()
                if not dead or not getattr(self.rollout, "engines_restartable", True):
                    raise
                if attempt >= self.retries:
                    raise RunStopped(
                        f"{err}; gave up after {attempt} restart(s) (--max-rollout-retries)"
                    ) from err
                attempt += 1
                self.restarts += 1
                log.warning(
                    "rollout engine(s) %s died during the weight sync; restarting and pushing "
                    "again (%d of %d)",
                    dead,
                    attempt,
                    self.retries,
                )
                self.rollout.restart(dead)
