"""One line for each compile a step pays for: what compiled and how long it took.

The first step of a run compiles: ``torch.compile``'s regions (the trainers' ``--compile``, the
engine's decode blocks, the log-prob kernels), forward when first called and backward at the
first backward; Triton's autotuner times its configs for each new key (fla's kernels). On an
H200 that took minutes with nothing in the log to say so (issue 49). :func:`log_compiles` logs
each ``torch.compile`` compilation as it ends (dynamo's compile callbacks), naming the region
(its module or function, file and line) and its seconds, and one line for each Triton autotune
(Triton's autotune listener, ``triton.knobs.autotuning.listener``: kernel, key, configs timed,
seconds, the config chosen). Triton's own print (``TRITON_PRINT_AUTOTUNING=1``) writes a line
for every config it times and four for the result: 175 lines in one GPU run of fla's kernels,
stays off unless asked for. Lines go to the ``glimpse.progress`` logger, which rl-runtime's
workers show at INFO.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

logger = logging.getLogger("glimpse.progress")

_lock = threading.Lock()
_started: dict[tuple[str, str], float] = {}  # (trigger, compile id) -> start
_names: dict[str, str] = {}  # compile id -> the region it compiled


def log_compiles(*, triton_autotune: bool = False) -> None:
    """Log every ``torch.compile`` compilation of this process from now on (installed once:
    a later call adds nothing, unless ``torch._dynamo.reset()`` dropped dynamo's callbacks in
    between, which it does: then it installs them again). ``triton_autotune``: also one line
    for each Triton autotune (where Triton is installed, has the listener, and
    ``TRITON_PRINT_AUTOTUNING`` does not ask for Triton's own lines instead)."""
    from torch._dynamo.callback import callback_handler

    with _lock:
        if _on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_start)
        if _on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(_on_end)
    if triton_autotune and "TRITON_PRINT_AUTOTUNING" not in os.environ:
        try:
            import triton
        except ImportError:
            return
        autotuning = getattr(getattr(triton, "knobs", None), "autotuning", None)
        if autotuning is not None and hasattr(autotuning, "listener") and not autotuning.listener:
            autotuning.listener = log_autotune


def log_autotune(
    *,
    fn: Any,
    key: Any,
    best_config: Any,
    configs_timings: dict[Any, Any] | None,
    duration: float | None,
    cache_hit: bool,
    **_: Any,
) -> None:
    """Triton's autotune listener: one line for an autotune that timed its configs (a result
    read from a cache costs nothing and says nothing)."""
    if cache_hit or duration is None:
        return
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", str(fn))
    timed = len(configs_timings or {})
    logger.info(
        "Triton autotune: %s (key %s) timed %d config(s) in %.2f s, chose %s",
        name,
        key,
        timed,
        duration,
        best_config,
    )


def _on_start(args: Any) -> None:
    trigger, compile_id = args.callback_trigger.name, str(args.compile_id)
    if trigger == "DYNAMO":
        _names[compile_id] = _region_being_compiled()
    _started[(trigger, compile_id)] = time.perf_counter()


def _on_end(args: Any) -> None:
    trigger, compile_id = args.callback_trigger.name, str(args.compile_id)
    start = _started.pop((trigger, compile_id), None)
    if start is None:
        return
    seconds = time.perf_counter() - start
    # the forward's compile (with its backward where the backend compiles both at once), or
    # the backward's, compiled at the first backward
    what = {"DYNAMO": "", "LAZY_BACKWARD": "backward "}.get(trigger, f"{trigger.lower()} ")
    name = _names.get(compile_id, "a compiled region")
    again = "" if compile_id.endswith("/0") else f" (recompile {compile_id})"
    logger.info("torch.compile: %s %scompiled in %.2f s%s", name, what, seconds, again)


def _region_being_compiled() -> str:
    """The code dynamo is compiling, from its ``_compile`` frame on the stack: the module's class
    and method where the code is a method (``Qwen3VLTextDecoderLayer.forward``; a module
    compiled whole compiles ``Module._call_impl``, named by its class), else the function's
    qualified name; with its file and line."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        # only the matching frame's locals are read (reading one materialises its dict)
        local = frame.f_locals if frame.f_code.co_name == "_compile" else {}
        if isinstance(local.get("code"), CodeType):
            code: CodeType = local["code"]
            owner = (local.get("locals") or {}).get("self")
            if owner is not None and code.co_name == "_call_impl":
                name = type(owner).__name__
            elif owner is not None:
                name = f"{type(owner).__name__}.{code.co_name}"
            else:
                name = getattr(code, "co_qualname", code.co_name)
            return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
        frame = frame.f_back
    return "a compiled region"
