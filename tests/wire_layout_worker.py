"""One process of tests/test_wire_layout.py: the FSDP and Megatron actors built from a saved HF
folder, each one's ``iter_hf_weights`` buckets saved for the test to load into engines.

Usage: ``RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python wire_layout_worker.py
folder out.pt``.
"""

from __future__ import annotations

import sys

import torch

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from trainers_fsdp import FsdpConfig
from trainers_fsdp.actor import FsdpActor
from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor


def buckets(actor) -> list[list[tuple[str, torch.Tensor]]]:
    # small buckets, so a layer's experts are split over several of them
    return [[(n, t.clone()) for n, t in b] for b in actor.iter_hf_weights(bucket_bytes=1 << 14)]


def main(folder: str, out: str) -> None:
    fsdp = FsdpActor(FsdpConfig(model=folder, device="cpu", export_dtype="float32"))
    result = {"fsdp": buckets(fsdp)}
    del fsdp
    megatron = MegatronActor(MegatronConfig(model=folder, export_dtype="float32"))
    result["megatron"] = buckets(megatron)
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
