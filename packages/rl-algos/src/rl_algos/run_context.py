"""What a launcher hands a trainer config for one run, and what a backend's memory estimate
is asked about. Plain data defined once here, because both the trainer packages and rl-runtime
depend on rl-algos and neither on the other: rl-runtime builds these, the trainers read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rl_algos.config import GrpoLossConfig
from rl_algos.optimizer import Schedule

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ParallelLayout:
    """How the trainer ranks split the model: tensor (``tp``, with sequence parallel ``sp``),
    context (``cp``), pipeline (``pp``), expert (``ep``, each expert split ``etp`` ways; None:
    as ``tp``) parallel, activation recomputation, and ``optimizer_offload``: the fraction of
    the optimizer state (float32 masters and AdamW moments) kept and stepped in host memory
    (0: all on the GPU). A backend says which it can run (``TrainerConfig.supports``)."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    recompute: Recompute = "none"
    optimizer_offload: float = 0.0


@dataclass(frozen=True)
class RunContext:
    """Everything ``TrainerConfig.for_run`` completes a config with: what the launcher settles
    (model source, seed, device, layout) and what the loop sets (sampling temperature, loss,
    reference model, schedule length). ``schedule``: a learning-rate schedule of the phase's
    own in place of the optimizer settings' (the SFT warm-up's constant rate: the ``--lr``
    settings are the GRPO steps'). ``routing_replay``: MoE forwards route to the experts the
    batch's ``routed_experts`` name (the engine's choices)."""

    model: Any
    seed: int
    use_gpu: bool
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    temperature: float = 1.0
    grpo: GrpoLossConfig | None = None
    reference_model: bool = False
    total_steps: int | None = None
    schedule: Schedule | None = None
    routing_replay: bool = False


@dataclass(frozen=True)
class ModelShape:
    """What a memory estimate needs to know of a model (MoE: ``intermediate_size`` is what one
    token passes through, ``language_params`` counts every expert)."""

    language_params: int
    vision_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_depth: int = 0
    expert_params: int = 0  # the part of language_params in routed experts (MoE)
    kv_bytes_per_token: int = 0  # bf16 keys and values of every attention layer (rollout)
    # a rollout engine's per-sequence states of the linear-attention layers (Qwen3.5's gated
    # delta nets: bf16 conv windows, float32 recurrent states); 0 without any
    state_bytes_per_sequence: int = 0


@dataclass(frozen=True)
class TrainLayout:
    """A layout on a number of trainer ranks with a micro-batch token budget: what a backend's
    memory estimate (``TrainerConfig.state_bytes``) is of."""

    world_size: int
    max_tokens_per_gpu: int
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    longest_sample: int = 0  # tokens of the longest sequence (0: not known)

    @property
    def dp(self) -> int:
        """Data-parallel replicas (ranks per replica: TP x CP x PP)."""
        p = self.parallel
        return max(1, self.world_size // (p.tp * p.cp * p.pp))

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens of one micro-batch on one GPU: the budget, or the longest sample's share
        when it is longer (a sample is never split over micro-batches; CP splits it)."""
        return max(self.max_tokens_per_gpu, -(-self.longest_sample // self.parallel.cp))

    @property
    def expert_tp(self) -> int:
        p = self.parallel
        return p.tp if p.etp is None else p.etp

    @property
    def recomputes(self) -> bool:
        """Whole layers recomputed (selective recomputation is counted as none: the safe
        side)."""
        return self.parallel.recompute == "full"


@dataclass(frozen=True)
class StateBytes:
    """A backend's answer to "how much of each does one GPU hold", in bytes."""

    weights: float
    gradients: float
    optimizer: float  # float32 masters and AdamW moments (the part kept on the GPU)
    activations: float
    logits: float
    host: float = 0.0  # host memory of this rank: the offloaded optimizer state and its buffers


def decoder_activations(
    shape: ModelShape, layout: TrainLayout, *, per_layer_token: float, saved_token: float
) -> float:
    """bf16 activations of the decoder for one micro-batch: every layer's (``per_layer_token``
    bytes per token), or with recomputation each layer's input (``saved_token``) plus one
    layer being recomputed. Shared by the backends, which differ in the per-token sizes."""
    tokens, layers = layout.tokens_per_gpu, shape.num_layers
    if layout.recomputes:
        return tokens * (layers * saved_token + per_layer_token)
    return tokens * layers * per_layer_token


def vision_activations(
    shape: ModelShape, layout: TrainLayout, *, recompute: bool, vision_patches_per_token: float
) -> float:
    """The vision tower's activations, ``vision_patches_per_token`` patches per token, counted
    as the decoder's; every CP rank runs the tower over the whole row's images."""
    d, vi = shape.vision_hidden_size, shape.vision_intermediate_size
    patches = layout.tokens_per_gpu * layout.parallel.cp * vision_patches_per_token
    per_block_patch = 2 * (8 * d + 4 * vi)
    if recompute:
        return patches * (shape.vision_depth * 2 * d + per_block_patch)
    return patches * shape.vision_depth * per_block_patch
