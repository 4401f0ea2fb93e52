"""The narrow interfaces the loops see. Concrete backends (FSDP, Megatron, SGLang, the
transformers engine) live in other packages; the app assembles them into these shapes. The
weight-sync protocol (`WeightTransport`, `TransportFactory`, `EngineLink`) is `weight_sync`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rl_algos.run_context import ModelShape, ParallelLayout, RunContext, StateBytes, TrainLayout

if TYPE_CHECKING:  # torch: the launcher reads these protocols before torch loads
    from torch import Tensor


@runtime_checkable
class TrainActor(Protocol):
    """One trainer rank: what rl-runtime calls on each (both trainer packages implement it)."""

    def compute_logprobs(self, batch: Any, *, reference: bool = False) -> list[Tensor]: ...

    def train_step(self, batch: Any, *, loss: str = "grpo") -> dict[str, float]: ...

    def iter_hf_weights(
        self, bucket_bytes: int, *, device: str | None = "cpu"
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """HF-named full tensors in buckets; ``device=None`` leaves them where the weights
        live (the GPU), for a transport that does not need them on the host."""
        ...

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def export_hf(self, path: str | Path) -> None: ...

    def offload(self) -> dict[str, float] | None:
        """Move the trainer's state to the host; the copy's metrics (``perf/offload_gbps``...,
        `trainer_core.offload.transfer_metrics`), or nothing."""
        ...

    def onload(self) -> dict[str, float] | None:
        """Bring the state back; the copy's metrics (``perf/onload_gbps``...), or nothing."""
        ...

    def release_cache(self) -> None:
        """Return the accelerator's cached, unused memory (the last phase's activations) to the
        device, so that a colocated engine can take it while the weights stay in place."""
        ...


class TrainerConfig(Protocol):
    """A trainer package's config (`trainers_fsdp.FsdpConfig`, `trainers_megatron.MegatronConfig`):
    the user's settings, completed for one run by `for_run`, then built into the actor in each
    trainer rank by the package's `ActorClass` (the launcher hands both over: settings name
    nothing they build). It describes its backend, so that rl-runtime never asks which one it
    is: the layouts it runs (`supports`), what a layout costs per GPU (`state_bytes`) and how a
    layout reads (`describe_layout`, `layout_flags`)."""

    max_tokens_per_gpu: int

    def for_run(self, run: RunContext) -> TrainerConfig:
        """This config completed for one run (ValueError: a layout it cannot run)."""
        ...

    def supports(self, layout: ParallelLayout, world_size: int | None = None) -> str | None:
        """Why this backend cannot run ``layout`` on ``world_size`` trainer ranks (None: not
        known yet), naming the flag; None when it can."""
        ...

    def state_bytes(
        self, shape: ModelShape, layout: TrainLayout, *, vision_patches_per_token: float = 0.25
    ) -> StateBytes:
        """What one GPU holds at a training step's peak on ``layout``, by part."""
        ...

    def describe_layout(self, layout: TrainLayout) -> list[str]:
        """How the ranks hold the model on ``layout``, in words (recompute and the token
        budget are added by rl-runtime)."""
        ...

    def layout_flags(self, layout: TrainLayout) -> list[str]:
        """The launcher flags that select this backend and ``layout`` (the recompute and token
        flags are added by rl-runtime)."""
        ...

    def machine_refusal(self, *, use_gpu: bool) -> str | None:
        """Why a setting cannot work on this machine (a GPU-only kernel on a CPU run, a kernel
        package not installed), naming the flag; None when all can."""
        ...


#: A trainer package's actor class, imported on call (ImportError: the backend is not
#: installed): `trainers_fsdp.build.actor_class`, `trainers_megatron.build.actor_class`. Each
#: trainer rank builds ``actor_class()(trainer_config)`` in its own process.
ActorClass = Callable[[], Callable[[Any], TrainActor]]


#: An engine's memory by part, as `resume_memory(tags)` takes it (SGLang's memory types): the
#: weights, which a push needs, and the KV cache with the graphs, which the next rollout needs.
WEIGHTS: tuple[str, ...] = ("weights",)
KV_CACHE: tuple[str, ...] = ("kv_cache", "cuda_graph")


class EngineLauncher(Protocol):
    """What a GRPO run asks of a rollout engine package before its engines start
    (`rollout_sglang.launch`; `tools/typecheck.py` holds the module to this protocol). `cfg`
    is the package's own section of the recipe's config (`RolloutConfig`); a setting that
    cannot work raises `ValueError` naming the flag. The GRPO entry point reads its `backend`,
    `tp_size`, `dtype`, `max_batch_size`, `kv_cache_fraction`, `weights_cpu_backup` and
    `cache_tokens`, and sets `cache_tokens` (the colocation plan's) and `return_routed_experts`
    (routing replay) with `dataclasses.replace`."""

    def uses_sglang(self, cfg: Any, use_gpu: bool) -> bool:
        """Whether the engines size their KV cache once, at start (SGLang): colocated, they
        start before the trainers, and the colocation plan keeps the recipes' offload."""
        ...

    def check_engines(self, cfg: Any, *, use_gpu: bool) -> None: ...

    def weight_transport(
        self,
        cfg: Any,
        *,
        colocate: bool,
        use_gpu: bool,
        num_trainers: int,
        disk_folder: str | None = None,
    ) -> Any | None:
        """The `weight_sync.TransportFactory` for the layout (None: Ray's object store)."""
        ...

    def engine_factory(
        self,
        cfg: Any,
        *,
        source: Any,
        use_gpu: bool,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> Callable[[], Any]:
        """A picklable `factory()` that builds one engine of `source` inside its Ray actor."""
        ...


class PromptSource(Protocol):
    """Indexable prompts. `get(i)` returns a prompt (a `vlm_data.PromptSample`-like object with
    `input_ids`, `pixel_values`, `image_grid_thw`, `mm_token_type_ids`, `answer`) or None when
    row `i` is bad (the source logs why and counts it in `skipped`). `malformed_lines` are the
    rows lost before indexing (JSONL lines that are not a JSON object), counted once at load."""

    def __len__(self) -> int: ...

    def get(self, index: int) -> Any | None: ...

    @property
    def skipped(self) -> int: ...

    @property
    def malformed_lines(self) -> int: ...


class RewardFn(Protocol):
    """`(response text, label) -> score`; 0/1 for the math reward."""

    def __call__(self, response: str, label: str) -> float: ...


class Decoder(Protocol):
    def __call__(self, token_ids: Sequence[int]) -> str: ...
