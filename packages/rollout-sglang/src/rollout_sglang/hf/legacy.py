"""The transformers decode loop for models the graph decode does not cover (Qwen3.5, MoE).

:class:`~rollout_sglang.hf.engine.HFEngine` delegates here when
:func:`rollout_sglang.hf.decode.supports` says no. Our own loop over the model's forward rather than ``model.generate``: left-padded batches with per-sample 3-D
M-RoPE positions computed once at prefill (the model's global ``rope_deltas`` state is never
used, so rows can be dropped mid-generation), a KV cache, per-request stop, finished rows pruned
from the batch and the cache, and the log-prob of each sampled token returned alongside it.

Per decode step the loop does what ``model.generate`` does and less: no host sync (the count of
finished rows is copied asynchronously and read one step late on accelerators), no attention
mask rebuilt from a growing 2-D mask (unpadded batches pass none; padded ones a view of one
preallocated buffer), positions built once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rollout_sglang.hf.sampling import sample_tokens
from rollout_sglang.hf.weights import WeightLoader
from rollout_sglang.types import Completion, GenerateRequest, NamedTensors, SamplingParams
from rollout_sglang.validation import RequestLimits, request_error
from vlm_models.packing import packed_position_ids

logger = logging.getLogger(__name__)


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    for cfg in (getattr(model, "generation_config", None), model.config.get_text_config()):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
    return ()


class _LaggedCount:
    """A device-side count read by the host one step late on accelerators (exactly on CPU).

    Reading ``int(tensor)`` every decode step blocks the host until the device has finished the
    step, so the next step's kernels cannot be queued meanwhile. Here the count is copied
    asynchronously into pinned memory and read at the next call, when it is long done.
    """

    def __init__(self, device: torch.device, lagged: bool | None = None) -> None:
        self.on_accelerator = device.type != "cpu"
        self.lagged = self.on_accelerator if lagged is None else lagged
        self._pending: tuple[Tensor, Any] | None = None

    def exchange(self, count: Tensor) -> int:
        """Queue ``count`` (a 0-d tensor); return the previous one's value (0 if none)."""
        if not self.lagged:
            return int(count)
        event = None
        if self.on_accelerator:
            host = torch.empty((), dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            cuda = count.device.type == "cuda"
            event = torch.cuda.Event() if cuda else torch.Event(device=count.device)
            event.record()
        else:  # lagged on CPU: only to exercise this path in tests
            host = count.clone()
        previous, self._pending = self._pending, (host, event)
        if previous is None:
            return 0
        if previous[1] is not None:
            previous[1].synchronize()
        return int(previous[0])

    def reset(self) -> None:
        """Forget the queued count (the rows it counted changed)."""
        self._pending = None


class _DecodeMasks:
    """The attention mask of each decode step, without rebuilding it from a growing 2-D mask.

    Unpadded batches pass no mask (SDPA's fast path: no mask, grouped-query attention without
    repeating the KV heads, and no host sync inside transformers' "is the mask all ones?"
    check). Padded batches under SDPA pass a ready 4-D boolean view ``[B, 1, 1, kv]`` of one
    preallocated buffer, which transformers uses as is; other attention implementations get the
    2-D view of the same buffer.
    """

    def __init__(self, prompt_mask: Tensor, max_steps: int, attn_implementation: str | None):
        batch, width = prompt_mask.shape
        self.padded = not bool(prompt_mask.all())
        self.four_d = attn_implementation == "sdpa"
        self.buffer = None
        if self.padded:
            self.buffer = torch.ones(
                (batch, width + max_steps), dtype=torch.bool, device=prompt_mask.device
            )
            self.buffer[:, :width] = prompt_mask.bool()

    def select(self, keep: Tensor) -> None:
        """Keep only these rows (after finished rows were pruned)."""
        if self.buffer is not None:
            self.buffer = self.buffer[keep]

    def step(self, kv_length: int) -> Tensor | None:
        """The mask for a step whose keys (cache plus the new token) number ``kv_length``."""
        if self.buffer is None:
            return None
        if self.four_d:
            return self.buffer[:, None, None, :kv_length]
        return self.buffer[:, :kv_length]


class LegacyHFEngine:
    """:class:`~rollout_sglang.types.RolloutEngine` over a ``*ForConditionalGeneration`` model.

    Args:
        model: a Qwen3-VL (or Qwen3.5) transformers model, already on ``device``.
        device: where generation runs (default: the model's device).
        eos_token_ids: ids that end a response (default: the model's generation config).
        max_batch_size: requests per forward batch; larger calls are split.
        max_prompt_length: longer prompts fail with an error (default: the model's context
            minus one); ``max_new_tokens`` is clipped so prompt + response fit the context.
        prune_fraction: drop finished rows from the batch (and the KV cache) once at least this
            fraction of the running rows has finished; 1.0 never prunes early.
    """

    name = "hf"

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 64,
        max_prompt_length: int | None = None,
        pad_token_id: int = 0,
        prune_fraction: float = 0.25,
    ) -> None:
        self.model = model.eval()
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(model)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.prune_fraction = prune_fraction
        config = model.config
        self.context_length = int(config.get_text_config().max_position_embeddings)
        self.limits = RequestLimits(
            image_token_id=config.image_token_id,
            merge_size=config.vision_config.spatial_merge_size,
            max_prompt_length=max_prompt_length or self.context_length - 1,
            needs_pixels=True,
        )
        self._attn_implementation = getattr(
            config.get_text_config(), "_attn_implementation", None
        ) or getattr(config, "_attn_implementation", None)
        # read the finished count one step late (no host sync per step); on by default off CPU
        self.lag_finished_count = self.device.type != "cpu"
        self._loader = WeightLoader(model)
        self._released = False

    # ---------------------------------------------------------------- generation

    def generate(
        self, requests: Sequence[GenerateRequest], params: SamplingParams
    ) -> list[Completion]:
        """One :class:`Completion` per request, in order. Requests are batched by prompt length;
        a bad request gets its own error and never fails the others."""
        if self._released:
            raise RuntimeError(
                "LegacyHFEngine.generate after release_memory(); call resume_memory()"
            )
        results: list[Completion | None] = [None] * len(requests)
        valid = []
        for i, request in enumerate(requests):
            error = request_error(request, self.limits, i)
            if error is None:
                valid.append(i)
            else:
                logger.warning("skipping %s", error)
                results[i] = Completion.failed(
                    error, prompt_length=request.prompt_length, request_id=request.request_id
                )
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        order = sorted(valid, key=lambda i: requests[i].prompt_length)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            for i, completion in zip(
                chunk, self._generate_isolated(requests, chunk, params, generator), strict=True
            ):
                results[i] = completion
        return results  # type: ignore[return-value]

    def _generate_isolated(
        self,
        requests: Sequence[GenerateRequest],
        chunk: list[int],
        params: SamplingParams,
        generator: torch.Generator,
    ) -> list[Completion]:
        """Generate a batch; if it fails, retry its requests one by one so only the culprit fails."""
        try:
            return self._generate_batch([requests[i] for i in chunk], params, generator)
        except Exception as exc:
            if len(chunk) == 1:
                request = requests[chunk[0]]
                message = f"request {chunk[0]}: generation failed: {type(exc).__name__}: {exc}"
                logger.warning(message)
                return [
                    Completion.failed(
                        message, prompt_length=request.prompt_length, request_id=request.request_id
                    )
                ]
            logger.warning("batch of %d failed (%s); retrying one by one", len(chunk), exc)
            return [
                c for i in chunk for c in self._generate_isolated(requests, [i], params, generator)
            ]

    def _prefill_inputs(self, requests: list[GenerateRequest]) -> dict[str, Tensor]:
        """Left-padded ids and mask, ``[4, B, L]`` positions (text row + M-RoPE), images."""
        lengths = [r.prompt_length for r in requests]
        batch, width = len(requests), max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        position_ids = torch.zeros((4, batch, width), dtype=torch.long)
        for b, request in enumerate(requests):
            n = lengths[b]
            input_ids[b, width - n :] = request.input_ids
            attention_mask[b, width - n :] = 1
            position_ids[0, b, width - n :] = torch.arange(n)
            position_ids[1:, b, width - n :] = packed_position_ids(
                [request.input_ids], [request.image_grid_thw], self.model.config
            )
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        with_images = [r for r in requests if r.pixel_values is not None and r.pixel_values.numel()]
        if with_images:
            inputs["pixel_values"] = torch.cat([r.pixel_values for r in with_images])
            inputs["image_grid_thw"] = torch.cat(
                [r.image_grid_thw.reshape(-1, 3) for r in with_images]
            )
        return {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}

    @torch.inference_mode()
    def _generate_batch(
        self, requests: list[GenerateRequest], params: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        device = self.device
        batch = len(requests)
        inputs = self._prefill_inputs(requests)
        prompt_lengths = [r.prompt_length for r in requests]
        lengths = torch.tensor(prompt_lengths, device=device)
        limits = (self.context_length - lengths).clamp(max=params.max_new_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        width = max(prompt_lengths)
        max_steps = min(params.max_new_tokens, self.context_length - min(prompt_lengths))

        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        # Decode positions: the 3 M-RoPE rows, one past the prompt's largest position (its "rope
        # delta") + step. Built once; each step adds the step.
        mrope_next = inputs["position_ids"][1:].amax(dim=(0, 2)) + 1
        positions = mrope_next.expand(3, -1)[:, :, None]
        masks = _DecodeMasks(inputs["attention_mask"], max_steps, self._attn_implementation)
        del out, inputs

        tokens = torch.zeros((batch, max_steps), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, max_steps), dtype=torch.float32, device=device)
        n_generated = torch.zeros(batch, dtype=torch.long, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        rows = torch.arange(batch, device=device)  # original index of each row still in the batch
        n_rows = batch
        finished_count = _LaggedCount(device, lagged=self.lag_finished_count)
        for step in range(max_steps):
            token, logprob = sample_tokens(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                generator=generator,
            )
            # Rows that finished but are not pruned yet keep decoding; only live rows record.
            live = ~finished[rows]
            tokens[rows, step] = token
            logprobs[rows, step] = logprob
            n_generated[rows] += live
            done = finished[rows] | (live & torch.isin(token, stop))
            stopped[rows] |= done & live
            finished[rows] = done | (step + 1 >= limits[rows])
            if step + 1 == max_steps:
                break
            # Exact on CPU; on an accelerator the previous step's count, so the host queues the
            # next forward without waiting for this one (a finished row costs one extra step).
            n_finished = finished_count.exchange(finished[rows].sum())
            if n_finished == n_rows:
                break
            if n_finished >= max(1.0, self.prune_fraction * n_rows):
                keep = (~finished[rows]).nonzero().squeeze(-1)  # a host sync, once per prune
                if keep.numel() == 0:
                    break
                cache.reorder_cache(keep)
                rows, token, positions = rows[keep], token[keep], positions[:, keep]
                masks.select(keep)
                n_rows = keep.numel()
                finished_count.reset()
            out = self.model(
                input_ids=token[:, None],
                attention_mask=masks.step(width + step + 1),
                # The 3 M-RoPE rows alone: the text row only serves packed-mask detection, which
                # a cached decode skips, and with it transformers 5.17 took a path 2.6x slower
                # per step on the H200 (55.7 vs 21.5 ms at batch 64, Qwen3-VL-2B shape).
                position_ids=positions + step,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        return self._completions(requests, tokens, logprobs, n_generated, stopped)

    @staticmethod
    def _completions(
        requests: list[GenerateRequest],
        tokens: Tensor,
        logprobs: Tensor,
        n_generated: Tensor,
        stopped: Tensor,
    ) -> list[Completion]:
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        n_generated, stopped = n_generated.tolist(), stopped.tolist()
        return [
            Completion(
                token_ids=tokens[b][: n_generated[b]],
                logprobs=logprobs[b][: n_generated[b]],
                finish_reason="stop" if stopped[b] else "length",
                prompt_length=request.prompt_length,
                request_id=request.request_id,
            )
            for b, request in enumerate(requests)
        ]

    # ---------------------------------------------------------------- weights and memory

    def update_weights(self, buckets: Iterable[NamedTensors]) -> None:
        """Copy each bucket's HF-named tensors into the live model, in place."""
        total = sum(self._loader.load(bucket) for bucket in buckets)
        logger.info("HFEngine: updated %d tensors", total)

    def release_memory(self) -> None:
        """Move the model to CPU so the trainer can use the accelerator (no-op on CPU)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._released = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        if tags and "weights" not in tags:
            return  # no cache of its own to take back
        if self.device.type != "cpu":
            self.model.to(self.device)
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
        self.model = None  # type: ignore[assignment]
        self._loader = None  # type: ignore[assignment]
