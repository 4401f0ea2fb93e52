"""Synthetic training batches shaped like real VLM rollouts, for tests and benchmarks.

Each sample is ``[text][vision_start][image tokens][vision_end][text]`` with random ids, random
patch pixels and a loss mask over its second half (the "response"), so shapes, M-RoPE
positions and the vision path are those of a real Qwen3-VL batch without any files.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from rl_algos import TrainBatch

# Small-vocabulary overrides for tiny test models (special ids moved inside the vocabulary).
TINY_OVERRIDES = dict(
    vocab_size=512,
    image_token_id=500,
    video_token_id=501,
    vision_start_token_id=502,
    vision_end_token_id=503,
    bos_token_id=504,
    eos_token_id=505,
)


def synthetic_batch(
    config: PretrainedConfig,
    lengths: list[int],
    *,
    image_patches: list[tuple[int, int] | None] | None = None,
    seed: int = 0,
    grpo: bool = True,
) -> TrainBatch:
    """A TrainBatch with samples of ``lengths`` tokens.

    ``image_patches[i]``: the ``(h, w)`` patch grid of sample ``i``'s one image (each a multiple
    of the merge size; ``h * w / merge^2`` image tokens), or None for a text-only sample.
    ``grpo`` adds advantages (+-1 per sample) and old log-probs (zeros are replaced by the
    actor's own when absent, so they are left out).
    """
    g = torch.Generator().manual_seed(seed)
    vc = config.vision_config
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    vocab = config.text_config.vocab_size
    special = {
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    }
    text_vocab = min(special) if min(special) < vocab else vocab
    patches = image_patches or [None] * len(lengths)
    ids, pixels, grids, masks, advs = [], [], [], [], []
    for length, hw in zip(lengths, patches, strict=True):
        if hw is None:
            sample = torch.randint(0, text_vocab, (length,), generator=g)
            pixels.append(None)
            grids.append(None)
        else:
            h, w = hw
            n_img = h * w // merge**2
            prefix = 4
            tail = length - prefix - n_img - 2
            if tail < 2:
                raise ValueError(f"length {length} too short for a {h}x{w}-patch image")
            sample = torch.cat(
                [
                    torch.randint(0, text_vocab, (prefix,), generator=g),
                    torch.tensor([config.vision_start_token_id]),
                    torch.full((n_img,), config.image_token_id),
                    torch.tensor([config.vision_end_token_id]),
                    torch.randint(0, text_vocab, (tail,), generator=g),
                ]
            )
            pixels.append(torch.randn(h * w, patch_dim, generator=g))
            grids.append(torch.tensor([[1, h, w]]))
        mask = torch.zeros(length)
        mask[length // 2 :] = 1.0
        ids.append(sample)
        masks.append(mask)
        sign = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
        advs.append(mask * sign)
    has_images = any(p is not None for p in pixels)
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        advantages=advs if grpo else None,
        pixel_values=pixels if has_images else None,
        image_grid_thw=grids if has_images else None,
    )
