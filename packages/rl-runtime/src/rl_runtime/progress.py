"""What a run shows while it goes: a progress bar over the steps (rich, sharing the console with
`logging`), and each phase's start, end and figures, with a line every few seconds while one
runs (`phase`), so that a long rollout, compile or weight push is never a silent console.

A log that is not a terminal (a file, a pipe, a CI job) gets one plain line per record
instead: ``2026-12-05 14:06:40 INFO step 1: rollout done in 8.92 s: ...``, no wrapping or
padding to a width, no colour codes, no progress bars (ours, transformers' and the hub's,
in the workers too), and Ray's own lines and its workers' in the same layout
(`rl_runtime.ray_logs`)."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rl_runtime.faults import Interrupted
from rl_runtime.interrupts import interrupted

_console = Console(stderr=True)
log = logging.getLogger(__name__)

#: seconds between the lines that say a phase is still running (`phase`)
HEARTBEAT_S = 10.0


def console() -> Console:
    return _console


_plain = False  # setup_logging chose plain lines (read by rl_runtime.placement.init_ray)


def setup_logging(level: int | str = logging.INFO, *, plain: bool | None = None) -> None:
    """Log through rich on the same console as the progress bar (for the apps), or, where
    stderr is not a terminal (``plain`` unset) or ``plain``, one plain line per record
    (`PlainFormatter`), with the progress bars of the libraries turned off."""
    global _plain
    _plain = not _console.is_terminal if plain is None else plain
    handler: logging.Handler
    if _plain:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PlainFormatter())
        no_progress_bars()
    else:
        handler = RichHandler(console=_console, show_path=False, rich_tracebacks=True)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def plain_logs() -> bool:
    """Whether `setup_logging` chose plain lines."""
    return _plain


class PlainFormatter(logging.Formatter):
    """``2026-12-05 14:06:40 INFO <message>``: the message on one line (each line break, with
    the indentation after it, becomes one space: a configuration dump is one line of JSON);
    a traceback, where a record has one, follows on lines of its own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = re.sub(r"\s*\n\s*", " ", record.message.strip())
        return super().formatMessage(record)


def no_progress_bars() -> None:
    """Turn off tqdm's bars (transformers' "Loading weights", the hub's downloads): for this
    process and, through the environment, the Ray workers it starts (the libraries' own
    switches, read as they are imported); the hub's and transformers' own switches where they
    are imported already."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


@contextmanager
def step_progress(total: int, start: int, description: str) -> Iterator[Callable[[Any], None]]:
    """A progress bar from `start` to `total`; the yielded callable advances it by one step and
    shows the step's reward when the row has one."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console,
        transient=False,
        disable=not _console.is_terminal,
    )
    task = progress.add_task(description, total=total, completed=start, info="")

    def advance(row: Any) -> None:
        info = ""
        if isinstance(row, dict) and row.get("reward_mean") is not None:
            info = f"reward {row['reward_mean']:.3f}"
        elif isinstance(row, dict) and row.get("loss") is not None:
            info = f"loss {row['loss']:.4f}"
        progress.update(task, advance=1, info=info)

    with progress:
        yield advance


class Phase:
    """A phase while it runs: the figures its end line gives, set by the code it times
    (``tokens``: a rate is given beside them; ``notes``: anything else, as text)."""

    def __init__(self, name: str, tokens: int | None = None, samples: int | None = None) -> None:
        self.name = name
        self.tokens = tokens
        self.samples = samples
        self.notes: list[str] = []
        self.seconds = 0.0

    def figures(self) -> str:
        parts = []
        if self.tokens is not None:
            rate = self.tokens / max(self.seconds, 1e-9)
            parts.append(f"{self.tokens:,} tokens, {rate:,.0f} tokens/s")
        if self.samples is not None:
            parts.append(f"{self.samples:,} samples")
        return ", ".join(parts + self.notes)


@contextmanager
def heartbeat(
    name: str, every_s: float = HEARTBEAT_S, logger: logging.Logger = log
) -> Iterator[None]:
    """Log ``<name> still running after N s`` every ``every_s`` seconds (0: never) from a daemon
    thread until the block ends."""
    if every_s <= 0:
        yield
        return
    start, done = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            logger.info("%s still running after %s", name, seconds(time.perf_counter() - start))

    threading.Thread(target=beat, name=f"heartbeat {name}", daemon=True).start()
    try:
        yield
    finally:
        done.set()


@contextmanager
def phase(
    name: str,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    level: int = logging.INFO,
    logger: logging.Logger = log,
    tokens: int | None = None,
    samples: int | None = None,
) -> Iterator[Phase]:
    """``<name> ...`` when the block starts, ``<name> done in S s: <figures>`` when it ends (or
    ``failed after S s``, or ``interrupted after S s`` for Ctrl-C and for what fails after it),
    and a heartbeat while it runs (at INFO; none below it)."""
    current = Phase(name, tokens, samples)
    logger.log(level, "%s ...", name)
    start = time.perf_counter()
    try:
        with heartbeat(name, heartbeat_s if level >= logging.INFO else 0.0, logger):
            yield current
    except BaseException as err:
        stopped = isinstance(err, KeyboardInterrupt | Interrupted) or interrupted()
        how = "interrupted" if stopped else "failed"
        logger.log(level, "%s %s after %s", name, how, seconds(time.perf_counter() - start))
        raise
    current.seconds = time.perf_counter() - start
    figures = current.figures()
    logger.log(level, "%s done in %s%s", name, seconds(current.seconds), figures and f": {figures}")


def seconds(s: float) -> str:
    """``0.042 s``, ``3.14 s``, ``312.4 s``: three figures where a phase is short."""
    return f"{s:.3f} s" if s < 1 else f"{s:.2f} s" if s < 10 else f"{s:.1f} s"


def rollout_figures(current: Phase, groups: Sequence[Sequence[Any]], row: dict) -> None:
    """The rollout line's figures: the tokens generated, the samples, and the CUDA graphs the
    engines captured meanwhile (a first step's cost: it names itself)."""
    current.tokens = sum(len(c.token_ids or ()) for group in groups for c in group)
    current.samples = sum(len(group) for group in groups)
    if row.get("rollout_graph_captures"):
        captured = row["rollout_graph_captures"]
        spent = row.get("time_rollout_engine_capture_s", 0.0)
        current.notes.append(f"{captured:.0f} CUDA graph(s) captured in {spent:.1f} s")


def transfer_notes(metrics: dict[str, float]) -> list[str]:
    """``pushed 1.23 GB at 4.5 GB/s``... for each copy ``metrics`` holds (``perf/<what>_gb``
    and ``_gbps``: the weight push, the trainer state's onload and offload)."""
    words = {"sync": "pushed", "onload": "onloaded", "offload": "offloaded"}
    return [
        f"{word} {metrics[f'perf/{what}_gb']:.2f} GB at {metrics[f'perf/{what}_gbps']:.2f} GB/s"
        for what, word in words.items()
        if f"perf/{what}_gb" in metrics and f"perf/{what}_gbps" in metrics
    ]


def eval_notes(row: dict[str, Any]) -> list[str]:
    """The eval line's figures: how many prompts, the accuracy."""
    if "eval_accuracy" not in row:
        return []
    return [f"{row['eval_num_prompts']} prompts, accuracy {row['eval_accuracy']:.3f}"]
