"""The rollout engine protocol and the data it exchanges.

Every engine (SGLang in-process, SGLang server, the transformers engine, a router over several)
speaks this protocol, so the GRPO loop never knows which one runs. Token ids go in and come out
as ids: nothing is detokenised and re-tokenised on the way, so the trainer scores exactly the
tokens that were sampled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from weight_sync import NamedTensors  # one bucket of weights: the weight-sync protocol's

if TYPE_CHECKING:
    from PIL import Image

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. One set per ``generate`` call, shared by its requests.

    ``temperature == 0`` means greedy decoding. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. Generation stops at any of ``stop_token_ids`` and at the engine's EOS ids unless
    ``ignore_eos`` (benchmarks). ``seed`` is the batch's base seed: request ``i`` samples with
    ``seed + i`` (or its own ``GenerateRequest.seed``), so identical prompts still differ.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class GenerateRequest:
    """One prompt: processor outputs of a chat prompt (image placeholders already expanded).

    The transformers engine uses ``pixel_values`` / ``image_grid_thw``; SGLang takes the
    original ``images`` (it runs its own image processor, which must use the same pixel limits
    so that its placeholder count matches ``input_ids``).
    """

    input_ids: Tensor  # LongTensor[L]
    pixel_values: Tensor | None = None  # FloatTensor[P, D], all images of this prompt
    image_grid_thw: Tensor | None = None  # LongTensor[n_images, 3]
    mm_token_type_ids: Tensor | None = None  # LongTensor[L], 1 at image tokens
    images: list[Image.Image] = field(default_factory=list)
    request_id: str | None = None
    # This sample's own seed. Unset, an engine derives one from ``SamplingParams.seed`` and
    # the request's position in the batch, so the n samples of a GRPO group never share one.
    seed: int | None = None

    def __post_init__(self) -> None:
        self.input_ids = torch.as_tensor(self.input_ids, dtype=torch.long).reshape(-1)

    @classmethod
    def from_prompt(cls, sample: Any, request_id: str | None = None) -> GenerateRequest:
        """From a ``vlm_data.PromptSample`` (or anything with the same attribute names)."""
        return cls(
            input_ids=sample.input_ids,
            pixel_values=getattr(sample, "pixel_values", None),
            image_grid_thw=getattr(sample, "image_grid_thw", None),
            mm_token_type_ids=getattr(sample, "mm_token_type_ids", None),
            images=list(getattr(sample, "images", None) or []),
            request_id=request_id if request_id is not None else _index_id(sample),
        )

    @property
    def prompt_length(self) -> int:
        return int(self.input_ids.numel())


def _index_id(sample: Any) -> str | None:
    index = getattr(sample, "index", None)
    return None if index is None else str(index)


@dataclass
class Completion:
    """What one request produced.

    ``token_ids`` are the response ids exactly as sampled (a final EOS/stop id included, as the
    policy must learn to emit it). ``logprobs[i]`` is the log-probability of ``token_ids[i]``
    under the engine's sampling distribution *with temperature applied and before top-p/top-k
    truncation*: ``log_softmax(logits / T)`` (``T = 1`` for greedy). This is the quantity the
    trainer recomputes for TIS and the rollout-vs-trainer gap metric. A bad request gets
    ``finish_reason == "error"``, empty ids and a message in ``error``.

    ``routed_experts`` (MoE models, when the engine was asked to return them: routing replay)
    is SGLang's layout: an integer tensor ``[prompt_length + len(token_ids) - 1, layers, k]``,
    the experts each token the model ran on was routed to at each decoder layer (the last
    sampled token is never run).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_length: int
    error: str | None = None
    request_id: str | None = None
    routed_experts: Tensor | None = None

    @property
    def response_length(self) -> int:
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason != "error"

    @classmethod
    def failed(
        cls, message: str, *, prompt_length: int = 0, request_id: str | None = None
    ) -> Completion:
        return cls([], [], "error", prompt_length, error=message, request_id=request_id)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the GRPO loop needs from a rollout engine."""

    def generate(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        """One completion per request, in order; a bad request fails alone."""
        ...

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Load HF-named full tensors, bucket by bucket, into the live model."""
        ...

    def release_memory(self) -> None:
        """Free accelerator memory (weights and KV cache) while the trainer runs. Engines
        with nothing to free do nothing. Call it only when no generate call is running."""
        ...

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the released memory back: ``tags`` names the parts (SGLang's memory types:
        ``weights``, ``kv_cache``, ``cuda_graph``; None: all), so a colocated loop can bring the
        weights back for a push while the trainer still holds its state, and the KV cache only
        after it left. Engines that take their cache lazily treat the cache tags as a no-op."""
        ...

    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang refuses weights outside one); engines that
        need none do nothing. ``update_weights`` opens and closes its own."""
        ...

    def end_weight_update(self) -> None:
        """Close the session opened by :meth:`begin_weight_update`."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes computed with the old weights (``update_weights`` does it)."""
        ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
