"""SGLang's native request/response shapes, as plain data (no sglang import).

Shared by the in-process engine (``sglang.Engine.generate`` takes the same fields as keyword
arguments) and the HTTP client (``POST /generate`` takes them as JSON). Prompts go as
``input_ids`` with ONE ``<|image_pad|>`` per image plus ``image_data`` (the original images, PNG
in base64 data URLs): SGLang expands each pad itself from the grid its own image processor
computes (sglang 0.5.23 ``multimodal/processors/base_processor.py`` ``build_input_ids``: every
id followed by a pad counts as an image start, so an already expanded run of pads fails there,
IndexError for one image, AssertionError for two). Our processor's expanded ids stay what the
trainer sees; only the wire form collapses them. Each request gets its own ``sampling_params``
with its own ``sampling_seed`` (SGLang seeds a row by ``(seed, position)`` only:
``layers/sampler.py`` ``multinomial_with_seed``; one seed for a GRPO group would give n equal
samples). Log-probs come back in ``meta_info.output_token_logprobs`` as
``[logprob, token_id, text]`` triples.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from rollout_sglang.types import Completion, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from PIL import Image


def encode_image(image: Image.Image) -> str:
    """A PNG data URL, one of the image forms SGLang's loader accepts."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def sampling_params_payload(params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """Our :class:`SamplingParams` as SGLang's ``sampling_params`` dict; ``seed`` is this
    request's own seed (default ``params.seed``)."""
    payload: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,  # the ids are what matter; keep the text faithful too
        "no_stop_trim": True,  # keep the stop token at the end of the output
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    seed = params.seed if seed is None else seed
    if seed is not None:
        payload["sampling_seed"] = int(seed)
    return payload


def with_sample_seeds(
    requests: Sequence[GenerateRequest], params: SamplingParams
) -> list[GenerateRequest]:
    """Requests with a seed each: their own, else ``params.seed + position`` (none without a
    base seed). Set before a batch is split, so routing does not change what is sampled."""
    if params.seed is None:
        return list(requests)
    return [
        r if r.seed is not None else dataclasses.replace(r, seed=params.seed + i)
        for i, r in enumerate(requests)
    ]


def collapse_image_pads(input_ids: Tensor, is_pad: Tensor) -> list[int]:
    """``input_ids`` with each run of pads (``is_pad``) cut to its first: SGLang's form."""
    ids = input_ids.reshape(-1)
    is_pad = is_pad.reshape(-1).bool()
    repeat = torch.zeros_like(is_pad)
    repeat[1:] = is_pad[1:] & is_pad[:-1]
    return ids[~repeat].tolist()


def wire_input_ids(request: GenerateRequest, image_token_id: int | None) -> list[int]:
    """``input_ids`` as sent to SGLang: image pads collapsed when the request has images.
    The pads are found by ``image_token_id``, else by the request's ``mm_token_type_ids``."""
    if not request.images:
        return request.input_ids.tolist()
    if image_token_id is not None:
        return collapse_image_pads(request.input_ids, request.input_ids == image_token_id)
    mask = request.mm_token_type_ids
    if mask is None or mask.numel() != request.input_ids.numel():
        raise ValueError(
            f"request {request.request_id}: images given but neither the image token id nor "
            "mm_token_type_ids: cannot send SGLang one image pad per image"
        )
    return collapse_image_pads(request.input_ids, mask != 0)


def generate_payload(
    requests: Sequence[GenerateRequest],
    params: SamplingParams,
    image_token_id: int | None = None,
    *,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """Fields of one batched ``/generate`` call (or ``Engine.generate`` keyword arguments).

    ``image_token_id`` (``config.image_token_id``) finds the pads to collapse; without it the
    requests' ``mm_token_type_ids`` mark them. ``sampling_params`` is a list, one per request
    (``GenerateReqInput`` in sglang 0.5.23 ``managers/io_struct.py`` takes a list for a batch).
    """
    requests = with_sample_seeds(requests, params)
    payload: dict[str, Any] = {
        "input_ids": [wire_input_ids(r, image_token_id) for r in requests],
        "sampling_params": [sampling_params_payload(params, r.seed) for r in requests],
        "return_logprob": True,
    }
    if return_routed_experts:  # the server must run with --enable-return-routed-experts
        payload["return_routed_experts"] = True
    if any(r.images for r in requests):
        payload["image_data"] = [[encode_image(im) for im in r.images] for r in requests]
    rids = [r.request_id for r in requests]
    if all(rid is not None for rid in rids) and len(set(rids)) == len(rids):
        payload["rid"] = rids
    return payload


def parse_output(
    output: dict[str, Any],
    request: GenerateRequest,
    *,
    routing_shape: tuple[int, int] | None = None,
) -> Completion:
    """One SGLang output dict -> :class:`Completion`. Malformed output becomes an error
    completion naming what was missing, never an exception. ``routing_shape`` (layers, k):
    decode ``meta_info.routed_experts`` too."""
    prompt_length, rid = request.prompt_length, request.request_id
    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        return Completion.failed(
            f"malformed SGLang output (no meta_info): {_short(output)}",
            prompt_length=prompt_length,
            request_id=rid,
        )
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    triples = meta.get("output_token_logprobs")
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        return Completion(
            token_ids=[int(t[1]) for t in triples or []],
            logprobs=[float(t[0]) for t in triples or []],
            finish_reason="abort",
            prompt_length=prompt_length,
            error=f"aborted by SGLang: {message or 'no reason given'}",
            request_id=rid,
        )
    if triples is None:
        return Completion.failed(
            "malformed SGLang output: no output_token_logprobs (was return_logprob set?)",
            prompt_length=prompt_length,
            request_id=rid,
        )
    token_ids = [int(t[1]) for t in triples]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids[-len(output_ids) :]:
        return Completion.failed(
            f"SGLang output_ids {output_ids[:8]}... disagree with output_token_logprobs ids "
            f"{token_ids[:8]}...",
            prompt_length=prompt_length,
            request_id=rid,
        )
    if kind not in ("stop", "length"):
        return Completion.failed(
            f"unknown SGLang finish_reason {finish!r}", prompt_length=prompt_length, request_id=rid
        )
    routed = None
    if routing_shape is not None:
        rows = prompt_length + len(token_ids) - 1
        routed, problem = routed_experts(meta.get("routed_experts"), rows, routing_shape)
        if problem:
            return Completion.failed(problem, prompt_length=prompt_length, request_id=rid)
    return Completion(
        token_ids=token_ids,
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        prompt_length=prompt_length,
        request_id=rid,
        routed_experts=routed,
    )


def routed_experts(
    encoded: Any, rows: int, shape: tuple[int, int]
) -> tuple[torch.Tensor | None, str | None]:
    """``meta_info.routed_experts`` -> ``[rows, layers, k]`` int32, or a problem. sglang 0.5.23
    sends base64 of the int32 ids of tokens ``[0, seqlen - 1)`` by layer and top-k
    (``managers/detokenizer_manager.py`` ``_b64_encode_per_request``,
    ``state_capturer/routed_experts.py``)."""
    if not isinstance(encoded, str):
        return None, (
            "malformed SGLang output: no meta_info.routed_experts (was the server started "
            "with --enable-return-routed-experts?)"
        )
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    layers, k = shape
    if flat.size != rows * layers * k:
        return None, (
            f"SGLang routed_experts has {flat.size} ids, expected {rows} tokens x {layers} "
            f"layers x {k} experts"
        )
    return torch.from_numpy(flat.reshape(rows, layers, k).copy()), None


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
