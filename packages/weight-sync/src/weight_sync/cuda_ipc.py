"""Weight sync by CUDA IPC: trainer and engine processes on the same GPU share the bucket's memory.

Per bucket, the trainer copies the tensors into one flat buffer per dtype, sends each buffer's
CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) with the (name, shape,
offset) of every tensor in it, a message of a few kilobytes through Ray; the engine opens the
handle, views the tensors in place and copies them into its parameters, then answers. Nothing
crosses the host: a 2B model's 4 GB is a device-to-device copy on each side.

Two formats, one per engine kind:

- **Ours** (the transformers engine): :class:`PackedBucket`; buffers are reused across the
  buckets of one sync (two of them: the trainer fills one while the engine copies from the
  other) because :func:`load_packed_bucket` synchronises the engine's stream before it answers.
  Buffers are freed at the end of each sync: every handle sent wraps the storage in one more of
  torch's IPC reference counts, which only a free releases.
- **SGLang's** (sglang 0.5.23): ``update_weights_from_tensor`` with
  ``load_format="flattened_bucket"``: per tensor-parallel rank one
  ``MultiprocessingSerializer.serialize({"flattened_tensor", "metadata"}, output_str=True)``
  of a ``FlattenedTensorBucket`` (``python/sglang/srt/weight_sync/tensor_bucket.py``: all
  dtypes in one uint8 buffer; ``entrypoints/engine.py`` ``_serialize_tensors_per_rank`` passes
  such payloads through as they are; ``managers/tp_worker.py`` ``deserialize_own_rank`` makes
  each TP rank open only its own copy; ``model_executor/model_runner_components/
  weight_updater.py`` ``_update_weights_from_flattened_bucket`` rebuilds and loads it). The
  sender first applies sglang's ``monkey_patch_torch_reductions``
  (``utils/patch_torch.py``), so a handle names its GPU by UUID rather than by an index that
  means another GPU under the engine's ``CUDA_VISIBLE_DEVICES``. SGLang answers before its
  copies are known to be done, so these buffers are never reused: each bucket gets a fresh one
  that is dropped once answered, and torch's IPC reference count keeps its memory from being
  handed out again until the engine's processes let go (the way slime's colocated path does
  it: ``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``).

On a CPU the same packing runs and the flat buffers travel by value (through Ray's object
store), so the whole transport is testable without a GPU; only the handle exchange needs one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from weight_sync.protocol import NamedTensors
from weight_sync.weight_names import WeightNameCheck, check_weight_names

logger = logging.getLogger(__name__)

#: Offsets are rounded up to this many bytes, so that every view starts aligned (vectorised
#: copies, and SGLang's ``view(dtype)`` of a byte slice needs offsets a multiple of the size).
ALIGN_BYTES = 256


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in its dtype's flat buffer (offset and size in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PackedPart:
    """One dtype's flat buffer: shared (a CUDA IPC handle) or, on a CPU, the tensor itself."""

    dtype: torch.dtype
    buffer: Any
    slots: tuple[TensorSlot, ...]


@dataclass(frozen=True)
class PackedBucket:
    """A bucket as it travels to the engine: small, whatever the bucket's size on the GPU."""

    parts: tuple[PackedPart, ...]

    @property
    def names(self) -> list[str]:
        return [s.name for p in self.parts for s in p.slots]


