"""Fixtures for the Megatron tests: the CPU compatibility layer, a tiny model, real inputs.

The reference is the HF model built from ``tiny_config()`` with every weight perturbed (so
norms and deepstack mergers are not at their trivial init), fed real Geometry3K validation
images through the real Qwen3-VL processor.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from vlm_models.megatron import _cpu_compat  # noqa: E402

if not torch.cuda.is_available():
    _cpu_compat.apply()


def perturbed_hf_model(config, seed: int = 0) -> torch.nn.Module:
    """The HF reference model with every parameter moved off its init, deterministically."""
    from vlm_models.build import build_model

    model = build_model(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def geo3k_inputs(geo3k_dir: Path, qwen3vl_dir: Path, n: int = 2) -> dict[str, torch.Tensor]:
    """Processor outputs (right-padded batch) for the first ``n`` validation rows."""
    import pandas as pd
    from PIL import Image
    from transformers import AutoProcessor

    rows = pd.read_parquet(geo3k_dir / "validation.parquet").head(n)
    processor = AutoProcessor.from_pretrained(qwen3vl_dir)
    processor.tokenizer.padding_side = "right"
    texts, images = [], []
    for _, row in rows.iterrows():
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        question = row["problem"].replace("<image>", "").strip()
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        ]
        texts.append(
            processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        images.append(image)
    batch = processor(
        text=texts,
        images=images,
        return_tensors="pt",
        padding=True,
        pad_to_multiple_of=4,
        max_pixels=64 * 32 * 32,
    )
    return dict(batch)


@pytest.fixture(scope="session")
def tiny_setup(geo3k_dir: Path, qwen3vl_dir: Path):
    """(config, HF model, processor batch) shared by the Megatron tests."""
    from vlm_models.presets import tiny_config

    config = tiny_config()
    return config, perturbed_hf_model(config), geo3k_inputs(geo3k_dir, qwen3vl_dir)


def megatron_inputs(config, batch: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The batch as Megatron inputs: padded ``sbhd`` and packed ``thd`` (samples unpadded)."""
    from vlm_models.megatron import rope_position_ids
    from vlm_models.packing import cu_seqlens_from_lengths, packed_position_ids

    ids, mask, grids = batch["input_ids"], batch["attention_mask"].bool(), batch["image_grid_thw"]
    sbhd = dict(
        input_ids=ids,
        position_ids=rope_position_ids(
            ids,
            config,
            mm_token_type_ids=batch["mm_token_type_ids"],
            image_grid_thw=grids,
            attention_mask=batch["attention_mask"],
        ),
        pixel_values=batch["pixel_values"],
        image_grid_thw=grids,
    )
    samples = [row[m] for row, m in zip(ids, mask, strict=True)]
    lengths = [len(s) for s in samples]
    thd = dict(
        input_ids=torch.cat(samples)[None],
        position_ids=packed_position_ids(samples, list(grids[:, None]), config)[:, None, :],
        pixel_values=batch["pixel_values"],
        image_grid_thw=grids,
        cu_seqlens=cu_seqlens_from_lengths(lengths),
    )
    return {"sbhd": sbhd, "thd": thd, "valid": mask}


@pytest.fixture(scope="session")
def make_hf_model():
    """:func:`perturbed_hf_model`, for tests that need another config."""
    return perturbed_hf_model


@pytest.fixture(scope="session")
def to_megatron_inputs():
    """:func:`megatron_inputs`."""
    return megatron_inputs
