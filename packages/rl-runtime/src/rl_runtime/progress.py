"""Console progress bar over training steps (rich), sharing the console with `logging`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
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

_console = Console(stderr=True)


def console() -> Console:
    return _console


def setup_logging(level: int | str = logging.INFO) -> None:
    """Log through rich on the same console as the progress bar (for the apps)."""
    logging.basicConfig(
        level=level,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(console=_console, show_path=False, rich_tracebacks=True)],
        force=True,
    )


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
