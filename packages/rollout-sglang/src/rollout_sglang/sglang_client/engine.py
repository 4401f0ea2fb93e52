"""The in-process SGLang engine (``sglang.Engine`` in this process, its workers as children)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from rollout_sglang.sglang_client.common import (
    SGLangConfig,
    _check,
    _CheckedGenerate,
    _warn_ignored_seed,
    require_sglang,
)
from rollout_sglang.types import Completion, GenerateRequest, SamplingParams
from rollout_sglang.validation import RequestLimits
from weight_sync import NamedTensors
from weight_sync.cuda_ipc import flattened_bucket_payloads
from weight_sync.engine import weight_update_session
from weight_sync.weight_names import WeightNameCheck, check_weight_names

logger = logging.getLogger(__name__)


class SGLangEngine(_CheckedGenerate):
    """:class:`~rollout_sglang.types.RolloutEngine` over an in-process ``sglang.Engine``.

    ``update_weights`` uses ``update_weights_from_tensor`` (colocated: trainer and engine on
    the same GPUs, tensors passed by CUDA IPC handle). ``flatten_buckets`` sends each bucket as
    one flattened tensor plus metadata (SGLang's ``FlattenedTensorBucket``), fewer IPC handles.
    For a separate placement, use :class:`~weight_sync.nccl.DistributedWeightSender`
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
        routing_shape: tuple[int, int] | None = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.flatten_buckets = flatten_buckets
        self.weight_names = weight_names
        self.routing_shape = routing_shape
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
        outputs = self.engine.generate(**self._payload(requests, params))
        if isinstance(outputs, dict):
            outputs = [outputs]
        return self._parse(outputs, requests)

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
        ``weight_sync.cuda_ipc``), inside a session the caller opened. sglang 0.5.23's
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
        self._mark_released()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """The released types among ``tags`` (None: all) back, by SGLang's tags."""
        if todo := self._to_resume(tags):
            self.engine.resume_memory_occupation(tags=todo)

    def health(self) -> bool:
        try:
            self.engine.get_server_info()
        except Exception:
            return False
        return True

    def shutdown(self) -> None:
        self.engine.shutdown()
