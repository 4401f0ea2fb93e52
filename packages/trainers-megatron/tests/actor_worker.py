"""One rank of the MegatronActor runs (launched by test_actor.py).

Usage: ``RANK=r WORLD_SIZE=2 MASTER_PORT=p python actor_worker.py case.pt out_dir``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from trainers_megatron import MegatronConfig
from trainers_megatron.actor import MegatronActor


class RunsCode:
    """A hostile checkpoint file's content: unpickling it runs code (creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def saved_moments(optimizer_state: list[dict]) -> int:
    """AdamW first-moment elements in a saved optimizer state (plain torch state dicts, or the
    distributed optimizer's per-bucket shards)."""
    total = 0
    for entry in optimizer_state:
        if "param_state" in entry:
            for key, by_dtype in entry["param_state"].items():
                if isinstance(key, int):
                    for buckets in by_dtype.values():
                        total += sum(e["exp_avg"].numel() for b in buckets for e in b)
        else:
            total += sum(s["exp_avg"].numel() for s in entry["state"].values())
    return total


def main(case_path: str, out_dir: str) -> None:
    case = torch.load(case_path, weights_only=False)
    rank = int(os.environ["RANK"])
    out: dict[str, dict] = {}
    for name, scenario in case["scenarios"].items():
        actor = MegatronActor(MegatronConfig(**case["config"], **scenario["config"]))
        batch = case["batch"] if scenario["share"] else case["batch"].select([rank])
        for mb in actor.micro_batches(batch):  # the host's longest sample is the device's
            assert mb.max_seqlen == int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()), mb
        result = {"before": actor.compute_logprobs(batch)}
        result["metrics"] = actor.train_step(batch, loss="grpo")
        result["after"] = actor.compute_logprobs(batch)
        if actor.ref_model is not None:  # the frozen initial weights, after the update
            result["reference_after"] = actor.compute_logprobs(batch, reference=True)
        if scenario.get("sft"):
            result["sft"] = actor.train_step(batch, loss="sft")
        if scenario.get("nonfinite"):  # a NaN loss: the update is skipped, the model unchanged
            before = actor.compute_logprobs(batch)
            bad = dataclasses.replace(
                batch, advantages=[a * float("nan") for a in batch.advantages]
            )
            result["nonfinite"] = actor.train_step(bad, loss="grpo")
            after = actor.compute_logprobs(batch)
            result["nonfinite_moved"] = any(
                not torch.equal(a, b) for a, b in zip(before, after, strict=True)
            )
        if scenario.get("resume"):
            ckpt = Path(out_dir) / f"ckpt_{name}"
            actor.save_checkpoint(ckpt)
            saved = torch.load(ckpt / f"rank{rank:05d}.pt", weights_only=True)
            result["saved_moments"] = saved_moments(saved["optimizer"])
            trainable = [p for p in actor.module.parameters() if p.requires_grad]
            result["trainable"] = sum(p.numel() for p in trainable)
            actor.train_step(batch, loss="grpo")
            result["second"] = actor.compute_logprobs(batch)
            actor.load_checkpoint(ckpt)
            actor.train_step(batch, loss="grpo")
            result["second_resumed"] = actor.compute_logprobs(batch)
            exported = {}
            for bucket in actor.iter_hf_weights(bucket_bytes=1 << 20):
                exported.update(bucket)
            result["exported_keys"] = sorted(exported)
            marker = Path(out_dir) / f"code_ran_rank{rank}"
            torch.save({"model": RunsCode(marker)}, ckpt / f"rank{rank:05d}.pt")
            try:
                actor.load_checkpoint(ckpt)
                result["tampered"] = "loaded"
            except pickle.UnpicklingError:
                result["tampered"] = "refused"
            result["tampered_code_ran"] = marker.exists()
        out[name] = result
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
