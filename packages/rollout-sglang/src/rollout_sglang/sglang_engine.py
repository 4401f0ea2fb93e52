"""SGLang engines: in-process (``sglang.Engine``) and a server (subprocess + HTTP client).

sglang is an optional extra (``uv sync --extra gpu``). This module imports without it: the
import happens when an engine is built, and its absence says how to install it. Requests are
checked here first (empty, too long, images that do not match their placeholders) so a bad one
fails alone instead of failing SGLang's whole batch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_sglang.sglang_protocol import generate_payload, parse_output, with_sample_seeds
from rollout_sglang.types import Completion, GenerateRequest, NamedTensors, SamplingParams
from rollout_sglang.validation import RequestLimits, request_error
from rollout_sglang.weight_names import WeightNameCheck, check_weight_names

if TYPE_CHECKING:
    import requests

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


class _CheckedGenerate:
    """Shared by the SGLang engines: reject bad requests locally, send the rest as one batch,
    and if SGLang refuses the batch, retry one by one so the culprit fails alone."""

    limits: RequestLimits | None
    _in_flight: int = 0
    _in_flight_lock = threading.Lock()

    @property
    def image_token_id(self) -> int | None:
        return self.limits.image_token_id if self.limits else None

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


class SGLangEngine(_CheckedGenerate):
    """:class:`~rollout_sglang.types.RolloutEngine` over an in-process ``sglang.Engine``.

    ``update_weights`` uses ``update_weights_from_tensor`` (colocated: trainer and engine on
    the same GPUs, tensors passed by CUDA IPC handle). ``flatten_buckets`` sends each bucket as
    one flattened tensor plus metadata (SGLang's ``FlattenedTensorBucket``), fewer IPC handles.
    For a separate placement, use :class:`~rollout_sglang.weight_sync.DistributedWeightSender`
    with this engine (it calls :meth:`init_weights_update_group` and
    :meth:`update_weights_from_distributed`).
    """

    name = "sglang"

    def __init__(
        self,
        config: SGLangConfig,
        *,
        limits: RequestLimits | None = None,
        flatten_buckets: bool = False,
        weight_names: WeightNameCheck | None = None,
        engine: Any | None = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.flatten_buckets = flatten_buckets
        self.weight_names = weight_names
        logger.info(
            "rollout engine: SGLang in-process (%s, tp %d)", config.model_path, config.tp_size
        )
        # ``engine``: an ``sglang.Engine`` built elsewhere (the smoke script, tests' stand-in)
        self.engine = (
            engine if engine is not None else require_sglang().Engine(**config.engine_kwargs())
        )

    def _send(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        _warn_ignored_seed(params, self.config)
        outputs = self.engine.generate(**generate_payload(requests, params, self.image_token_id))
        if isinstance(outputs, dict):
            outputs = [outputs]
        return [parse_output(o, r) for o, r in zip(outputs, requests, strict=True)]

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Every bucket inside one weight-update session, then one cache flush."""
        count = 0
        with weight_update_session(self):
            for bucket in buckets:
                check_weight_names([name for name, _ in bucket], self.weight_names)
                if self.flatten_buckets:
                    payloads, load_format = (
                        flattened_bucket_payloads(bucket, self.config.tp_size),
                        "flattened_bucket",
                    )
                else:
                    payloads, load_format = bucket, None
                _check(
                    self.engine.update_weights_from_tensor(
                        named_tensors=payloads, load_format=load_format, flush_cache=False
                    ),
                    "update_weights_from_tensor",
                )
                count += len(bucket)
        self.flush_cache()
        logger.info("SGLang: updated %d tensors", count)

    def update_weights_from_serialized(
        self, names: list[str], payloads: list[str], load_format: str = "flattened_bucket"
    ) -> None:
        """One bucket serialized by the sender (CUDA IPC handles, one payload per TP rank;
        ``rollout_sglang.cuda_ipc``), inside a session the caller opened. sglang 0.5.23's
        ``Engine.update_weights_from_tensor`` passes ``flattened_bucket`` payloads through
        as they are (``entrypoints/engine.py`` ``_serialize_tensors_per_rank``)."""
        check_weight_names(names, self.weight_names)
        _check(
            self.engine.update_weights_from_tensor(
                named_tensors=payloads, load_format=load_format, flush_cache=False
            ),
            "update_weights_from_tensor",
        )

    def begin_weight_update(self) -> None:
        _check(self.engine.begin_weight_update(), "begin_weight_update")

    def end_weight_update(self) -> None:
        _check(self.engine.end_weight_update(), "end_weight_update")

    def init_weights_update_group(self, **kwargs: Any) -> Any:
        return _check(self.engine.init_weights_update_group(**kwargs), "init_weights_update_group")

    def update_weights_from_distributed(self, **kwargs: Any) -> Any:
        check_weight_names(kwargs.get("names", []), self.weight_names)
        return _check(
            self.engine.update_weights_from_distributed(**kwargs), "update_weights_from_distributed"
        )

    def flush_cache(self) -> None:
        """``Engine.flush_cache`` answers a ``FlushCacheReqOutput`` (sglang 0.5.23
        ``managers/io_struct.py``); refused while requests run."""
        result = self.engine.flush_cache()
        if getattr(result, "success", True) is False:
            raise RuntimeError(f"SGLang flush_cache failed: {getattr(result, 'message', '')}")

    def release_memory(self) -> None:
        self._require_idle("release_memory")
        self.engine.release_memory_occupation()  # answers None (ReleaseMemoryOccupationReqOutput)

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def health(self) -> bool:
        try:
            self.engine.get_server_info()
        except Exception:
            return False
        return True

    def shutdown(self) -> None:
        self.engine.shutdown()


def flattened_bucket_payloads(bucket: NamedTensors, tp_size: int, *, keep: bool = False) -> Any:
    """One serialized ``FlattenedTensorBucket`` per tensor-parallel rank (sglang required):
    what ``update_weights_from_tensor(load_format="flattened_bucket")`` takes
    (``weight_sync/tensor_bucket.py``, ``entrypoints/engine.py``). With ``keep``, also the
    flat tensor, which the sender holds until the engine has answered."""
    require_sglang()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    payloads = [MultiprocessingSerializer.serialize(data, output_str=True) for _ in range(tp_size)]
    return (payloads, data["flattened_tensor"]) if keep else payloads


def serialized_named_tensors(bucket: NamedTensors, tp_size: int) -> list[str]:
    """The ``serialized_named_tensors`` field of ``/update_weights_from_tensor`` (sglang required)."""
    require_sglang()
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.serialize(bucket, output_str=True) for _ in range(tp_size)]


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


