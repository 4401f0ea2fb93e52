"""The narrow interfaces the loops see. Concrete backends (FSDP, Megatron, SGLang, the
transformers engine) live in other packages; the app assembles them into these shapes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class TrainActor(Protocol):
    """One trainer rank (docs/architecture.md, "Actors")."""

    def compute_logprobs(self, batch: Any, *, reference: bool = False) -> list[Tensor]: ...

    def train_step(self, batch: Any, *, loss: str = "grpo") -> dict[str, float]: ...

    def iter_hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]: ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def export_hf(self, path: str | Path) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def release_cache(self) -> None:
        """Return the accelerator's cached, unused memory (the last phase's activations) to the
        device, so that a colocated engine can take it while the weights stay in place."""
        ...


class PromptSource(Protocol):
    """Indexable prompts. `get(i)` returns a prompt (a `vlm_data.PromptSample`-like object with
    `input_ids`, `pixel_values`, `image_grid_thw`, `mm_token_type_ids`, `answer`) or None when
    row `i` is bad (the source logs why and counts it in `skipped`)."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> Any | None: ...

    @property
    def skipped(self) -> int: ...


class RewardFn(Protocol):
    """`(response text, label) -> score`; 0/1 for the math reward."""

    def __call__(self, response: str, label: str) -> float: ...


class Decoder(Protocol):
    def __call__(self, token_ids: Sequence[int]) -> str: ...
