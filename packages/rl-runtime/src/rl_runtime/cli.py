"""The launchers' error boundary: a mistake in the configuration or the environment is one line
on stderr naming what to change, and exit status 2; a fault that stops a run (`RunStopped`) is
its one logged line and exit status 1; `--log-level DEBUG` shows the traceback."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rl_runtime.config_fields import ConfigError
from rl_runtime.faults import Interrupted, RunStopped
from rl_runtime.interrupts import interrupted, watch_sigint
from rl_runtime.preflight import PreflightError

log = logging.getLogger(__name__)

#: Errors that mean "the user asked for something that cannot be", never a bug.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, PreflightError)


def wants_traceback(argv: Sequence[str]) -> bool:
    """`--log-level DEBUG` (or `--log-level=DEBUG`) among the arguments."""
    args = list(argv)
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--log-level=") else None
        if arg == "--log-level" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and value.upper() == "DEBUG":
            return True
    return False


@contextmanager
def as_config_error(
    errors: type[BaseException] | tuple[type[BaseException], ...], setting: str
) -> Iterator[None]:
    """A package's own error about a value the user gave (a dataset that is not there) as a
    one-line `ConfigError` naming the setting (`--dataset / GEO3K_DATASET_NAME`)."""
    try:
        yield
    except errors as err:
        raise ConfigError(f"{setting}: {err}") from err


@contextmanager
def user_errors(
    prog: str, argv: Sequence[str], extra: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Turn a `USER_ERRORS` (or `extra`) exception into `prog: error: <one line>`, exit 2, a
    `RunStopped` fault into its one line (logged; the checkpoint it names is kept), exit 1, and
    Ctrl-C into one line (what `--resume` continues from, where the loop knows it), exit 130.
    Ctrl-C is counted once (`rl_runtime.interrupts`); whatever fails after it (an actor that
    died of the same signal) ends as an interrupt too: exit 130, never a fault's 1."""
    try:
        with watch_sigint():
            try:
                yield
            except Exception as err:
                if not interrupted() or isinstance(err, Interrupted):
                    raise
                log.debug("failed after Ctrl-C", exc_info=True)
                raise KeyboardInterrupt from err
    except Interrupted as err:
        log.debug("interrupted", exc_info=True)
        log.warning("%s", err)
        raise SystemExit(130) from None
    except KeyboardInterrupt as err:
        # a second Ctrl-C that cut the shutdown after the first short, or a failure that
        # followed the first: the first one's line where the loop gave one
        first = _interrupted(err)
        if first is not None:
            log.warning("%s", first)
        else:  # outside the training loops: starting or finishing
            log.warning(
                "interrupted while starting or finishing (no step was under way); --resume "
                "continues from the run folder's last checkpoint, if it has one"
            )
        raise SystemExit(130) from None
    except RunStopped as err:
        log.debug("stopped", exc_info=True)
        log.error("%s", err)
        raise SystemExit(1) from None
    except (*USER_ERRORS, *extra) as err:
        if wants_traceback(argv):
            raise
        message = getattr(err, "message", None) or str(err) or type(err).__name__
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2) from None


def _interrupted(err: BaseException) -> Interrupted | None:
    """The `Interrupted` that `err` was raised while handling (or from), if any."""
    seen: BaseException | None = err.__context__ or err.__cause__
    while seen is not None and not isinstance(seen, Interrupted):
        seen = seen.__context__ or seen.__cause__
    return seen