@contextmanager
def weight_update_session(engine: Any) -> Iterator[None]:
    """``begin_weight_update`` ... ``end_weight_update`` around a weight update: sglang 0.5.23
    refuses ``update_weights_from_tensor`` / ``_from_distributed`` outside one
    (``managers/scheduler_components/weight_updater.py``). The session is closed even when a
    bucket fails, so the next update can open one; the bucket's error is the one raised."""
    engine.begin_weight_update()
    try:
        yield
    except BaseException:
        try:
            engine.end_weight_update()
        except Exception:  # the first error is the one worth reporting
            logger.warning("end_weight_update after a failed update also failed", exc_info=True)
        raise
    engine.end_weight_update()


def cuda_bucket(bucket: NamedTensors, where: str) -> NamedTensors:
    """The bucket as CUDA tensors, the only kind a process we did not start can open (by CUDA
    IPC handle; see ``SGLangClient.update_weights``). CPU tensors are copied to this process's
    GPU where it has one (a colocated engine worker), else refused."""
    import torch

    if all(t.device.type == "cuda" for _, t in bucket):
        return bucket
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        return [(name, t.to(device)) for name, t in bucket]
    for name, tensor in bucket:
        if tensor.device.type != "cuda":
            raise ValueError(
                f"{where}: weight {name!r} is on {tensor.device}; a separately launched SGLang "
                "server takes CUDA tensors (CUDA IPC, same node) or the NCCL path "
                "(DistributedWeightSender), never CPU tensors (their file descriptors open "
                "only in child processes)"
            )


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


# ------------------------------------------------------------------------------- server mode


