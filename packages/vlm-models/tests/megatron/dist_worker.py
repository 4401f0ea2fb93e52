"""One rank of the multi-process Megatron parity runs (launched by test_megatron_parallel.py).

Usage: ``RANK=r WORLD_SIZE=w MASTER_PORT=p python dist_worker.py case.pt out_dir``. ``case.pt``
holds the HF state dict, the inputs and the scenarios; each rank writes ``rank{r}.pt`` with,
per scenario, the full logits (rank 0 of the last stage) and what the checks need.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_models.megatron import _cpu_compat

if not torch.cuda.is_available():
    _cpu_compat.apply()

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from vlm_models.megatron import (
    Parallelism,
    build_megatron_model,
    initialize_model_parallel,
    iter_hf_weights,
    load_hf_weights,
    param_maps,
)
from vlm_models.megatron.convert import shard


def _forward(model, case: dict, thd: bool) -> torch.Tensor | None:
    """Run this rank's stage; manual send/recv between two pipeline stages."""
    key = "thd" if thd else "sbhd"
    inputs = case[key]
    packed = None
    if thd:
        cu = inputs["cu_seqlens"]
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
            max_seqlen_kv=int((cu[1:] - cu[:-1]).max()),
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if not first:
        ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        shape = (inputs["input_ids"].shape[1], inputs["input_ids"].shape[0], case["hidden"])
        hidden = torch.empty(shape)
        dist.recv(hidden, src=ranks[parallel_state.get_pipeline_model_parallel_rank() - 1])
        model.set_input_tensor(hidden.requires_grad_())
    out = model(
        inputs["input_ids"],
        inputs["position_ids"],
        pixel_values=inputs["pixel_values"] if first else None,
        image_grid_thw=inputs["image_grid_thw"] if first else None,
        packed_seq_params=packed,
        runtime_gather_output=True,
    )
    if pp > 1 and not last:
        ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        dist.send(
            out.detach().contiguous(),
            dst=ranks[parallel_state.get_pipeline_model_parallel_rank() + 1],
        )
        return None
    return out


def _pipeline_grads(model, case: dict) -> dict[str, float]:
    """Forward and backward over two pipeline stages, as a 1F1B schedule does for one
    micro-batch (activations sent forward, their gradient sent back); relative gradient errors
    against HF's for every tensor this stage holds. The tied embedding / output copies hold only
    their part of HF's summed gradient, so they are left out.

    (Megatron's ``get_forward_backward_func`` schedules allocate with ``device="cuda"`` in
    0.16.1, so on CPU the two stages exchange tensors here directly.)
    """
    inputs = case["sbhd"]
    first = parallel_state.is_pipeline_first_stage()
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    batch, seq = inputs["input_ids"].shape
    if first:
        hidden = model(
            inputs["input_ids"],
            inputs["position_ids"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        )
        dist.send(hidden.detach().contiguous(), dst=ranks[1])
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=ranks[1])
        hidden.backward(grad)
    else:
        received = torch.empty(seq, batch, case["hidden"])
        dist.recv(received, src=ranks[0])
        received.requires_grad_()
        model.set_input_tensor(received)
        logits = model(inputs["input_ids"], inputs["position_ids"], runtime_gather_output=True)
        (logits * case["loss_weights"]).sum().backward()
        dist.send(received.grad.contiguous(), dst=ranks[0])
    grads = dict(model.named_parameters())
    errors = {}
    for pmap in param_maps(model):
        if "word_embeddings" in pmap.megatron or "output_layer" in pmap.megatron:
            continue
        expected = shard(pmap, [case["hf_grads"][n] for n in pmap.hf], model.arch, 0, 1)
        got = grads[pmap.megatron].grad
        errors[pmap.megatron] = float(
            (got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
        )
    return errors


def main(case_path: str, out_dir: str) -> None:
    case = torch.load(case_path, weights_only=False)
    rank = int(__import__("os").environ["RANK"])
    results: dict[str, dict] = {}
    for name, scenario in case["scenarios"].items():
        parallel = Parallelism(
            tp=scenario["tp"],
            pp=scenario["pp"],
            ep=scenario.get("ep", 1),
            sp=scenario.get("sp", False),
            etp=scenario.get("etp"),
        )
        initialize_model_parallel(parallel)
        weights = case["models"][scenario.get("model", "dense")]
        model = build_megatron_model(weights["config"], parallel, **scenario.get("overrides", {}))
        load_hf_weights(model, weights["hf_state"])
        result: dict = {}
        hf_grads = weights.get("hf_grads", case["hf_grads"])
        if scenario.get("pipeline_grads"):
            result["grad_rel_err"] = _pipeline_grads(model, case)
            results[name] = result
            continue
        logits = _forward(model, case, scenario.get("thd", False))
        if logits is not None:
            result["logits"] = logits.detach()
        # what a rank holds of the routed experts (for the expert-TP scenarios)
        result["expert_fc1"] = {
            n: tuple(p.shape)
            for n, p in model.named_parameters()
            if "experts" in n and "shared" not in n and "linear_fc1" in n
        }
        if scenario.get("grads"):
            loss = (logits * case["loss_weights"]).sum()
            loss.backward()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            grads = dict(model.named_parameters())
            checks = {}
            for pmap in param_maps(model):
                if pmap.kind == "replicated" and not pmap.megatron.startswith("visual."):
                    continue  # partial over TP until finalize_model_grads all-reduces them
                expected = shard(pmap, [hf_grads[n] for n in pmap.hf], model.arch, tp_rank, tp_size)
                got = grads[pmap.megatron].grad
                checks[pmap.megatron] = float(
                    (got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
                )
            result["grad_rel_err"] = checks
        if scenario.get("export"):
            exported = {}
            for bucket in iter_hf_weights(model, bucket_bytes=1 << 20):
                exported.update({n: t.clone() for n, t in bucket})
            result["exported"] = exported
        results[name] = result
        del model
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
