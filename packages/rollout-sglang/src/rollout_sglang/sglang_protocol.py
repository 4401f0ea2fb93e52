"""SGLang's native request/response shapes, as plain data (no sglang import).

Shared by the in-process engine (``sglang.Engine.generate`` takes the same fields as keyword
arguments) and the HTTP client (``POST /generate`` takes them as JSON). Prompts go as
``input_ids`` (image placeholders already expanded by our processor) plus ``image_data`` (the
original images, PNG in base64 data URLs); log-probs come back in
``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout_sglang.types import Completion, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from PIL import Image


def encode_image(image: Image.Image) -> str:
    """A PNG data URL, one of the image forms SGLang's loader accepts."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def sampling_params_payload(params: SamplingParams) -> dict[str, Any]:
    """Our :class:`SamplingParams` as SGLang's ``sampling_params`` dict."""
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
    if params.seed is not None:
        payload["sampling_seed"] = params.seed
    return payload


def generate_payload(requests: Sequence[GenerateRequest], params: SamplingParams) -> dict[str, Any]:
    """Fields of one batched ``/generate`` call (or ``Engine.generate`` keyword arguments)."""
    payload: dict[str, Any] = {
        "input_ids": [r.input_ids.tolist() for r in requests],
        "sampling_params": sampling_params_payload(params),
        "return_logprob": True,
    }
    if any(r.images for r in requests):
        payload["image_data"] = [[encode_image(im) for im in r.images] for r in requests]
    rids = [r.request_id for r in requests]
    if all(rid is not None for rid in rids) and len(set(rids)) == len(rids):
        payload["rid"] = rids
    return payload


def parse_output(output: dict[str, Any], request: GenerateRequest) -> Completion:
    """One SGLang output dict -> :class:`Completion`. Malformed output becomes an error
    completion naming what was missing, never an exception."""
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
    return Completion(
        token_ids=token_ids,
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        prompt_length=prompt_length,
        request_id=rid,
    )


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
