"""trainer_core: trainer infrastructure shared by the FSDP and Megatron trainers (and the
rollout engine's offload): the packed :class:`MicroBatch` and its builder, pinned host
staging of micro-batches, reused pinned host copies for offloads, and the host threads of an
optimizer step on the CPU."""

from trainer_core.microbatch import MicroBatch, PinnedStaging, build_micro_batch, dummy_image
from trainer_core.offload import HostCopies, host_cores, host_threads, pinned_empty

__all__ = [
    "HostCopies",
    "MicroBatch",
    "PinnedStaging",
    "build_micro_batch",
    "dummy_image",
    "host_cores",
    "host_threads",
    "pinned_empty",
]
