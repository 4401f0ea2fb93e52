"""trainer_core: trainer infrastructure shared by the FSDP and Megatron trainers (and the
rollout engine's offload): the packed :class:`MicroBatch` and its builder, pinned host
staging of micro-batches, and reused pinned host copies for offloads."""

from trainer_core.microbatch import MicroBatch, PinnedStaging, build_micro_batch, dummy_image
from trainer_core.offload import HostCopies

__all__ = ["HostCopies", "MicroBatch", "PinnedStaging", "build_micro_batch", "dummy_image"]
