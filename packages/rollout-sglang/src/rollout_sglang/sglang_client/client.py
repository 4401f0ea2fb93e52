"""The SGLang engine over HTTP: a server launched by
:class:`~rollout_sglang.sglang_client.server.SGLangServer` or already running."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rollout_sglang.sglang_client.common import _check, _CheckedGenerate, _warn_ignored_seed
from rollout_sglang.sglang_client.server import SGLangServer
from rollout_sglang.types import Completion, GenerateRequest, SamplingParams
from rollout_sglang.validation import RequestLimits
from weight_sync import NamedTensors
from weight_sync.cuda_ipc import cuda_bucket, serialized_named_tensors
from weight_sync.engine import weight_update_session
from weight_sync.weight_names import WeightNameCheck, check_weight_names

if TYPE_CHECKING:
    import requests

logger = logging.getLogger(__name__)


def _session() -> requests.Session:
    import requests as http

    return http.Session()


class SGLangClient(_CheckedGenerate):
    """:class:`~rollout_sglang.types.RolloutEngine` talking to an SGLang server over HTTP.

    Give it ``url`` of a running server, or ``server`` (an :class:`SGLangServer` it then owns
    and stops on :meth:`shutdown`). Weight updates: ``update_weights`` sends buckets through
    ``/update_weights_from_tensor`` (same node; serialization needs sglang in this process);
    for another node use :class:`~weight_sync.nccl.DistributedWeightSender`.
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
        routing_shape: tuple[int, int] | None = None,
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
        self.routing_shape = routing_shape
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
        outputs = self._post("/generate", self._payload(requests, params))
        if isinstance(outputs, dict):
            outputs = [outputs]
        if not isinstance(outputs, list) or len(outputs) != len(requests):
            raise RuntimeError(
                f"/generate returned {type(outputs).__name__} of length "
                f"{len(outputs) if isinstance(outputs, list) else '-'} for {len(requests)} requests"
            )
        return self._parse(outputs, requests)

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """CUDA tensors only, by CUDA IPC handle (trainer and server on the same node).

        A CPU tensor pickled by ``MultiprocessingSerializer`` travels as a file descriptor
        that only a child of the sending process can open; a server launched on its own
        fails with an AuthenticationError (sglang 0.5.23 ``utils`` ``MultiprocessingSerializer``
        uses ``torch.multiprocessing`` reductions). CPU tensors are therefore copied to this
        process's GPU first (a colocated worker has one) and refused where there is none,
        before anything is sent: use :class:`~weight_sync.nccl.DistributedWeightSender`
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
        ``weight_sync.cuda_ipc``) to ``/update_weights_from_tensor``, inside a session the
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
        self._mark_released()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` for the released types among ``tags`` (None: all),
        as its body's tags (`ResumeMemoryOccupationReqInput`)."""
        if todo := self._to_resume(tags):
            self._post("/resume_memory_occupation", {"tags": todo})

    def health(self) -> bool:
        try:
            return self.session.get(self.url + "/health", timeout=10).status_code == 200
        except Exception:  # connection refused, timeout: not healthy
            return False

    def shutdown(self) -> None:
        self.session.close()
        if self.server is not None:
            self.server.stop()
