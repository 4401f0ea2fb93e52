"""SGLang request building and response parsing (pure data, no sglang needed)."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from rollout_sglang.sglang_client.protocol import (
    collapse_image_pads,
    generate_payload,
    parse_output,
    sampling_params_payload,
    wire_input_ids,
)
from rollout_sglang.types import GenerateRequest, SamplingParams

IMAGE_PAD = 151655  # <|image_pad|> of Qwen3-VL


def test_payload_carries_ids_images_and_sampling(prompt_samples):
    requests = [GenerateRequest.from_prompt(s) for s in prompt_samples[:2]]
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, stop_token_ids=(5, 6), seed=3
    )
    payload = generate_payload(requests, params, image_token_id=IMAGE_PAD)
    for ids, request in zip(payload["input_ids"], requests, strict=True):
        assert ids.count(IMAGE_PAD) == 1  # SGLang expands the one pad per image itself
        expanded = request.input_ids.tolist()
        assert [t for t in ids if t != IMAGE_PAD] == [t for t in expanded if t != IMAGE_PAD]
    assert payload["return_logprob"] is True
    assert payload["rid"] == ["0", "1"]
    for images, sample in zip(payload["image_data"], prompt_samples[:2], strict=True):
        assert len(images) == len(sample.images) == 1
        header, data = images[0].split(",", 1)
        assert header == "data:image/png;base64"
        decoded = Image.open(io.BytesIO(base64.b64decode(data)))
        assert decoded.size == sample.images[0].size
        assert decoded.convert("RGB").tobytes() == sample.images[0].convert("RGB").tobytes()
    common = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 12,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "stop_token_ids": [5, 6],
    }
    # one sampling_params per request, each with its own seed
    assert payload["sampling_params"] == [{**common, "sampling_seed": 3 + i} for i in range(2)]


def test_pads_collapse_per_image_run():
    ids = torch.tensor([1, 2, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 3, 2, IMAGE_PAD, IMAGE_PAD, 3, 9])
    assert collapse_image_pads(ids, ids == IMAGE_PAD) == [1, 2, IMAGE_PAD, 3, 2, IMAGE_PAD, 3, 9]
    image = Image.new("RGB", (4, 4))
    by_id = GenerateRequest(input_ids=ids, images=[image, image])
    by_mask = GenerateRequest(
        input_ids=ids, images=[image, image], mm_token_type_ids=ids == IMAGE_PAD
    )
    assert wire_input_ids(by_id, IMAGE_PAD) == wire_input_ids(by_mask, None)
    assert wire_input_ids(GenerateRequest(input_ids=ids), IMAGE_PAD) == ids.tolist()  # text only
    with pytest.raises(ValueError, match="one image pad per image"):
        wire_input_ids(GenerateRequest(input_ids=ids, images=[image, image]), None)


def test_own_seed_wins_and_no_seed_means_none():
    requests = [GenerateRequest(input_ids=[1]), GenerateRequest(input_ids=[1], seed=99)]
    payload = generate_payload(requests, SamplingParams(seed=10))
    assert [p["sampling_seed"] for p in payload["sampling_params"]] == [10, 99]
    payload = generate_payload(requests[:1], SamplingParams())
    assert "sampling_seed" not in payload["sampling_params"][0]


def test_text_only_payload_has_no_image_data():
    payload = generate_payload([GenerateRequest(input_ids=[1, 2, 3])], SamplingParams(top_k=0))
    assert "image_data" not in payload and "rid" not in payload
    assert sampling_params_payload(SamplingParams(top_k=0))["top_k"] == -1


def _req(n: int = 3) -> GenerateRequest:
    return GenerateRequest(input_ids=torch.arange(n), request_id="r")


def _output(tokens, finish, logprobs=None):
    lps = logprobs or [-0.5] * len(tokens)
    return {
        "text": "...",
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": finish,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, tokens, strict=True)],
        },
    }


def test_parse_stop_and_length():
    stop = parse_output(_output([4, 9, 2], {"type": "stop", "matched": 2}, [-1, -2, -3]), _req())
    assert (stop.token_ids, stop.logprobs, stop.finish_reason) == ([4, 9, 2], [-1, -2, -3], "stop")
    assert stop.prompt_length == 3 and stop.request_id == "r" and stop.ok
    length = parse_output(_output([1, 1], {"type": "length", "length": 2}), _req())
    assert length.finish_reason == "length" and length.response_length == 2


def test_parse_abort_keeps_the_message():
    out = parse_output(
        {"meta_info": {"finish_reason": {"type": "abort", "message": "too long"}}}, _req()
    )
    assert out.finish_reason == "abort" and "too long" in out.error and not out.ok


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ({"text": "x"}, "no meta_info"),
        ({"meta_info": {"finish_reason": {"type": "length"}}}, "no output_token_logprobs"),
        ({**_output([1, 2], {"type": "length"}), "output_ids": [7, 8]}, "disagree"),
        (_output([1], {"type": "weird"}), "unknown SGLang finish_reason"),
    ],
)
def test_parse_malformed_output_is_an_error_not_an_exception(output, message):
    out = parse_output(output, _req())
    assert out.finish_reason == "error" and message in out.error


def _routed(ids: torch.Tensor) -> str:
    """As sglang 0.5.23's detokenizer sends it: base64 of the int32 ids' bytes."""
    return base64.b64encode(ids.to(torch.int32).numpy().tobytes()).decode()


def test_routing_replay_asks_for_and_shapes_routed_experts():
    payload = generate_payload([_req()], SamplingParams(), return_routed_experts=True)
    assert payload["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_payload([_req()], SamplingParams())
    ids = torch.randint(0, 128, (3 + 2 - 1, 4, 2))  # prompt 3 + response 2 - 1 rows
    output = _output([5, 6], {"type": "length"})
    output["meta_info"]["routed_experts"] = _routed(ids)
    out = parse_output(output, _req(), routing_shape=(4, 2))
    assert out.ok and torch.equal(out.routed_experts, ids.to(torch.int32))
    assert parse_output(output, _req()).routed_experts is None  # not asked: not read


@pytest.mark.parametrize(
    ("routed", "message"),
    [(None, "--enable-return-routed-experts"), (_routed(torch.zeros(5, 4, 2)), "expected 4")],
)
def test_bad_routed_experts_fail_the_request_alone(routed, message):
    output = _output([5, 6], {"type": "length"})
    if routed is not None:
        output["meta_info"]["routed_experts"] = routed
    out = parse_output(output, _req(), routing_shape=(4, 2))
    assert not out.ok and message in out.error
