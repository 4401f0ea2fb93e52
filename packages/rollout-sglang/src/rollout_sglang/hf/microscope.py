"""Where the engine's log-probs part from the model's forward: the engine side of the
log-prob microscope (``tools/logprob_microscope.py`` adds the trainers and the report).

Why: the GRPO loop's alarm (``rl_runtime.logprob_guard``) sees one number per step, the mean
gap between the engine's and the trainer's log-probs. When it is too large, the question is
which path parts and where. Given one batch of prompts and their sampled responses, this runs
the two paths inside the engine over the same weights, with the kernels the engine uses on
this machine:

* :func:`forward_trace`: transformers' forward over prompt + response, one sample at a time
  (what the engine's prefill computes, and, token for token, what a trainer's forward should);
* :func:`decode_trace`: the engine's own prefill of the prompts, then its decode step
  teacher-forced through the response token by token, reading its KV cache and, for Qwen3.5,
  its per-slot conv and recurrent states (eager: a CUDA graph replays the same kernels).

Each returns a :class:`Trace` per sample: the response tokens' log-probs, every layer's output
hidden states at the decode positions, and inside each gated-delta-net layer the conv output,
the recurrence's output, the gate ``z`` and the gated norm's output. :func:`compare` turns two
traces into per-position log-prob gaps and per-layer relative differences, and names the first
place they part.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rollout_sglang.hf.sampling import SamplingKey
from rollout_sglang.hf.scheduler import SeqState, round_up
from rollout_sglang.types import GenerateRequest

GDN_PARTS = ("conv", "recurrent", "gate", "gated")


@dataclass
class Trace:
    """One sample's path. ``logprobs`` ``[L]``: its L response tokens' log-probs (float32).
    ``hidden``: per layer ``[L - 1, hidden]``, the layer's output at the positions that feed
    response tokens 1..L-1 (the decode steps' positions). ``gdn``: per gated-delta-net layer,
    ``conv`` / ``recurrent`` / ``gate`` / ``gated`` ``[L - 1, width]`` at the same positions.
    Everything float32 on the CPU."""

    logprobs: Tensor
    hidden: list[Tensor] = field(default_factory=list)
    gdn: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    experts: dict[int, Tensor] = field(default_factory=dict)  # MoE layer -> ids [L - 1, k]


def _token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    return logits.float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def _text_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.language_model.layers)


def _transformers_module(layer: nn.Module) -> Any:
    """The transformers modeling module whose globals a gated-delta-net forward calls."""
    cls = next(c for c in type(layer).__mro__ if c.__module__.startswith("transformers."))
    return sys.modules[cls.__module__]


@contextlib.contextmanager
def _forward_probes(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Record each layer's output and each gated-delta-net layer's intermediates during one
    forward of ``model``: hooks on the layers and on the gated norm, and the modeling module's
    conv and delta-rule functions wrapped for the duration (whichever kernel they resolved to:
    fla's and the causal-conv1d package's on a GPU that has them, the torch reference else)."""
    record: dict[str, Any] = {"hidden": [], "gdn": {}, "experts": {}}
    layers = _text_layers(model)
    handles = []
    current: list[int] = [-1]
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_hook(
                lambda _m, _a, out: record["hidden"].append(
                    out[0] if isinstance(out, tuple) else out
                )
            )
        )
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        if router is not None and hasattr(router, "top_k"):  # returns (logits, weights, ids)

            def router_hook(_m: nn.Module, _a: tuple, out: Any, i: int = i) -> None:
                record["experts"][i] = out[-1]

            handles.append(router.register_forward_hook(router_hook))
        attn = getattr(layer, "linear_attn", None)
        if attn is None:
            continue
        handles.append(
            attn.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        )

        def norm_hook(_m: nn.Module, args: tuple, out: Tensor, i: int = i) -> None:
            parts = record["gdn"].setdefault(i, {})
            parts["recurrent"], parts["gate"], parts["gated"] = args[0], args[1], out

        handles.append(attn.norm.register_forward_hook(norm_hook))
    patched: list[tuple[Any, str, Any]] = []
    gdn_layers = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
    if gdn_layers:
        module = _transformers_module(gdn_layers[0])
        conv_fn = module.causal_conv1d_fn

        def conv_probe(*args: Any, **kwargs: Any) -> Tensor:
            out = conv_fn(*args, **kwargs)
            record["gdn"].setdefault(current[0], {})["conv"] = out  # [B, conv_dim, T']
            return out

        patched.append((module, "causal_conv1d_fn", conv_fn))
        module.causal_conv1d_fn = conv_probe
    try:
        yield record
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        for h in handles:
            h.remove()


def _prefill_inputs(engine: Any, request: GenerateRequest) -> dict[str, Tensor]:
    """The engine's prefill inputs for one request (ids, mask, text + M-RoPE positions,
    images) on its device."""
    seq = SeqState(index=0, request=request, seed=0, limit=1)
    return engine.prefill.inputs([seq])