def plan_layout(bucket: NamedTensors) -> dict[torch.dtype, tuple[list[TensorSlot], int]]:
    """Group a bucket's tensors by dtype, in order; each gets an aligned offset in its dtype's
    buffer. Returns ``{dtype: (slots, elements the buffer needs)}``."""
    layout: dict[torch.dtype, tuple[list[TensorSlot], int]] = {}
    for name, tensor in bucket:
        slots, size = layout.get(tensor.dtype, ([], 0))
        step = max(1, ALIGN_BYTES // tensor.element_size())
        offset = -(-size // step) * step
        slots.append(TensorSlot(name, tuple(tensor.shape), offset))
        layout[tensor.dtype] = (slots, offset + tensor.numel())
    return layout


def by_dtype(bucket: NamedTensors) -> list[NamedTensors]:
    """The bucket split by dtype, each part in the bucket's order."""
    parts: dict[torch.dtype, NamedTensors] = {}
    for name, tensor in bucket:
        parts.setdefault(tensor.dtype, []).append((name, tensor))
    return list(parts.values())


def unpack(flat: Tensor, slots: Iterable[TensorSlot]) -> NamedTensors:
    """Views of ``flat``, one per slot, in the slots' order (no copy)."""
    return [(s.name, flat[s.offset : s.offset + s.numel].view(s.shape)) for s in slots]


class FlatBuffers:
    """``slots`` sets of flat buffers per dtype, grown on demand and reused: set ``i % slots``
    holds bucket ``i``, so the trainer can fill one while the engine reads another."""

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device = device
        self.sets: list[dict[torch.dtype, Tensor]] = [{} for _ in range(slots)]

    def pack(self, bucket: NamedTensors, index: int) -> list[tuple[torch.dtype, Tensor, list]]:
        """Copy ``bucket`` into set ``index % slots``; returns (dtype, flat view, slots) for
        each dtype. The copies are queued on the current stream (synchronise before sharing)."""
        buffers = self.sets[index % len(self.sets)]
        out = []
        for dtype, (slots, numel) in plan_layout(bucket).items():
            flat = buffers.get(dtype)
            if flat is None or flat.numel() < numel:
                flat = buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
            out.append((dtype, flat[:numel], slots))
        for dtype, flat, slots in out:
            sources = [t for _, t in bucket if t.dtype == dtype]
            for (_, view), src in zip(unpack(flat, slots), sources, strict=True):
                view.copy_(src.reshape(view.shape), non_blocking=True)
        return out

    def free(self) -> None:
        for buffers in self.sets:
            buffers.clear()


def share(tensor: Tensor) -> Any:
    """What lets another process on this GPU open ``tensor``: its CUDA IPC handle (torch's
    ``reduce_tensor``: a rebuild function and its arguments). A CPU tensor goes as itself."""
    if tensor.device.type != "cuda":
        return tensor
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def open_shared(shared: Any) -> Tensor:
    """The tensor :func:`share` made shareable, in this process (a view of the sender's memory)."""
    if isinstance(shared, Tensor):
        return shared
    rebuild, args = shared
    return rebuild(*args)


def pack_bucket(buffers: FlatBuffers, bucket: NamedTensors, index: int) -> PackedBucket:
    """Pack ``bucket`` into the buffers and describe it; the copies are done on return."""
    parts = buffers.pack(bucket, index)
    if buffers.device.type == "cuda":
        # The engine reads from another process: the data must be there before the handle is.
        torch.cuda.current_stream(buffers.device).synchronize()
    return PackedBucket(
        tuple(
            PackedPart(
                dtype, share(flat) if buffers.device.type == "cuda" else flat.clone(), tuple(slots)
            )
            for dtype, flat, slots in parts
        )
    )


def load_packed_bucket(engine: Any, message: PackedBucket) -> int:
    """The engine's side (runs in the engine's process): open the buffers, load the views in
    place with the engine's ``update_weights``, and return only once the copies are done, so
    the sender may overwrite the buffers. Returns the number of tensors loaded."""
    named: NamedTensors = []
    devices = set()
    for part in message.parts:
        flat = open_shared(part.buffer)
        devices.add(flat.device)
        named.extend(unpack(flat, part.slots))
    engine.update_weights([named])
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    count = len(named)
    del named, flat  # close our mappings of the sender's memory before answering
    return count


# ------------------------------------------------------------ SGLang's flattened_bucket format


def _require_sglang() -> None:
    """SGLang's payload format needs sglang's own serializer (the GPU extra)."""
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the SGLang CUDA IPC format needs sglang (`uv sync --extra gpu` on a Linux GPU machine)"
        ) from exc


def flattened_bucket_payloads(bucket: NamedTensors, tp_size: int, *, keep: bool = False) -> Any:
    """One serialized ``FlattenedTensorBucket`` per tensor-parallel rank (sglang required):
    what ``update_weights_from_tensor(load_format="flattened_bucket")`` takes
    (``weight_sync/tensor_bucket.py``, ``entrypoints/engine.py``). With ``keep``, also the
    flat tensor, which the sender holds until the engine has answered."""
    _require_sglang()
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    payloads = [MultiprocessingSerializer.serialize(data, output_str=True) for _ in range(tp_size)]
    return (payloads, data["flattened_tensor"]) if keep else payloads


def serialized_named_tensors(bucket: NamedTensors, tp_size: int) -> list[str]:
    """The ``serialized_named_tensors`` field of SGLang's ``/update_weights_from_tensor``
    (sglang required): the tensors' CUDA IPC handles, one copy per TP rank."""
    _require_sglang()
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.serialize(bucket, output_str=True) for _ in range(tp_size)]


def cuda_bucket(bucket: NamedTensors, where: str) -> NamedTensors:
    """The bucket as CUDA tensors, the only kind a process we did not start can open (by CUDA
    IPC handle; an SGLang server's ``update_weights``). CPU tensors are copied to this process's
    GPU where it has one (a colocated engine worker), else refused."""
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
    return bucket


# ----------------------------------------------------------------------------- transports


def _begin(engine: Any) -> None:
    engine.begin_weight_update()


def _end(engine: Any) -> None:
    engine.end_weight_update()


