"""HF-named weights in size-bounded buckets: what every transport is fed.

One bucketer for every trainer (FSDP gathers full tensors, Megatron converts its shards), so a
bucket holds the same names whichever trainer made it. A bucket bounds the memory a transport
holds at once (a host copy, a flat IPC buffer, a file) whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import Tensor

from weight_sync.protocol import NamedTensors


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def iter_weight_buckets(
    named_tensors: Iterable[tuple[str, Tensor]],
    bucket_bytes: int,
    *,
    convert: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
) -> Iterator[NamedTensors]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes``.

    A tensor larger than the budget gets a bucket of its own. The input is consumed lazily, so
    a generator that gathers sharded parameters one at a time keeps at most one bucket alive.
    ``convert`` rewrites each bucket before it is yielded (e.g. to the checkpoint layout:
    ``functools.partial(vlm_models.weights.to_wire_layout, model)``).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")

    def emit(bucket: NamedTensors) -> NamedTensors:
        return bucket if convert is None else list(convert(dict(bucket)).items())

    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        n = _nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield emit(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield emit(bucket)
