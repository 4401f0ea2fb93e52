"""What both SGLang engines share: the install check, the start settings, request checking
and SGLang's answers to control calls.

sglang is an optional extra (``uv sync --extra gpu``). This package imports without it: the
import happens when an engine is built, and its absence says how to install it. Requests are
checked here first (empty, too long, images that do not match their placeholders) so a bad one
fails alone instead of failing SGLang's whole batch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rollout_sglang.sglang_client.protocol import generate_payload, parse_output, with_sample_seeds
from rollout_sglang.types import Completion, GenerateRequest, SamplingParams
from rollout_sglang.validation import RequestLimits, request_error

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "sglang is not installed. It is the optional GPU extra of this workspace: run "
    "`uv sync --extra gpu` on a Linux machine with CUDA (or `pip install 'rollout-sglang[sglang]'`)"
)


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def require_sglang() -> Any:
    """Import and return ``sglang``, or raise ImportError saying how to install it."""
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return sglang


@dataclass
class SGLangConfig:
    """How to start SGLang. Field names follow SGLang's server arguments.

    ``mm_attention_backend`` picks the vision tower's attention kernel ("sdpa" on B200, where
    fa3 is missing; "fa3" on H100/H200). ``enable_memory_saver`` is needed for
    :meth:`release_memory` to free weights and KV cache while colocated training runs.
    ``min_pixels`` / ``max_pixels`` must be those of the processor that built the prompts:
    they reach SGLang's image processor as ``mm_process_config={"image": {...}}`` (sglang
    0.5.23 ``arg_groups/fields/mm.py``; ``multimodal/processors/base_processor.py`` passes
    ``image_config`` as the HF processor's ``images_kwargs``), so both see the same grids.
    ``enable_deterministic_inference`` is what makes SGLang honour ``sampling_seed``
    (``sampling/sampling_batch_info.py`` builds seeds only then); without it seeds are ignored.
    ``extra_args`` passes any other SGLang server argument through unchanged (dicts and
    lists become JSON on a command line).
    """

    model_path: str
    tp_size: int = 1
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.7
    mm_attention_backend: str | None = None
    attention_backend: str | None = None
    context_length: int | None = None
    base_gpu_id: int = 0
    enable_memory_saver: bool = True
    random_seed: int | None = None
    host: str = "127.0.0.1"  # servers bind to localhost unless asked otherwise
    port: int = 30000
    log_level: str = "warning"
    min_pixels: int | None = None
    max_pixels: int | None = None
    enable_deterministic_inference: bool = False
    extra_args: dict[str, Any] = field(default_factory=dict)

    def mm_process_config(self) -> dict[str, Any] | None:
        """SGLang's ``mm_process_config`` with our pixel bounds merged into its ``image``."""
        config = dict(self.extra_args.get("mm_process_config") or {})
        bounds = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        image = {**config.get("image", {}), **{k: v for k, v in bounds.items() if v}}
        if image:
            config["image"] = image
        return config or None

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine`` (= ``ServerArgs`` fields)."""
        kwargs: dict[str, Any] = {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "dtype": self.dtype,
            "mem_fraction_static": self.mem_fraction_static,
            "base_gpu_id": self.base_gpu_id,
            "enable_memory_saver": self.enable_memory_saver,
            "log_level": self.log_level,
            "enable_deterministic_inference": self.enable_deterministic_inference,
        }
        optional = {
            "mm_attention_backend": self.mm_attention_backend,
            "attention_backend": self.attention_backend,
            "context_length": self.context_length,
            "random_seed": self.random_seed,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        kwargs.update(self.extra_args)
        mm_config = self.mm_process_config()
        if mm_config is not None:
            kwargs["mm_process_config"] = mm_config
        return kwargs

    def server_command(self, python: str = sys.executable) -> list[str]:
        """``python -m sglang.launch_server ...`` with the same arguments, plus host and port."""
        command = [python, "-m", "sglang.launch_server"]
        for key, value in {**self.engine_kwargs(), "host": self.host, "port": self.port}.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                command.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, dict):  # parsed with json.loads by SGLang
                command += [flag, json.dumps(value)]
            elif isinstance(value, list | tuple):  # nargs="+" (e.g. --cuda-graph-bs-decode)
                command += [flag, *map(str, value)]
            else:
                command += [flag, str(value)]
        return command

    def limits(self, image_token_id: int, merge_size: int = 2) -> RequestLimits:
        return RequestLimits(
            image_token_id=image_token_id,
            merge_size=merge_size,
            max_prompt_length=self.context_length - 1 if self.context_length else None,
            needs_pixels=False,
        )


#: sglang 0.5.23's GPU memory types (``constants.GPU_MEMORY_ALL_TYPES``), released and resumed
#: by tag
MEMORY_TYPES = ("kv_cache", "weights", "cuda_graph")


class _CheckedGenerate:
    """Shared by the SGLang engines: reject bad requests locally, send the rest as one batch,
    and if SGLang refuses the batch, retry one by one so the culprit fails alone; and keep
    which memory types are released."""

    limits: RequestLimits | None
    # (layers, k): ask SGLang for each token's routed experts and shape them (routing replay)
    routing_shape: tuple[int, int] | None = None
    _in_flight: int = 0
    _in_flight_lock = threading.Lock()
    _released: frozenset[str] = frozenset()

    def _mark_released(self) -> None:
        self._released = frozenset(MEMORY_TYPES)

    def _to_resume(self, tags: Sequence[str] | None) -> list[str]:
        """The types of ``tags`` (None: all) that are released, marked as resumed. SGLang
        refuses to resume a type it did not release (``offload_tags.remove`` in
        ``managers/scheduler_components/weight_updater.py``): an engine restarted mid-sync,
        never released, must not be asked to."""
        wanted = [t for t in (tags or MEMORY_TYPES) if t in self._released]
        self._released = self._released - set(wanted)
        return wanted

    @property
    def image_token_id(self) -> int | None:
        return self.limits.image_token_id if self.limits else None

    def _payload(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> dict[str, Any]:
        return generate_payload(
            requests,
            params,
            self.image_token_id,
            return_routed_experts=self.routing_shape is not None,
        )

    def _parse(self, outputs: list[Any], requests: Sequence[GenerateRequest]) -> list[Completion]:
        return [
            parse_output(o, r, routing_shape=self.routing_shape)
            for o, r in zip(outputs, requests, strict=True)
        ]

    @contextmanager
    def _busy(self) -> Iterator[None]:
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def _require_idle(self, what: str) -> None:
        """SGLang releases memory only when idle (sglang 0.5.23
        ``managers/scheduler_components/weight_updater.py`` asserts ``is_fully_idle``)."""
        if self._in_flight:
            raise RuntimeError(
                f"{what}: {self._in_flight} generate call(s) still running; SGLang needs an "
                "idle engine"
            )

    def _send(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        raise NotImplementedError

    def generate(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        valid: list[int] = []
        for i, request in enumerate(requests):
            error = request_error(request, self.limits, i) if self.limits else None
            if error is None and self.limits is None and request.prompt_length == 0:
                error = f"request {i}: empty prompt (no input_ids)"
            if error is None:
                valid.append(i)
            else:
                logger.warning("skipping %s", error)
                results[i] = Completion.failed(
                    error, prompt_length=request.prompt_length, request_id=request.request_id
                )
        if valid:
            requests = with_sample_seeds(requests, params)  # a retry keeps each seed
            batch = [requests[i] for i in valid]
            try:
                with self._busy():
                    outputs = self._send(batch, params)
            except Exception as exc:
                if len(batch) == 1:
                    outputs = [_failed(batch[0], valid[0], exc)]
                else:
                    logger.warning("SGLang refused a batch of %d (%s); one by one", len(batch), exc)
                    outputs = []
                    for i in valid:
                        try:
                            with self._busy():
                                outputs += self._send([requests[i]], params)
                        except Exception as single_exc:
                            outputs.append(_failed(requests[i], i, single_exc))
            for i, completion in zip(valid, outputs, strict=True):
                results[i] = completion
        return results  # type: ignore[return-value]


def _failed(request: GenerateRequest, index: int, exc: Exception) -> Completion:
    message = f"request {index}: SGLang failed: {type(exc).__name__}: {exc}"
    logger.warning(message)
    return Completion.failed(
        message, prompt_length=request.prompt_length, request_id=request.request_id
    )


def _check(result: Any, what: str) -> Any:
    """SGLang control calls answer ``(success, message)`` or ``{"success": ..., "message": ...}``."""
    success, message = None, None
    if isinstance(result, tuple | list) and result and isinstance(result[0], bool):
        success, message = result[0], result[1] if len(result) > 1 else None
    elif isinstance(result, dict) and "success" in result:
        success, message = result["success"], result.get("message")
    if success is False:
        raise RuntimeError(f"SGLang {what} failed: {message}")
    return result


_seed_warned = False


def _warn_ignored_seed(params: SamplingParams, config: SGLangConfig | None) -> None:
    """Say once that SGLang ignores ``sampling_seed`` without deterministic inference."""
    global _seed_warned
    if params.seed is None or _seed_warned:
        return
    if config is None or not config.enable_deterministic_inference:
        _seed_warned = True
        logger.warning(
            "SamplingParams.seed is ignored by SGLang unless it runs with "
            "--enable-deterministic-inference (SGLangConfig.enable_deterministic_inference)"
        )
