import pytest
import torch
import torch.nn.functional as F

from vlm_models.build import build_model
from vlm_models.packing import (
    packed_inputs,
    packed_position_ids,
    sample_position_ids,
    supports_packed_forward,
)
from vlm_models.presets import tiny_config


def _grids(samples):
    return [s.get("image_grid_thw") for s in samples]


def _ids(samples):
    return [s["input_ids"][0] for s in samples]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model("qwen3-vl-tiny").eval()


def test_sample_positions_equal_the_models_own(samples, tiny):
    for sample in samples:  # one image, text only, two images
        ref, _ = tiny.model.get_rope_index(
            sample["input_ids"],
            mm_token_type_ids=sample["mm_token_type_ids"],
            image_grid_thw=sample.get("image_grid_thw"),
        )
        ours = sample_position_ids(
            sample["input_ids"][0], sample.get("image_grid_thw"), tiny.config
        )
        assert torch.equal(ours, ref[:, 0])


def test_packed_positions_lay_out_each_samples_own_ids(samples, tiny):
    packed = packed_position_ids(_ids(samples), _grids(samples), tiny.config)
    assert packed.shape == (3, sum(s["input_ids"].shape[1] for s in samples))
    # Reference: the model's own batched computation over a left-padded batch.
    width = max(s["input_ids"].shape[1] for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[1]
        ids[i, width - n :], mask[i, width - n :] = s["input_ids"][0], 1
        types[i, width - n :] = s["mm_token_type_ids"][0]
    grids = torch.cat([g for g in _grids(samples) if g is not None])
    ref, _ = tiny.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grids, attention_mask=mask
    )
    expected = torch.cat([ref[:, i, mask[i].bool()] for i in range(len(samples))], dim=1)
    assert torch.equal(packed, expected)
    # Images really do get 2-D positions (rows differ), text-only samples do not.
    assert not torch.equal(packed[1], packed[2])
    # The config alone (no weights) gives the same ids as the model.
    assert torch.equal(packed_position_ids(_ids(samples), _grids(samples), tiny_config()), packed)


def _per_sample_logprobs(logits, ids):
    logp = F.log_softmax(logits[:-1].float(), -1)
    return logp.gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize(
    ("name", "attn"),
    [
        ("qwen3-vl-tiny", "sdpa"),
        ("qwen3-vl-tiny", "eager"),
        ("qwen3-vl-moe-tiny", "sdpa"),
        pytest.param("qwen3-vl-moe-tiny", "eager", marks=pytest.mark.slow),
    ],
)
def test_packed_forward_equals_per_sample_forward(samples, name, attn):
    torch.manual_seed(0)
    model = build_model(name, attn_implementation=attn).eval()
    inputs = packed_inputs(
        _ids(samples),
        config=model.config,
        pixel_values=[s.get("pixel_values") for s in samples],
        image_grid_thw=_grids(samples),
    )
    cu = inputs.pop("cu_seqlens")
    assert inputs["position_ids"].shape == (4, 1, int(cu[-1]))
    assert inputs["image_grid_thw"].shape == (3, 3)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        for s, start, end in zip(samples, cu[:-1], cu[1:], strict=True):
            alone = model(**s).logits[0]
            torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)
            ids = s["input_ids"][0]
            torch.testing.assert_close(
                _per_sample_logprobs(packed[start:end], ids), _per_sample_logprobs(alone, ids)
            )


def test_mismatched_grids_are_reported(samples, tiny):
    one_image = samples[0]
    with pytest.raises(ValueError, match="image tokens but no image_grid_thw"):
        packed_position_ids([one_image["input_ids"][0]], [None], tiny.config)
    with pytest.raises(ValueError, match=r"needs \d+"):
        packed_position_ids(
            [one_image["input_ids"][0]], [samples[2]["image_grid_thw"]], tiny.config
        )
    with pytest.raises(ValueError, match="no pixel_values"):
        packed_inputs(
            [one_image["input_ids"][0]], config=tiny.config, image_grid_thw=_grids(samples[:1])
        )


def test_qwen3_5_positions_match_but_packing_is_refused(samples, qwen3_vl_ids):
    pytest.importorskip("transformers.models.qwen3_5")
    cfg = tiny_config("qwen3.5-tiny", **qwen3_vl_ids)
    model = build_model(cfg).eval()
    sample = samples[2]
    ref, _ = model.model.get_rope_index(
        sample["input_ids"],
        mm_token_type_ids=sample["mm_token_type_ids"],
        image_grid_thw=sample["image_grid_thw"],
    )
    assert torch.equal(
        sample_position_ids(sample["input_ids"][0], sample["image_grid_thw"], cfg), ref[:, 0]
    )
    assert not supports_packed_forward(cfg) and supports_packed_forward(tiny_config())
    with pytest.raises(NotImplementedError, match="linear-attention"):
        packed_inputs(_ids(samples), config=cfg)


@pytest.mark.parametrize("preset", ["qwen3-vl-tiny", "qwen3-vl-moe-tiny", "qwen3.5-tiny"])
def test_a_groups_shared_head_gives_each_samples_own_ids(samples, preset, qwen3_vl_ids):
    """GRPO groups: one prompt, responses of several lengths (and one cut right after its
    last image). The memo computes each prompt's head once; every sample's ids equal the
    model's own computation on that sample alone."""
    from vlm_models.presets import PRESETS

    if preset not in PRESETS:
        pytest.skip(f"{preset} needs a newer transformers")
    cfg = tiny_config(preset, **(qwen3_vl_ids if preset.startswith("qwen3.5") else {}))
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    ids, grids, types = [], [], []
    for s in (samples[0], samples[2]):  # one image, then two images
        prompt = s["input_ids"][0]
        last_image = int((s["mm_token_type_ids"][0] != 0).nonzero()[-1])
        group = [prompt[: last_image + 1], prompt]  # ends on the image; the whole prompt
        group += [torch.cat([prompt, torch.randint(0, 1000, (n,), generator=gen)]) for n in (1, 7)]
        for sample in group:
            ids.append(sample)
            grids.append(s["image_grid_thw"])
            types.append((sample == cfg.image_token_id).int())
    memo: dict = {}
    ours = [
        sample_position_ids(i, g, cfg, t, memo=memo)
        for i, g, t in zip(ids, grids, types, strict=True)
    ]
    assert len(memo) == 4  # per prompt: the sample that ends on its image, and the others
    for sample, grid, t, got in zip(ids, grids, types, ours, strict=True):
        ref, _ = model.model.get_rope_index(
            sample[None], mm_token_type_ids=t[None], image_grid_thw=grid
        )
        assert torch.equal(got, ref[:, 0])
    packed = packed_position_ids(ids, grids, cfg, types)
    assert torch.equal(packed, torch.cat(ours, dim=1))
