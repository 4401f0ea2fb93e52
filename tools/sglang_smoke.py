"""Smoke test of the real SGLang contract on a GPU machine (``uv sync --extra gpu``).

Starts SGLang on a Qwen3-VL checkpoint, sends one geo3k prompt with its image, pushes one
weight update through each transport (CUDA IPC to the in-process engine, CUDA IPC to a launched
server, each both by the engine's own ``update_weights`` and by the loop's ``CudaIpc`` transport
in SGLang's ``flattened_bucket`` format, NCCL broadcast to that server), checks with ``get_weights_by_name`` that the new values
landed, releases and resumes memory, and prints one verdict line per step. Run it after
changing rollout-sglang or bumping the sglang pin; the CPU suite only talks to a stand-in.

    uv run tools/sglang_smoke.py --model /models/Qwen3-VL-2B-Instruct \
        --dataset ../shared/data/geo3k [--server-gpu 1] [--min-pixels N --max-pixels N]

The NCCL step needs a second GPU (the server's, ``--server-gpu``): NCCL refuses two ranks on
one device. Exit code: 0 when every step passed or was skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

PROBE = "model.language_model.norm.weight"  # a small tensor every Qwen3-VL checkpoint has


def _verdict(step: str, fn: Callable[[], str], results: list[bool]) -> Any:
    start = time.monotonic()
    try:
        detail = fn()
    except SkipStep as skip:
        print(f"SKIP {step}: {skip}", flush=True)
        return None
    except Exception as exc:  # the smoke test reports every step, whatever fails
        results.append(False)
        print(f"FAIL {step}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(file=sys.stderr)
        return None
    results.append(True)
    print(f"PASS {step} ({time.monotonic() - start:.1f}s): {detail}", flush=True)
    return detail


class SkipStep(Exception):
    """A step that cannot run here (say why)."""


def _checkpoint_buckets(model: Path, bucket_bytes: int = 512 << 20):
    """Every tensor of the checkpoint on the GPU, in buckets of about ``bucket_bytes``."""
    from safetensors import safe_open

    bucket, size = [], 0
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                tensor = f.get_tensor(name).to("cuda")
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
    if bucket:
        yield bucket


def _checkpoint_tensor(model: Path, name: str):
    from safetensors import safe_open

    index = model / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][name] if index.exists() else None
    with safe_open(str(model / (file or "model.safetensors")), framework="pt") as f:
        return f.get_tensor(name)


def _landed(values: Any, expected) -> str:
    """``get_weights_by_name`` answers the first values of the parameter (truncated)."""
    import torch

    got = torch.tensor(values, dtype=torch.float32).flatten()
    want = expected.float().flatten()[: got.numel()].cpu()
    if got.numel() == 0 or not torch.allclose(got, want, atol=1e-2):
        raise AssertionError(f"engine holds {got[:4].tolist()}, sent {want[:4].tolist()}")
    return f"{got.numel()} values match"


class LocalLink:
    """An engine link in this process (in a run, rl-runtime's ``RemoteEngine`` over Ray)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(self.engine, *args))
        return future


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="local Qwen3-VL folder")
    parser.add_argument("--dataset", required=True, help="geo3k parquet folder or hub name")
    parser.add_argument("--split", default="test")
    parser.add_argument("--min-pixels", type=int, default=None)
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument("--mem-fraction", type=float, default=0.35)
    parser.add_argument("--mm-attention-backend", default=None, help='"sdpa" on B200')
    parser.add_argument("--server-gpu", type=int, default=1, help="GPU of the launched server")
    parser.add_argument("--port", type=int, default=30123)
    args = parser.parse_args(argv)

    import torch

    from rl_runtime.protocols import KV_CACHE, WEIGHTS
    from rollout_sglang.sglang_client.client import SGLangClient
    from rollout_sglang.sglang_client.common import SGLangConfig, require_sglang
    from rollout_sglang.sglang_client.engine import SGLangEngine
    from rollout_sglang.sglang_client.server import SGLangServer
    from rollout_sglang.types import GenerateRequest, SamplingParams
    from rollout_sglang.validation import RequestLimits
    from vlm_data.loading import load_rows
    from vlm_data.processor import build_processor
    from vlm_data.prompts import PromptBuilder
    from weight_sync.cuda_ipc import CudaIpc
    from weight_sync.nccl import DistributedWeightSender
    from weight_sync.weight_names import WeightNameCheck, sglang_param_name

    try:
        require_sglang()
    except ImportError as exc:
        print(f"FAIL setup: {exc}", flush=True)
        return 1
    results: list[bool] = []
    processor = build_processor(args.model, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    config_json = json.loads((args.model / "config.json").read_text())
    limits = RequestLimits(image_token_id=config_json["image_token_id"], needs_pixels=False)
    names = WeightNameCheck.from_checkpoint(args.model)
    rows = load_rows(args.dataset, split=args.split)
    request = GenerateRequest.from_prompt(PromptBuilder(processor).build(rows[0], 0))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    probe = _checkpoint_tensor(args.model, PROBE).to("cuda")
    sglang_name = sglang_param_name(PROBE)
    common = {
        "model_path": str(args.model),
        "mem_fraction_static": args.mem_fraction,
        "mm_attention_backend": args.mm_attention_backend,
        "min_pixels": args.min_pixels,
        "max_pixels": args.max_pixels,
    }
    state: dict[str, Any] = {}

    def start() -> str:
        state["engine"] = SGLangEngine(SGLangConfig(**common), limits=limits, weight_names=names)
        return f"in-process engine on GPU 0 ({args.model.name})"

    def generate() -> str:
        (out,) = state["engine"].generate([request], greedy)
        if not out.ok or not out.response_length:
            raise AssertionError(out.error or "empty response")
        state["first"] = list(out.token_ids)
        return f"{out.response_length} tokens: {processor.decode(out.token_ids)[:60]!r}"

    def tensor_update() -> str:
        engine = state["engine"]
        new = probe + 0.5
        engine.update_weights([[(PROBE, new)]])
        landed = _landed(engine.engine.get_weights_by_name(sglang_name), new)
        engine.update_weights([[(PROBE, probe)]])  # put the checkpoint's value back
        return "CUDA IPC (in-process): " + landed

    def ipc_transport(engine: Any, read: Callable[[], Any], where: str) -> str:
        transport = CudaIpc(sglang=True, weight_names=names)([LocalLink(engine)])
        new = probe + 0.75
        transport.send([[(PROBE, new)]])
        landed = _landed(read(), new)
        transport.send([[(PROBE, probe)]])
        return f"CudaIpc transport, flattened_bucket ({where}): " + landed

    def memory() -> str:
        # the loop's order at a sync: a release drops the weights (no CPU backup), so they
        # come back empty, the whole checkpoint is pushed, then the KV cache returns; greedy
        # decoding must then give the first answer again
        engine = state["engine"]
        engine.release_memory()
        engine.resume_memory(WEIGHTS)
        engine.update_weights(_checkpoint_buckets(args.model))
        engine.resume_memory(KV_CACHE)
        (out,) = engine.generate([request], greedy)
        if not out.ok:
            raise AssertionError(out.error)
        if list(out.token_ids) != state["first"]:
            raise AssertionError("after release, push and resume the greedy answer changed")
        return "released, resumed the weights, pushed the checkpoint, resumed the KV cache"

    def server() -> str:
        state["engine"].shutdown()
        config = SGLangConfig(**common, base_gpu_id=args.server_gpu, port=args.port)
        if torch.cuda.device_count() <= args.server_gpu:
            config.base_gpu_id = 0
        state["server"] = SGLangServer(config, log_path="/tmp/sglang_smoke_server.log")
        state["client"] = SGLangClient(server=state["server"], limits=limits, weight_names=names)
        (out,) = state["client"].generate([request], greedy)
        if not out.ok:
            raise AssertionError(out.error)
        return f"server on GPU {config.base_gpu_id}, {out.response_length} tokens"

    def server_tensor_update() -> str:
        client = state["client"]
        new = probe + 0.25
        client.update_weights([[(PROBE, new)]])
        got = client._post("/get_weights_by_name", {"name": sglang_name})
        client.update_weights([[(PROBE, probe)]])
        return "CUDA IPC (server): " + _landed(got, new)

    def nccl_update() -> str:
        if torch.cuda.device_count() < 2:
            raise SkipStep("NCCL needs the server on a second GPU")
        client = state["client"]
        sender = DistributedWeightSender([client], master_address="127.0.0.1")
        try:
            new = probe - 0.25
            sender.send([[(PROBE, new)]])
            got = client._post("/get_weights_by_name", {"name": sglang_name})
            sender.send([[(PROBE, probe)]])
        finally:
            sender.close()
        return "NCCL broadcast: " + _landed(got, new)

    def server_memory() -> str:
        client = state["client"]
        client.release_memory()
        client.resume_memory()
        return "server released and resumed"

    try:
        for step, fn in [
            ("start", start),
            ("generate", generate),
            ("update_weights_from_tensor", tensor_update),
            (
                "cuda_ipc_transport",
                lambda: ipc_transport(
                    state["engine"],
                    lambda: state["engine"].engine.get_weights_by_name(sglang_name),
                    "in-process",
                ),
            ),
            ("release_resume", memory),
            ("server", server),
            ("server_update_weights_from_tensor", server_tensor_update),
            (
                "server_cuda_ipc_transport",
                lambda: ipc_transport(
                    state["client"],
                    lambda: state["client"]._post("/get_weights_by_name", {"name": sglang_name}),
                    "server",
                ),
            ),
            ("update_weights_from_distributed", nccl_update),
            ("server_release_resume", server_memory),
        ]:
            if step != "start" and results[:1] != [True]:
                print(f"SKIP {step}: the engine did not start", flush=True)
                continue
            _verdict(step, fn, results)
    finally:
        if "client" in state:
            state["client"].shutdown()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