def _flush(engine: Any) -> None:
    engine.flush_cache()


def _load_serialized(engine: Any, names: list[str], payloads: list[str]) -> int:
    engine.update_weights_from_serialized(names, payloads, "flattened_bucket")
    return len(names)


def _gpu_uuids(engine: Any) -> list[str]:
    """UUIDs of the GPUs this (engine) process sees."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _wait_all(futures: Sequence[Future]) -> list[Any]:
    """Every engine's answer, in order; the first error is raised as it came (a dead engine's
    Ray error stays one, so the run's fault handling can name it)."""
    return [f.result() for f in futures]


class CudaIpcTransport:
    """Buckets to colocated engines by CUDA IPC handle; a
    :class:`~weight_sync.protocol.WeightTransport`.

    ``engines`` are links (``submit(fn, *args) -> Future``, running ``fn(engine, *args)`` in
    the engine's process: :class:`~weight_sync.object_store.RemoteEngine`). ``sglang``: speak SGLang's
    ``flattened_bucket`` format (module docstring) instead of ours. Two buckets are in flight
    at most. On a CPU the buffers travel by value (tests).
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        sglang: bool = False,
        tp_size: int = 1,
        weight_names: WeightNameCheck | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.engines = list(engines)
        self.sglang = sglang
        self.tp_size = tp_size
        self.weight_names = weight_names
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._check_same_gpu()
        elif sglang:
            raise ValueError("CUDA IPC to SGLang needs the trainer's tensors on a GPU")

    def _check_same_gpu(self) -> None:
        """Every engine must see this GPU: a handle opens only on the device it was made on."""
        mine = str(torch.cuda.get_device_properties(self.device).uuid)
        seen = _wait_all([e.submit(_gpu_uuids) for e in self.engines])
        for i, uuids in enumerate(seen):
            if mine not in uuids:
                raise RuntimeError(
                    f"CUDA IPC weight sync: rollout engine {i} does not see the trainer's GPU "
                    f"{mine} (it sees {uuids or 'no GPU'}); colocate them, or use the "
                    "object-store or NCCL transport"
                )

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        if self.sglang:
            return self._send_sglang(buckets)
        buffers = FlatBuffers(self.device)
        in_flight: list[list[Future]] = [[], []]
        count = 0
        try:
            for i, bucket in enumerate(buckets):
                check_weight_names([name for name, _ in bucket], self.weight_names)
                _wait_all(in_flight[i % 2])  # the engines are done with this set of buffers
                message = pack_bucket(buffers, bucket, i)
                in_flight[i % 2] = [e.submit(load_packed_bucket, message) for e in self.engines]
                count += len(bucket)
            for futures in in_flight:
                _wait_all(futures)
        finally:
            buffers.free()
        return count

    def _send_sglang(self, buckets: Iterable[NamedTensors]) -> int:
        _require_sglang()
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        _wait_all([e.submit(_begin) for e in self.engines])
        count = 0
        try:
            pending: list[Future] = []
            held: Any = None
            for part in (p for bucket in buckets for p in by_dtype(bucket)):
                # one dtype per payload: SGLang's byte buffer views each tensor in its dtype,
                # which needs offsets that are multiples of its size
                names = [name for name, _ in part]
                check_weight_names(names, self.weight_names)
                payloads, flat = flattened_bucket_payloads(
                    [(n, t.to(self.device)) for n, t in part], self.tp_size, keep=True
                )
                _wait_all(pending)  # one bucket loading while the next is packed
                # the previous bucket's buffer is dropped here, once answered; torch frees it
                # when the engine's processes have let go too (module docstring)
                held = flat
                pending = [e.submit(_load_serialized, names, payloads) for e in self.engines]
                count += len(part)
            _wait_all(pending)
            del held
        except BaseException:
            try:
                _wait_all([e.submit(_end) for e in self.engines])
            except Exception:  # the first error is the one worth reporting
                logger.warning("end_weight_update after a failed update also failed", exc_info=True)
            raise
        _wait_all([e.submit(_end) for e in self.engines])
        _wait_all([e.submit(_flush) for e in self.engines])
        return count

    def close(self) -> None:
        """Nothing held between syncs."""


@dataclass(frozen=True)
class CudaIpc:
    """Builds a :class:`CudaIpcTransport` in the trainer's process (a picklable factory)."""

    sglang: bool = False
    tp_size: int = 1
    weight_names: WeightNameCheck | None = None
    restartable: ClassVar[bool] = True  # a restarted engine is asked for its GPU again

    def __call__(self, engines: Sequence[Any]) -> CudaIpcTransport:
        return CudaIpcTransport(
            engines, sglang=self.sglang, tp_size=self.tp_size, weight_names=self.weight_names
        )
