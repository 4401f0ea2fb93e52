"""The rollout engine over a transformers Qwen3-VL model, for machines without SGLang.

A small serving engine rather than a ``model.generate`` loop, because rollout time is decode
time: prompts are prefilled through the transformers model itself (vision tower, DeepStack,
M-RoPE positions: exactly the trainer's forward) and their keys/values copied into a
preallocated per-slot KV cache (:mod:`~rollout_sglang.hf.prefill`,
:mod:`~rollout_sglang.hf.kv_cache`); decode runs our own forward over the same weights
(:mod:`~rollout_sglang.hf.decode`), captured once per (batch bucket, KV-length bucket) as a CUDA
graph (:mod:`~rollout_sglang.hf.decode_runner`), with sampling and log-probs inside the graph;
continuous batching (:mod:`~rollout_sglang.hf.scheduler`) refills a finished sequence's slot
at once. The decode step covers Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE; other models,
or ``legacy_decode=True``, use the transformers loop of :mod:`~rollout_sglang.hf.legacy` (slow:
a reference and an escape hatch). Qwen3.5's prompts are prefilled in groups of equal length: a
padded row would run its pads through the gated-delta-net recurrence and spoil its state.

Each request samples with its own seed (``GenerateRequest.seed``, else ``SamplingParams.seed``
plus its position) through a counter-based draw: its uniforms depend on its seed and token index
only, not on which other requests share the call, nor on the slot or step it ran in. Its logits
are not batch-invariant bit for bit: a batch of another size may run other kernel blockings, so
they agree with the request's logits alone to float32 rounding. Greedy tokens and top-k draws
therefore match one-at-a-time generation unless a near-tie or a draw within rounding of a
cumulative-probability boundary tips them (over a near-flat full vocabulary, one does now and
then); log-probs match to ~1e-6.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from rollout_sglang.hf.decode import TextDecoder, supports
from rollout_sglang.hf.decode_runner import DecodeRunner
from rollout_sglang.hf.kv_cache import CacheSize, KVCache, KVCacheTooSmall, cache_size
from rollout_sglang.hf.legacy import LegacyHFEngine, _eos_ids
from rollout_sglang.hf.prefill import Prefill
from rollout_sglang.hf.routing import PrefillRouting, sequence_routing
from rollout_sglang.hf.sampling import SamplingKey
from rollout_sglang.hf.scheduler import Scheduler, SeqState, round_up
from rollout_sglang.hf.weights import DroppedWeights, WeightLoader
from rollout_sglang.types import Completion, GenerateRequest, NamedTensors, SamplingParams
from rollout_sglang.validation import RequestLimits, request_error
from trainer_core import HostCopies
from trainer_core.compile_log import log_compiles

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1

# ``vlm_models.build.build_model`` options of the engine's model: the prefill runs the vision
# tower as the trainers do (all images in one varlen attention kernel, not one SDPA call per
# image; F.rms_norm), so the engine's and the trainer's log-probs see the same vision features.
ENGINE_MODEL_OPTIONS = {"fused_vision_attention": True, "fused_rms_norm": True}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def resolve_attention(choice: str, device: torch.device) -> str:
    """The decode attention ``choice`` names; "auto": the Triton split-KV kernel on CUDA where
    triton imports (it reads each slot's live keys only), SDPA elsewhere."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "sdpa"
    try:
        import rollout_sglang.hf.decode_attention  # noqa: F401
    except ImportError as exc:
        logger.info("decode attention: SDPA (%s)", exc)
        return "sdpa"
    return "triton"


class HFEngine:
    """:class:`~rollout_sglang.types.RolloutEngine` over a ``*ForConditionalGeneration`` model.

    Args:
        model: a Qwen3-VL (or Qwen3.5) transformers model, already on ``device``.
        device: where generation runs (default: the model's device).
        eos_token_ids: ids that end a response (default: the model's generation config).
        max_batch_size: sequences decoding at once at most (KV-cache slots).
        max_prompt_length: longer prompts fail with an error (default: the model's context
            minus one); ``max_new_tokens`` is clipped so prompt + response fit the context.
        kv_cache_fraction: share of the GPU's free memory (at the first generate) the KV cache
            takes; ``cache_tokens`` sets its size in tokens instead (CPU default: 64k).
        prefill_tokens: padded prompt tokens per prefill forward at most.
        kv_block: KV-length bucket granularity (default 128 on GPU, 16 on CPU).
        cuda_graphs: capture decode steps as CUDA graphs (CUDA only; eager otherwise).
        compile: ``torch.compile`` the decode step's per-layer blocks (fuses small kernels).
        decode_attention: "auto" (the Triton split-KV kernel on CUDA where triton imports,
            else SDPA), "triton", "sdpa" or "matmul" (see
            :class:`~rollout_sglang.hf.decode.TextDecoder`).
        admit_fraction: admit waiting requests while others decode once this share of the
            slots is free (one prefill forward per group of arrivals).
        prune_fraction: only for models on the transformers fallback loop.
        decode_moe: MoE experts in the decode step: "auto" (grouped GEMM on CUDA, dense
            elsewhere), "dense" or "grouped" (see :mod:`~rollout_sglang.hf.moe`).
        legacy_decode: decode through the transformers loop (:mod:`~rollout_sglang.hf.legacy`)
            even where the decode step covers the model.
        return_routed_experts: MoE models: each completion carries the experts every token
            was routed to (:mod:`~rollout_sglang.hf.routing`), for routing replay in the
            trainer; as SGLang's option of that name.
    """

    name = "hf"

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 256,
        max_prompt_length: int | None = None,
        pad_token_id: int = 0,
        kv_cache_fraction: float = 0.5,
        cache_tokens: int | None = None,
        prefill_tokens: int = 16384,
        kv_block: int | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        decode_attention: str = "auto",
        admit_fraction: float = 0.125,
        prune_fraction: float = 0.25,
        decode_moe: str = "auto",
        legacy_decode: bool = False,
        weights_backup: bool = True,
        return_routed_experts: bool = False,
    ) -> None:
        self.model = model.eval()
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        # the decode blocks' compiles and the Triton kernels' autotunes name themselves
        log_compiles(triton_autotune=self.device.type == "cuda")
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(model)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        config = model.config
        self.context_length = int(config.get_text_config().max_position_embeddings)
        self.limits = RequestLimits(
            image_token_id=config.image_token_id,
            merge_size=config.vision_config.spatial_merge_size,
            max_prompt_length=max_prompt_length or self.context_length - 1,
            needs_pixels=True,
        )
        self.prefill_tokens = prefill_tokens
        self.kv_block = kv_block or (128 if self.device.type == "cuda" else 16)
        self.admit_fraction = admit_fraction
        self._loader = WeightLoader(model)
        self._released = False
        self._host = HostCopies()  # pinned host twins of the weights while released
        self.weights_backup = weights_backup
        self._dropped = DroppedWeights()  # (without a backup)
        self.last_stats: dict[str, float] = {}  # where the last generate's time went
        self._legacy: LegacyHFEngine | None = None
        self._routing: PrefillRouting | None = None  # set below where routing is returned
        self.cache: KVCache | None = None
        self.runner: DecodeRunner | None = None
        if legacy_decode or not supports(model):
            self._legacy = LegacyHFEngine(
                model,
                device=self.device,
                eos_token_ids=self.eos_token_ids,
                max_batch_size=max_batch_size,
                max_prompt_length=max_prompt_length,
                pad_token_id=pad_token_id,
                prune_fraction=prune_fraction,
            )
            logger.info(
                "rollout engine: transformers HFEngine, generic loop (%s)",
                "legacy_decode=True"
                if legacy_decode
                else f"{type(model).__name__} has text layers the graph decode does not cover",
            )
            return
        self.decoder = TextDecoder(
            model,
            compile=compile,
            attention=resolve_attention(decode_attention, self.device),
            moe=decode_moe,
        )
        bytes_per_token = KVCache.bytes_per_token(
            self.decoder.num_layers,
            self.decoder.kv_heads,
            self.decoder.head_dim,
            self.decoder.dtype,
        )
        self._kv_cache_fraction = kv_cache_fraction
        self._cache_tokens = cache_tokens
        self._bytes_per_token = bytes_per_token
        # None for a dense model: there is nothing to replay
        shape = self.decoder.routing_shape if return_routed_experts else None
        self._routing = (
            None if shape is None else PrefillRouting(self.decoder.text.layers, shape[1])
        )
        self.prefill = Prefill(
            model, self.decoder, self.device, pad_token_id=pad_token_id, routing=self._routing
        )
        self.cuda_graphs = cuda_graphs
        logger.info(
            "rollout engine: transformers HFEngine (%s on %s, eos %s, %s decode%s, %s attention)",
            type(model).__name__,
            self.device,
            list(self.eos_token_ids),
            "CUDA-graph" if cuda_graphs and self.device.type == "cuda" else "eager",
            ", compiled" if compile else "",
            self.decoder.attention,
        )

    # ---------------------------------------------------------------- generation

    def _cache_budget(self, states: Any) -> CacheSize:
        """The KV cache's size at an allocation (:func:`~rollout_sglang.hf.kv_cache.cache_size`):
        ``cache_tokens`` where given (the colocation plan's), checked against the free memory
        with the slots' recurrent states (Qwen3.5); else ``kv_cache_fraction`` of the free
        memory, the states out of the same share."""
        return cache_size(
            device=self.device,
            bytes_per_token=self._bytes_per_token,
            mem_fraction=self._kv_cache_fraction,
            cpu_tokens=65536,
            planned_tokens=self._cache_tokens,
            slot_bytes=0 if states is None else states.bytes_per_slot(),
            max_slots=self.max_batch_size,
        )

    def _ensure_cache(self) -> tuple[KVCache, DecodeRunner]:
        if self.cache is None:
            states = self.decoder.linear_states(self.device)
            self.cache = KVCache(
                states=states,
                num_layers=self.decoder.num_layers,
                kv_heads=self.decoder.kv_heads,
                head_dim=self.decoder.head_dim,
                dtype=self.decoder.dtype,
                device=self.device,
                # colocated, the cache is released while the trainer runs and taken again at
                # the next rollout: sized (or its planned size checked) against what is free
                # then, and logged, at each allocation
                budget_tokens=lambda: self._cache_budget(states),
            )
            self.runner = DecodeRunner(
                self.decoder,
                self.cache,
                self.device,
                use_graphs=self.cuda_graphs,
                record_routing=self._routing is not None,
            )
        assert self.runner is not None
        return self.cache, self.runner

    def generate(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        """One :class:`Completion` per request, in order; a bad request fails alone."""
        if self._released:
            raise RuntimeError("HFEngine.generate after release_memory(); call resume_memory()")
        if self._legacy is not None:
            return self._legacy.generate(requests, params)
        self._dropped.check_refilled(self._loader)
        cache, runner = self._ensure_cache()
        try:
            cache.allocate()  # its budget is what the requests are checked against
        except KVCacheTooSmall as exc:
            # every request fails with the reason: the loop stops the run on a rollout that
            # returned nothing, naming it (rl_runtime.rollout_guard), as for any engine
            logger.error("%s", exc)
            return [
                Completion.failed(str(exc), prompt_length=r.prompt_length, request_id=r.request_id)
                for r in requests
            ]
        self.prefill.rope_memo = {}  # a prompt head's M-RoPE ids once per call (GRPO groups)
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        results: list[Completion | None] = [None] * len(requests)
        seqs: list[SeqState] = []
        too_big: list[int] = []  # cache tokens of the requests the cache cannot hold
        note = ""
        for i, request in enumerate(requests):
            error = request_error(request, self.limits, i)
            limit = min(params.max_new_tokens, self.context_length - request.prompt_length)
            seed = request.seed if request.seed is not None else base + i
            seq = SeqState(index=i, request=request, seed=seed & _SEED_MASK, limit=limit)
            if error is None and seq.cache_tokens > cache.budget_tokens:
                # It fits the model (``limit`` keeps prompt + response within its context), so
                # the cache is too small: a capacity error, which stops a GRPO run
                # (rl_runtime.rollout_guard reads these words), not bad input.
                note = note or self._cache_note(cache)
                error = (
                    f"{seq.name}: needs {seq.cache_tokens} KV-cache tokens, the cache holds "
                    f"{cache.budget_tokens} ({note})"
                )
                too_big.append(seq.cache_tokens)
            elif error is not None:  # bad input: it fails alone
                logger.warning("skipping %s", error)
            if error is None:
                seqs.append(seq)
            else:
                results[i] = Completion.failed(
                    error, prompt_length=request.prompt_length, request_id=request.request_id
                )
        if too_big:  # one line, not one per request
            logger.warning(
                "skipping %d of %d requests: they need up to %d KV-cache tokens, the cache "
                "holds %d (%s)",
                len(too_big),
                len(requests),
                max(too_big),
                cache.budget_tokens,
                note,
            )
        if seqs:
            need = round_up(max(s.cache_tokens for s in seqs), self.kv_block)
            need = min(need, cache.budget_tokens)  # every request fits (checked above)
            if cache.fit(need, self.max_batch_size):
                runner.reset()
            stop = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop.update(self.eos_token_ids)
            sampling = SamplingKey(params.temperature, params.top_k, params.top_p)
            scheduler = Scheduler(
                slots=cache.slots,
                seq_cap=cache.seq_cap,
                prefill=lambda chunk, slots: self.prefill.run(cache, chunk, slots, sampling),
                decode=lambda state, kv_len: runner.run(state, kv_len, sampling),
                move=self._move,
                stop_ids=stop,
                kv_block=self.kv_block,
                prefill_tokens=self.prefill_tokens,
                admit_min=int(self.admit_fraction * cache.slots),
            )
            captures, capture_s, device_s = runner.captures, runner.capture_s, runner.device_s
            start = time.perf_counter()
            with torch.inference_mode():
                scheduler.run(seqs)
            self.last_stats = {
                "requests": len(seqs),
                "seconds": time.perf_counter() - start,
                "prefills": scheduler.prefills,
                "prefill_s": scheduler.prefill_s,
                "decode_steps": scheduler.steps,
                "decode_s": scheduler.decode_s,  # graph captures included
                "decode_device_s": runner.device_s - device_s,  # CUDA only; captures included
                "graph_captures": runner.captures - captures,
                "capture_s": runner.capture_s - capture_s,
            }
            logger.info(
                "generate: %d requests in %.2f s: %d prefills %.2f s, %d decode steps %.2f s "
                "(%d graphs captured in %.2f s)",
                *(self.last_stats[k] for k in ("requests", "seconds", "prefills", "prefill_s")),
                *(self.last_stats[k] for k in ("decode_steps", "decode_s", "graph_captures")),
                self.last_stats["capture_s"],
            )
        for seq in seqs:
            request = seq.request
            if seq.error is not None:
                results[seq.index] = Completion.failed(
                    seq.error, prompt_length=request.prompt_length, request_id=request.request_id
                )
            else:
                results[seq.index] = Completion(
                    token_ids=seq.tokens,
                    logprobs=seq.logprobs,
                    finish_reason="stop" if seq.stopped else "length",
                    prompt_length=request.prompt_length,
                    request_id=request.request_id,
                    routed_experts=sequence_routing(seq.prompt_routing, seq.decode_routing),
                )
        return results  # type: ignore[return-value]

    def _cache_note(self, cache: KVCache) -> str:
        """How the cache was sized and who holds the device's memory, as far as this process
        can tell: the figures a capacity error needs to be acted on."""
        if self._cache_tokens:
            sized = f"cache_tokens={self._cache_tokens}"
        elif self.device.type != "cuda":
            sized = f"the fixed size of a cache on {self.device.type}; cache_tokens sets it"
        else:
            sized = f"kv_cache_fraction {self._kv_cache_fraction:g} of the memory free when taken"
            if cache.states is not None:
                sized += f", less {self.max_batch_size} slots' recurrent states"
        per_token = f"{self._bytes_per_token} bytes a token"
        if self.device.type != "cuda":
            return f"{sized}, {per_token}"
        free, total = torch.cuda.mem_get_info(self.device)
        mine = torch.cuda.memory_reserved(self.device)
        held = cache.budget_tokens * self._bytes_per_token
        others = max(total - free - mine, 0)
        return (
            f"{sized}, {per_token}; {self.device}: {_gib(total)}, {_gib(free)} free; this "
            f"engine holds {_gib(mine)} (its cache {_gib(held)}), other processes (a colocated "
            f"trainer) and CUDA contexts {_gib(others)}"
        )

    def _move(self, src: list[int], dst: list[int]) -> None:
        assert self.cache is not None
        index = torch.tensor
        self.cache.move(index(src, device=self.device), index(dst, device=self.device))

    # ---------------------------------------------------------------- weights and memory

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Copy each bucket's HF-named tensors into the live model, in place (tensors on any
        device). Captured decode graphs read the same parameters, so they see the new values."""
        total = sum(self._loader.load(bucket) for bucket in buckets)
        logger.info("HFEngine: updated %d tensors", total)

    def release_memory(self) -> None:
        """Free the KV cache and captured graphs, so a colocated trainer can use the
        accelerator, and the weights: into pinned host copies (``weights_backup``; nothing on
        a CPU), or dropped, for the next weight push to rewrite (generate refuses until it
        has)."""
        if self._legacy is not None:
            self._legacy.release_memory()
        else:
            if self.runner is not None:
                self.runner.reset()
            if self.cache is not None:
                self.cache.release()
            if not self.weights_backup:
                self._dropped.drop(self._loader)
            elif self.device.type != "cpu":
                self._host.move_module(self.model, torch.device("cpu"))
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # the copies out are done before the memory goes
                torch.cuda.empty_cache()
        self._released = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Weights back on the device (unless ``tags`` leave ``weights`` out); the cache is
        taken again at the next generate and the graphs captured as steps need them, so the
        cache tags need nothing here."""
        if tags and "weights" not in tags:
            return
        if self._legacy is not None:
            self._legacy.resume_memory()
        elif self._dropped.params:
            self._dropped.allocate(self._loader, self.device)
        elif self.device.type != "cpu":
            self._host.move_module(self.model, self.device)
        self._released = False

    def begin_weight_update(self) -> None:
        """Nothing to open: weights load in place at any time."""

    def end_weight_update(self) -> None:
        """Nothing to close."""

    def flush_cache(self) -> None:
        """No prefix cache to drop."""

    def health(self) -> bool:
        return self.model is not None

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.reset()
        if self.cache is not None:
            self.cache.release()
        self.model = None  # type: ignore[assignment]
        self._loader = None  # type: ignore[assignment]
