"""One rank of the context-parallel parity runs (launched by test_context_parallel.py).

Usage: ``RANK=r WORLD_SIZE=4 MASTER_PORT=p python cp_worker.py case.pt out_dir``. For each
model, the reference layout runs first (no CP), then every CP layout from the same initial
weights on the same batch: log-probs before and after one GRPO step, the step's metrics, and
the largest difference of every exported weight after the step from the reference's. The
step is on-policy (old log-probs: the layout's own), as the training loop runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor


def _weights(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {n: t for bucket in actor.iter_hf_weights(bucket_bytes=1 << 24) for n, t in bucket}


def main(case_path: str, out_dir: str) -> None:
    case = torch.load(case_path, weights_only=False)
    rank = int(os.environ["RANK"])
    batch = case["batch"]
    out: dict[str, dict] = {}
    for model, layouts in case["models"].items():
        reference: dict[str, torch.Tensor] = {}
        for name, layout in layouts.items():
            config = MegatronConfig(**case["config"], **case["model_configs"][model], **layout)
            actor = MegatronActor(config)
            result = {"before": actor.compute_logprobs(batch)}
            batch.old_logprobs = result["before"]  # on-policy, as the loop runs it
            if not reference:
                initial = _weights(actor)
            result["metrics"] = actor.train_step(batch, loss="grpo")
            result["after"] = actor.compute_logprobs(batch)
            weights = _weights(actor)
            if not reference:  # the first layout is the reference
                reference = weights
                result["update"] = max(
                    float((weights[k] - initial[k]).abs().max()) for k in weights
                )
                del initial
            else:
                assert weights.keys() == reference.keys()
                diffs = {k: float((weights[k] - reference[k]).abs().max()) for k in weights}
                worst = max(diffs, key=diffs.get)
                result["weight_diff"], result["worst"] = diffs[worst], worst
            out[f"{model}_{name}"] = result
            del actor
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
