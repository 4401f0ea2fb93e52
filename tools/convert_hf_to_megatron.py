"""Convert an HF Qwen3-VL checkpoint folder to Megatron-Core shards (vlm_models.megatron).

    uv run python tools/convert_hf_to_megatron.py --hf Qwen3-VL-2B-Instruct --out ckpt/mg \\
        --tp 2 --pp 2

Streams one shard at a time. The output folder keeps config and tokenizer files, so
tools/convert_megatron_to_hf.py turns it back into an identical HF checkpoint.
"""

from __future__ import annotations

import argparse
import logging

import torch

DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="HF folder with config.json and *.safetensors")
    parser.add_argument("--out", required=True, help="output folder for the Megatron shards")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument(
        "--first-stage-layers", type=int, default=None, help="decoder layers on the first stage"
    )
    parser.add_argument(
        "--last-stage-layers", type=int, default=None, help="decoder layers on the last stage"
    )
    parser.add_argument(
        "--te", action="store_true", help="Transformer Engine parameter names (fused layernorms)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="keep", help="cast tensors on the way")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from vlm_models.megatron.checkpoint import hf_to_megatron_checkpoint

    hf_to_megatron_checkpoint(
        args.hf,
        args.out,
        tp=args.tp,
        pp=args.pp,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        use_te=args.te,
        dtype=DTYPES[args.dtype],
    )


if __name__ == "__main__":
    main()
