"""What a rollout must move and compute, for ``bench_hf_engine.py``'s roofline.

A speed-up over ``model.generate`` says little on its own (the baseline is host-bound and moves
from day to day), so the bench also reports how far each decode step is from the memory
bandwidth it needs and how far the prefill is from the chip's peak FLOPs. The byte and FLOP
counts here come from the model config alone (no model needed), following `vlm_models.flops`'
conventions; norms, biases and rotary tables (well under 0.1% of the bytes) are left out. The
limits they are held to (the bandwidth measured in the run, the peak) and the fractions
(``harness.roofline``) are in ``harness.py``; :func:`format_table` prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from transformers import PretrainedConfig

from vlm_models.flops import lm_matmul_params, vision_flops


def _text(config: PretrainedConfig) -> PretrainedConfig:
    return getattr(config, "text_config", config)


def _layer_kinds(tc: PretrainedConfig) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers) of a text config."""
    kinds = list(getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers)
    linear = kinds.count("linear_attention")
    return len(kinds) - linear, linear


def _head_dim(tc: PretrainedConfig) -> int:
    return getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of one layer that ``tokens`` tokens, each routed to ``top_k`` of
    ``num_experts`` uniformly, are expected to hit: ``E (1 - (1 - k/E)^B)``. Only those experts'
    weights must be read by a decode step (random weights route close to uniformly; a trained
    router's skew hits fewer, so this is an upper bound on what real routing needs)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_weight_params(config: PretrainedConfig, batch: int) -> float:
    """Weights one decode step of ``batch`` rows reads once: every matmul weight of the
    language model (``lm_head`` whole, tied or not), the embedding rows of its tokens, and of
    each MoE layer only the experts the batch's routing is expected to hit."""
    tc = _text(config)
    active = lm_matmul_params(config, active=True)  # top-k experts per MoE layer
    experts, top_k = getattr(tc, "num_experts", 0) or 0, getattr(tc, "num_experts_per_tok", 0)
    weights = float(active)
    if experts > top_k > 0:
        # the two counts differ by (E - k) experts in every MoE layer: one expert in every MoE
        # layer is their difference over (E - k)
        per_expert = (lm_matmul_params(config, active=False) - active) / (experts - top_k)
        weights += (expected_experts(experts, top_k, batch) - top_k) * per_expert
    return weights + batch * tc.hidden_size


def decode_cache_bytes(
    config: PretrainedConfig,
    batch: int,
    live_tokens: float,
    kv_bytes: int,
    state_bytes: int = 4,
) -> dict[str, float]:
    """Cache bytes one decode step moves: ``kv`` — per full-attention layer the keys and values
    of every live position (``live_tokens``: the rows' lengths summed, the new token included:
    its write stands in for its read), ``2 * kv_heads * head_dim * kv_bytes * live_tokens``;
    ``states`` — per linear-attention (gated-delta-net) layer and row, the recurrent state
    (``v_heads * k_dim * v_dim`` at ``state_bytes``, float32 as the engine keeps it) and the
    conv window (``conv_dim * (kernel - 1)`` at ``kv_bytes``), each read and written."""
    tc = _text(config)
    full, linear = _layer_kinds(tc)
    kv = full * 2 * tc.num_key_value_heads * _head_dim(tc) * kv_bytes * live_tokens
    states = 0.0
    if linear:
        key_dim = tc.linear_num_key_heads * tc.linear_key_head_dim
        value_dim = tc.linear_num_value_heads * tc.linear_value_head_dim
        recurrent = tc.linear_num_value_heads * tc.linear_key_head_dim * tc.linear_value_head_dim
        conv = (2 * key_dim + value_dim) * (tc.linear_conv_kernel_dim - 1)
        states = linear * batch * 2 * (recurrent * state_bytes + conv * kv_bytes)
    return {"kv": float(kv), "states": float(states)}


def decode_step_bytes(
    config: PretrainedConfig, batch: int, live_tokens: float, dtype_bytes: int
) -> dict[str, float]:
    """Bytes one decode step must move, split: ``weights``, ``kv``, ``states``, ``total``."""
    out = {"weights": decode_weight_params(config, batch) * dtype_bytes}
    out.update(decode_cache_bytes(config, batch, live_tokens, dtype_bytes))
    out["total"] = out["weights"] + out["kv"] + out["states"]
    return out


def mean_live_tokens(prompt_lengths: Sequence[int], new_tokens: int) -> float:
    """Live positions summed over the rows, averaged over the decode steps of a run where every
    row makes ``new_tokens`` tokens: the first comes from the prefill, decode step ``j`` (1 to
    N-1) attends ``P + j`` positions, so a row's mean is ``P + N/2``."""
    return float(sum(prompt_lengths)) + len(prompt_lengths) * new_tokens / 2


def prefill_flops(
    config: PretrainedConfig,
    prompt_lengths: Iterable[int],
    image_grids: Iterable[Iterable[int]] = (),
) -> float:
    """FLOPs of prefilling the prompts as the engine does: ``2 * active params`` per prompt
    token except ``lm_head``, which runs on each prompt's last position only; causal attention
    (``4 * heads * head_dim`` per query and key, ``P (P + 1) / 2`` pairs); the gated-delta-net
    update and readout per token; and the vision tower over the images (no backward)."""
    tc = _text(config)
    full, linear = _layer_kinds(tc)
    head = tc.hidden_size * tc.vocab_size
    body = lm_matmul_params(config, active=True) - head
    recurrent = (
        tc.linear_num_value_heads * tc.linear_key_head_dim * tc.linear_value_head_dim
        if linear
        else 0
    )
    total = 0.0
    for p in prompt_lengths:
        total += 2 * body * p + 2 * head
        total += full * 4 * tc.num_attention_heads * _head_dim(tc) * p * (p + 1) / 2
        total += linear * 4 * recurrent * p
    grids = [list(g) for g in image_grids]
    if grids and hasattr(config, "vision_config"):
        total += vision_flops(config, grids, training=False)
    return total


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The roofline columns, one line per (batch, side): ``rows`` hold ``batch``, ``side``,
    ``step_ms`` (wall), ``device_ms`` (None where unknown), ``time`` (which of the two the
    bandwidth figures use) and a ``harness.roofline`` dict under ``roof``."""
    head = (
        f"{'batch':>5} {'side':<20} {'ms/step':>8} {'dev ms':>7} {'GB/step':>8} "
        f"{'GB/s':>8} {'%BW':>6} {'time':>6} {'pf TFLOP/s':>10} {'MFU':>6}"
    )
    lines = [head]
    for r in rows:
        roof = r["roof"]
        bw = None if roof["bw_frac"] is None else 100 * roof["bw_frac"]
        mfu = None if roof["mfu"] is None else 100 * roof["mfu"]
        lines.append(
            f"{r['batch']:>5} {r['side']:<20} {_cell(r['step_ms'], '.2f'):>8} "
            f"{_cell(r['device_ms'], '.2f'):>7} {roof['step_gb']:>8.4g} "
            f"{_cell(roof['gb_s'], '.4g'):>8} {_cell(bw, '.1f'):>6} {r['time']:>6} "
            f"{_cell(roof['prefill_tflops'], '.3g'):>10} {_cell(mfu, '.1f'):>6}"
        )
    return "\n".join(lines)