class SGLangServer:
    """A launched SGLang server process (``python -m sglang.launch_server``), health-checked.

    ``command`` overrides the launch command (tests use a stand-in speaking the same HTTP
    API). The process gets its own process group so :meth:`stop` ends all its workers.
    """

    def __init__(
        self,
        config: SGLangConfig,
        *,
        command: list[str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        if command is None:
            require_sglang()
            command = config.server_command()
        self.config = config
        self.url = f"http://{config.host}:{config.port}"
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        logger.info("launching SGLang server on %s: %s", self.url, " ".join(command))
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        if wait:  # wait=False lets a caller start several servers, then wait for each
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float) -> None:
        import requests as http  # server mode only: the HF-engine path runs without requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self.process.returncode} before it was "
                    f"healthy (command: {' '.join(map(str, self.process.args))})"
                )
            try:
                if http.get(self.url + "/health", timeout=5).status_code == 200:
                    logger.info("SGLang server %s is healthy", self.url)
                    return
            except http.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang server {self.url} not healthy after {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


def _session() -> requests.Session:
    import requests as http

    return http.Session()


class SGLangClient(_CheckedGenerate):
    """:class:`~rollout_sglang.types.RolloutEngine` talking to an SGLang server over HTTP.

    Give it ``url`` of a running server, or ``server`` (an :class:`SGLangServer` it then owns
    and stops on :meth:`shutdown`). Weight updates: ``update_weights`` sends buckets through
    ``/update_weights_from_tensor`` (same node; serialization needs sglang in this process);
    for another node use :class:`~rollout_sglang.weight_sync.DistributedWeightSender`.
    """

    name = "sglang-server"

    def __init__(
        self,
        url: str | None = None,
        *,
        server: SGLangServer | None = None,
        limits: RequestLimits | None = None,
        tp_size: int = 1,
        timeout: float = 3600.0,
        weight_names: WeightNameCheck | None = None,
        deterministic: bool | None = None,
    ) -> None:
        if (url is None) == (server is None):
            raise ValueError("give exactly one of url= or server=")
        self.server = server
        self.url = (server.url if server else url).rstrip("/")
        self.limits = limits
        self.tp_size = tp_size
        self.timeout = timeout
        self.weight_names = weight_names
        self.deterministic = deterministic
        self.session = _session()
        logger.info("rollout engine: SGLang server at %s", self.url)

    def _post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """POST and decode the answer: JSON where SGLang answers JSON (``null`` included), the
        text where it answers plain text (``/flush_cache``, sglang 0.5.23
        ``entrypoints/http_server.py``). A non-200 answer raises with its body."""
        response = self.session.post(self.url + path, json=payload or {}, timeout=self.timeout)
        if response.status_code != 200:
            raise RuntimeError(
                f"{path} answered HTTP {response.status_code}: {response.text[:500]}"
            )
        if "json" in response.headers.get("content-type", ""):
            return response.json()
        return response.text

    def _send(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        if self.deterministic is False:
            _warn_ignored_seed(params, None)
        outputs = self._post("/generate", generate_payload(requests, params, self.image_token_id))
        if isinstance(outputs, dict):
            outputs = [outputs]
        if not isinstance(outputs, list) or len(outputs) != len(requests):
            raise RuntimeError(
                f"/generate returned {type(outputs).__name__} of length "
                f"{len(outputs) if isinstance(outputs, list) else '-'} for {len(requests)} requests"
            )
        return [parse_output(o, r) for o, r in zip(outputs, requests, strict=True)]

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """CUDA tensors only, by CUDA IPC handle (trainer and server on the same node).

        A CPU tensor pickled by ``MultiprocessingSerializer`` travels as a file descriptor
        that only a child of the sending process can open; a server launched on its own
        fails with an AuthenticationError (sglang 0.5.23 ``utils`` ``MultiprocessingSerializer``
        uses ``torch.multiprocessing`` reductions). CPU tensors are therefore copied to this
        process's GPU first (a colocated worker has one) and refused where there is none,
        before anything is sent: use :class:`~rollout_sglang.weight_sync.DistributedWeightSender`
        (NCCL) for a server on other GPUs.
        """
        with weight_update_session(self):
            for bucket in buckets:
                check_weight_names([name for name, _ in bucket], self.weight_names)
                bucket = cuda_bucket(bucket, f"SGLang server {self.url}")
                _check(
                    self._post(
                        "/update_weights_from_tensor",
                        {
                            "serialized_named_tensors": serialized_named_tensors(
                                bucket, self.tp_size
                            ),
                            "load_format": None,
                            "flush_cache": False,
                        },
                    ),
                    "update_weights_from_tensor",
                )
        self.flush_cache()

    def update_weights_from_serialized(
        self, names: list[str], payloads: list[str], load_format: str = "flattened_bucket"
    ) -> None:
        """One bucket serialized by the sender (CUDA IPC handles, one payload per TP rank;
        ``rollout_sglang.cuda_ipc``) to ``/update_weights_from_tensor``, inside a session the
        caller opened."""
        check_weight_names(names, self.weight_names)
        _check(
            self._post(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": payloads,
                    "load_format": load_format,
                    "flush_cache": False,
                },
            ),
            "update_weights_from_tensor",
        )

    def begin_weight_update(self) -> None:
        _check(self._post("/begin_weight_update", {"selector": "all"}), "begin_weight_update")

    def end_weight_update(self) -> None:
        _check(self._post("/end_weight_update"), "end_weight_update")

    def init_weights_update_group(self, **kwargs: Any) -> Any:
        return _check(self._post("/init_weights_update_group", kwargs), "init_weights_update_group")

    def update_weights_from_distributed(self, **kwargs: Any) -> Any:
        check_weight_names(kwargs.get("names", []), self.weight_names)
        return _check(
            self._post("/update_weights_from_distributed", kwargs),
            "update_weights_from_distributed",
        )

    def flush_cache(self) -> None:
        """``/flush_cache`` answers plain text, 200 when flushed, 400 when requests run."""
        self._post("/flush_cache")

    def release_memory(self) -> None:
        """``/release_memory_occupation`` answers ``null`` (an error: ``{"error": ...}``)."""
        self._require_idle("release_memory")
        self._post("/release_memory_occupation")

    def resume_memory(self) -> None:
        self._post("/resume_memory_occupation")

    def health(self) -> bool:
        try:
            return self.session.get(self.url + "/health", timeout=10).status_code == 200
        except Exception:  # connection refused, timeout: not healthy
            return False

    def shutdown(self) -> None:
        self.session.close()
        if self.server is not None:
            self.server.stop()