def forward_trace(engine: Any, request: GenerateRequest, response: Sequence[int]) -> Trace:
    """transformers' forward over the prompt and ``response`` (one sample, no padding), the
    inputs built as the engine's prefill builds them."""
    model = engine.model
    prompt = request.input_ids
    full = torch.cat([prompt, torch.as_tensor(list(response), dtype=prompt.dtype)])
    extended = GenerateRequest(
        input_ids=full,
        pixel_values=request.pixel_values,
        image_grid_thw=request.image_grid_thw,
        mm_token_type_ids=None
        if request.mm_token_type_ids is None
        else torch.cat([request.mm_token_type_ids, torch.zeros(len(response), dtype=torch.long)]),
    )
    inputs = _prefill_inputs(engine, extended)
    p, n = len(prompt), len(response)
    with torch.inference_mode(), _forward_probes(model) as record:
        hidden = model.model(**inputs, use_cache=False).last_hidden_state[0]
        logits = model.lm_head(hidden[p - 1 : p + n - 1])
    tokens = torch.as_tensor(list(response), device=logits.device)
    trace = Trace(logprobs=_token_logprobs(logits, tokens).cpu())
    window = slice(p, p + n - 1)  # the positions that feed response tokens 1..n-1
    trace.hidden = [h[0, window].float().cpu() for h in record["hidden"]]
    for i, parts in record["gdn"].items():
        out: dict[str, Tensor] = {}
        for name, t in parts.items():
            if name == "conv":  # [1, conv_dim, T]
                out[name] = t[0, :, window].T.float().cpu()
            else:  # [T * heads, dim] rows in (token, head) order
                out[name] = t.reshape(p + n, -1)[window].float().cpu()
        trace.gdn[i] = out
    trace.experts = {
        i: ids.reshape(p + n, -1)[window].cpu() for i, ids in record["experts"].items()
    }
    return trace


def decode_trace(
    engine: Any,
    requests: Sequence[GenerateRequest],
    responses: Sequence[Sequence[int]],
    *,
    replay: Sequence[Trace] | None = None,
) -> list[Trace]:
    """The engine's prefill of ``requests`` and its decode step teacher-forced through
    ``responses`` (eager, whatever attention / MoE path the engine's decoder is set to), all
    samples in one batch of slots. ``replay``: traces (of the forward) whose MoE routing the
    decode steps take instead of their own: what the gap is without routing flips."""
    if engine._legacy is not None:
        raise ValueError("the microscope needs the engine's decode step (not the legacy loop)")
    decoder = engine.decoder
    cache, runner = engine._ensure_cache()
    cache.allocate()
    lengths = [len(r) for r in responses]
    seqs = [
        SeqState(index=i, request=r, seed=0, limit=max(n, 1))
        for i, (r, n) in enumerate(zip(requests, lengths, strict=True))
    ]
    need = round_up(max(s.cache_tokens for s in seqs) + 1, engine.kv_block)
    if cache.fit(need, engine.max_batch_size):
        runner.reset()
    if len(seqs) > cache.slots:
        raise ValueError(f"{len(seqs)} samples, the cache holds {cache.slots} slots of {need}")
    first: list[Tensor] = []
    hook = engine.model.lm_head.register_forward_hook(lambda _m, _a, out: first.append(out))
    try:
        with torch.inference_mode():
            engine.prefill.run(cache, seqs, list(range(len(seqs))), SamplingKey(1.0, -1, 1.0))
    finally:
        hook.remove()
    _, owner = engine.prefill.distinct(seqs)
    device = engine.device
    first_logits = first[-1].float()[torch.tensor(owner, device=device)]
    longest = max(lengths)
    padded = torch.zeros((len(seqs), longest), dtype=torch.long)
    for b, r in enumerate(responses):
        padded[b, : len(r)] = torch.as_tensor(list(r))
    padded = padded.to(device)
    traces = [
        Trace(logprobs=_token_logprobs(first_logits[b : b + 1], padded[b, :1]).cpu())
        for b in range(len(seqs))
    ]
    rope = torch.tensor([s.rope_next for s in seqs], device=device)
    prompt = torch.tensor([s.prompt_length for s in seqs], device=device)
    steps: list[dict[str, Any]] = []
    step_logprobs: list[Tensor] = []
    try:
        with torch.inference_mode():
            for j in range(longest - 1):
                decoder.trace = {"moe": _replayed(replay, j, device)} if replay else {}
                cache_index = prompt + j
                logits = decoder.logits(
                    cache,
                    tokens=padded[:, j],
                    positions=rope + j,
                    lengths=cache_index,
                    kv_len=round_up(int(cache_index.max()) + 1, engine.kv_block),
                )
                step_logprobs.append(_token_logprobs(logits, padded[:, j + 1]).cpu())
                steps.append(decoder.trace)
    finally:
        decoder.trace = None
    for b, trace in enumerate(traces):
        n = lengths[b] - 1
        if n <= 0:
            continue
        trace.logprobs = torch.cat([trace.logprobs, torch.stack(step_logprobs[:n])[:, b]])
        layers = len(steps[0]["hidden"])
        trace.hidden = [
            torch.stack([steps[j]["hidden"][i][b] for j in range(n)]).float().cpu()
            for i in range(layers)
        ]
        for i in steps[0]["gdn"]:
            trace.gdn[i] = {
                name: torch.stack([steps[j]["gdn"][i][name][b].reshape(-1) for j in range(n)])
                .float()
                .cpu()
                for name in GDN_PARTS
            }
        for i in steps[0]["moe"]:
            trace.experts[i] = torch.stack(
                [steps[j]["moe"][i]["experts"][b] for j in range(n)]
            ).cpu()
    return traces


