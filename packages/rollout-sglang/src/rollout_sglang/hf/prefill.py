"""The prompt side of the transformers engine's generate: a chunk of admitted sequences goes
through the transformers model itself (vision tower, DeepStack, M-RoPE positions: exactly the
trainer's forward), its keys/values and Qwen3.5's linear-attention states are copied into the
engine's cache slots, and each sequence's first token is sampled from the last position.

Apart from :mod:`~rollout_sglang.hf.engine` because it is the one part of a generate that runs
transformers' forward rather than our decode step, with what only it needs: right-padded
inputs with M-RoPE ids and images, one forward per distinct prompt (a GRPO group's samples
share theirs), the prompt tokens' MoE routing, and the copy from transformers' cache layout
into :class:`~rollout_sglang.hf.kv_cache.KVCache`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rollout_sglang.hf.decode import TextDecoder
from rollout_sglang.hf.kv_cache import KVCache
from rollout_sglang.hf.routing import PrefillRouting
from rollout_sglang.hf.sampling import SamplingKey, sample_logits
from rollout_sglang.hf.scheduler import SeqState
from vlm_models.packing import sample_position_ids


def _layer_kv(cache: Any, layer: int) -> tuple[Tensor, Tensor]:
    """Keys/values ``[B, kv_heads, W, head_dim]`` of one layer of a transformers cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # older transformers


class Prefill:
    """Prefills of one engine's ``model`` (whose text layers ``decoder`` steps) into the slots
    of a :class:`KVCache`, passed to each :meth:`run` (the engine makes its cache at the first
    generate). ``routing``: where the prompt tokens' MoE routing is recorded (routing replay),
    None when it is not. ``rope_memo``: M-RoPE ids of prompt heads, reset by the engine at
    each generate."""

    def __init__(
        self,
        model: nn.Module,
        decoder: TextDecoder,
        device: torch.device,
        *,
        pad_token_id: int,
        routing: PrefillRouting | None,
    ) -> None:
        self.model = model
        self.decoder = decoder
        self.device = device
        self.pad_token_id = pad_token_id
        self.routing = routing
        self.rope_memo: dict = {}  # M-RoPE ids of prompt heads, per generate call

    def inputs(self, seqs: list[SeqState]) -> dict[str, Tensor]:
        """Right-padded ids and mask (every row's position ``t`` at column ``t``, so the cache
        copy is one slice for all rows), ``[4, B, W]`` positions (text row + M-RoPE), images."""
        lengths = [s.prompt_length for s in seqs]
        batch, width = len(seqs), max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        position_ids = torch.zeros((4, batch, width), dtype=torch.long)
        position_ids[0] = torch.arange(width)  # the text row: plain, so no "packed" detection
        for b, seq in enumerate(seqs):
            request, n = seq.request, lengths[b]
            input_ids[b, :n] = request.input_ids
            attention_mask[b, :n] = 1
            mrope = sample_position_ids(
                request.input_ids, request.image_grid_thw, self.model.config, memo=self.rope_memo
            )
            position_ids[1:, b, :n] = mrope
            seq.rope_next = int(mrope.max()) + 1
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        }
        with_images = [
            s.request
            for s in seqs
            if s.request.pixel_values is not None and s.request.pixel_values.numel()
        ]
        if with_images:
            inputs["pixel_values"] = torch.cat([r.pixel_values for r in with_images])
            inputs["image_grid_thw"] = torch.cat(
                [r.image_grid_thw.reshape(-1, 3) for r in with_images]
            )
        return {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}

    @staticmethod
    def distinct(seqs: list[SeqState]) -> tuple[list[SeqState], list[int]]:
        """The distinct prompts of ``seqs`` (same ids, same images) and, per sequence, the
        index of its prompt: a GRPO group's n samples share one prompt, prefilled once."""
        distinct: list[SeqState] = []
        owner: list[int] = []
        by_ids: dict[bytes, list[int]] = {}
        for seq in seqs:
            request = seq.request
            candidates = by_ids.setdefault(request.input_ids.numpy().tobytes(), [])
            for j in candidates:
                other = distinct[j].request
                same_pixels = request.pixel_values is other.pixel_values or (
                    request.pixel_values is not None
                    and other.pixel_values is not None
                    and torch.equal(request.pixel_values, other.pixel_values)
                )
                if same_pixels:
                    owner.append(j)
                    break
            else:
                candidates.append(len(distinct))
                owner.append(len(distinct))
                distinct.append(seq)
        return distinct, owner

    def run(
        self, cache: KVCache, seqs: list[SeqState], slots: list[int], sampling: SamplingKey
    ) -> list[tuple[int, float]]:
        """Prompts through the transformers model; K/V (and linear-attention states) into
        ``slots``; the first tokens."""
        distinct, owner = self.distinct(seqs)
        if self.decoder.linear_layers:  # no padding: equal lengths per forward
            by_length: dict[int, list[int]] = {}
            for j, seq in enumerate(distinct):
                by_length.setdefault(seq.prompt_length, []).append(j)
            groups = list(by_length.values())
        else:
            groups = [list(range(len(distinct)))]
        hidden: list[Tensor | None] = [None] * len(distinct)
        for group in groups:
            members = [distinct[j] for j in group]
            inputs = self.inputs(members)
            if self.routing is None:
                out = self.model.model(**inputs, use_cache=True)
            else:
                with self.routing as routing:
                    out = self.model.model(**inputs, use_cache=True)
                lengths = [s.prompt_length for s in members]
                for s, rows in zip(
                    members, routing.rows(*inputs["input_ids"].shape, lengths), strict=True
                ):
                    s.prompt_routing = rows
            last = torch.tensor([s.prompt_length - 1 for s in members], device=self.device)
            rows = out.last_hidden_state[torch.arange(len(members), device=self.device), last]
            for r, j in enumerate(group):
                hidden[j] = rows[r]
            # the sequences whose prompt is in this group, and their rows in its output
            place = {j: r for r, j in enumerate(group)}
            mine = [(slot, place[o]) for slot, o in zip(slots, owner, strict=True) if o in place]
            slot_index = torch.tensor([m[0] for m in mine], device=self.device)
            row_index = torch.tensor([m[1] for m in mine], device=self.device)
            self._store(cache, out.past_key_values, slot_index, row_index)
        for seq, j in zip(seqs, owner, strict=True):
            seq.rope_next = distinct[j].rope_next
            seq.prompt_routing = distinct[j].prompt_routing
        owner_index = torch.tensor(owner, device=self.device)
        logits = self.model.lm_head(torch.stack(hidden)).float()[owner_index]  # type: ignore[arg-type]
        seeds = torch.tensor([s.seed for s in seqs], device=self.device)
        tokens, logprobs = sample_logits(logits, seeds, torch.zeros_like(seeds), sampling)
        return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))

    def _store(self, cache: KVCache, past: Any, slots: Tensor, rows: Tensor) -> None:
        """Rows ``rows`` of a prefill's transformers cache into cache slots ``slots``: K/V of
        the attention layers, conv and recurrent states of the gated-delta-net layers."""
        for j, layer in enumerate(self.decoder.kv_layers):
            keys, values = _layer_kv(past, layer)
            cache.write_prefill(j, slots, keys[rows], values[rows])
        states = cache.states
        for j, layer in enumerate(self.decoder.linear_layers):
            cached = past.layers[layer]
            states.write_prefill(
                j, slots, cached.conv_states[0][rows], cached.recurrent_states[0][rows]
            )
