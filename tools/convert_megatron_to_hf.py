"""Convert Megatron-Core shards written by tools/convert_hf_to_megatron.py back to HF safetensors.

    uv run python tools/convert_megatron_to_hf.py --megatron ckpt/mg --out ckpt/hf

The TP/PP sizes and the layer split are read from the folder's glimpse_megatron.json. The
result loads with ``Qwen3VLForConditionalGeneration.from_pretrained`` (and vlm_models.build_model).
"""

from __future__ import annotations

import argparse
import logging

import torch

DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--megatron", required=True, help="folder written by convert_hf_to_megatron"
    )
    parser.add_argument("--out", required=True, help="output HF folder")
    parser.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="size of each output safetensors file"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="keep", help="cast tensors on the way")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from vlm_models.megatron.checkpoint import megatron_to_hf_checkpoint

    megatron_to_hf_checkpoint(
        args.megatron,
        args.out,
        max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        dtype=DTYPES[args.dtype],
    )


if __name__ == "__main__":
    main()