def _replayed(replay: Sequence[Trace], step: int, device: torch.device) -> dict[int, Any]:
    """Step ``step``'s expert ids of every sample per MoE layer, ``{layer: {"replay": ids}}``
    (a sample already past its response repeats its last step's)."""
    layers = replay[0].experts
    out: dict[int, Any] = {}
    for i in layers:
        rows = [t.experts[i][min(step, len(t.experts[i]) - 1)] for t in replay]
        out[i] = {"replay": torch.stack(rows).to(device)}
    return out


def relative(a: Tensor, b: Tensor) -> float:
    """``rms(a - b) / rms(b)`` over all elements (0 when both vanish)."""
    scale = b.float().pow(2).mean().sqrt().item()
    diff = (a.float() - b.float()).pow(2).mean().sqrt().item()
    return diff / scale if scale > 0 else diff


def compare(ours: Sequence[Trace], reference: Sequence[Trace], *, part_at: float) -> dict[str, Any]:
    """The gaps between two paths over the same samples: the mean |log-prob gap| overall and
    per response position (first 8 positions, then the rest in four bands), the relative
    difference of each layer's output and each gated-delta-net intermediate (over all
    samples and decode positions), the share of tokens an MoE layer routes to another expert
    set (``rerouted``: a flip moves a token's output by a whole expert's share), and
    ``parts_at``: the first (layer, what) whose relative
    difference passes ``part_at`` (layers in order, a gated-delta-net layer's intermediates
    before its output), or None."""
    gaps = [(a.logprobs - b.logprobs).abs() for a, b in zip(ours, reference, strict=True)]
    flat = torch.cat(gaps)
    longest = max(len(g) for g in gaps)
    by_pos: dict[str, float] = {}
    edges = list(range(min(8, longest))) + [8 + k * max((longest - 8) // 4, 1) for k in range(4)]
    edges = [*sorted(set(e for e in edges if e < longest)), longest]
    for lo, hi in itertools.pairwise(edges):
        vals = [g[lo:hi] for g in gaps if len(g) > lo]
        if vals:
            key = str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
            by_pos[key] = torch.cat(vals).mean().item()
    with_steps = [(a, b) for a, b in zip(ours, reference, strict=True) if a.hidden and b.hidden]
    layers: list[dict[str, Any]] = []
    parts_at = None
    if with_steps:
        for i in range(len(with_steps[0][0].hidden)):
            row: dict[str, Any] = {"layer": i}
            for name in GDN_PARTS:
                if all(i in a.gdn and name in b.gdn.get(i, {}) for a, b in with_steps):
                    a_cat = torch.cat([a.gdn[i][name] for a, _ in with_steps])
                    b_cat = torch.cat([b.gdn[i][name] for _, b in with_steps])
                    row[name] = relative(a_cat, b_cat)
            if all(i in a.experts and i in b.experts for a, b in with_steps):
                a_ids = torch.cat([a.experts[i] for a, _ in with_steps]).sort(-1).values
                b_ids = torch.cat([b.experts[i] for _, b in with_steps]).sort(-1).values
                # the share of tokens whose chosen expert set differs (a routing flip)
                row["rerouted"] = (a_ids != b_ids).any(-1).float().mean().item()
            row["hidden"] = relative(
                torch.cat([a.hidden[i] for a, _ in with_steps]),
                torch.cat([b.hidden[i] for _, b in with_steps]),
            )
            layers.append(row)
            if parts_at is None:
                for name in (*GDN_PARTS, "hidden"):
                    if row.get(name, 0.0) > part_at:
                        parts_at = {"layer": i, "what": name, "relative": row[name]}
                        break
    return {
        "mean_gap": flat.mean().item(),
        "max_gap": flat.max().item(),
        "tokens": flat.numel(),
        "gap_by_position": by_pos,
        "layers": layers,
        "parts_at": parts_at,
    }
