"""The CUDA IPC transport's packing (CPU), the whole transport on CPU buffers against a real
transformers engine, and (``gpu``) the real handle exchange between two processes."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Listener

import pytest
import torch

from rollout_sglang.hf.engine import HFEngine
from rollout_sglang.hf.weights import WeightLoader
from weight_sync.cuda_ipc import (
    ALIGN_BYTES,
    CudaIpc,
    FlatBuffers,
    PackedBucket,
    load_packed_bucket,
    pack_bucket,
    plan_layout,
    unpack,
)


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("a.bias", torch.randn(7, generator=g)),
        ("b.weight", torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)),
        ("c.scale", torch.randn(1, generator=g)),
    ]


def test_layout_groups_by_dtype_in_order_with_aligned_offsets():
    layout = plan_layout(_bucket())
    assert list(layout) == [torch.bfloat16, torch.float32]
    bf16, n_bf16 = layout[torch.bfloat16]
    f32, n_f32 = layout[torch.float32]
    assert [s.name for s in bf16] == ["a.weight", "b.weight"]
    assert [s.name for s in f32] == ["a.bias", "c.scale"]
    assert [s.offset for s in bf16] == [0, ALIGN_BYTES // 2]  # 15 elements, then aligned
    assert [s.offset for s in f32] == [0, ALIGN_BYTES // 4]
    assert (n_bf16, n_f32) == (ALIGN_BYTES // 2 + 24, ALIGN_BYTES // 4 + 1)
    assert bf16[1].shape == (2, 3, 4) and bf16[1].numel == 24


def test_pack_then_unpack_gives_the_bucket_back_and_buffers_are_reused():
    bucket = _bucket()
    buffers = FlatBuffers(torch.device("cpu"), slots=2)
    parts = buffers.pack(bucket, 0)
    got = dict(named for _, flat, slots in parts for named in unpack(flat, slots))
    assert list(got) != [n for n, _ in bucket]  # grouped by dtype ...
    assert sorted(got) == sorted(n for n, _ in bucket)  # ... and nothing lost
    for name, tensor in bucket:
        assert got[name].dtype == tensor.dtype
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    first = {dtype: flat.data_ptr() for dtype, flat, _ in parts}
    # bucket 1 goes to the other set, bucket 2 back into the first set's memory
    other = {d: f.data_ptr() for d, f, _ in buffers.pack(bucket, 1)}
    assert set(other.values()).isdisjoint(first.values())
    smaller = [(n, t * 2) for n, t in bucket[:2]]
    again = buffers.pack(smaller, 2)
    assert {d: f.data_ptr() for d, f, _ in again} == first
    got = dict(named for _, flat, slots in again for named in unpack(flat, slots))
    torch.testing.assert_close(got["a.weight"], bucket[0][1] * 2, rtol=0, atol=0)


def test_packed_message_names_every_tensor_and_loads_into_an_engine():
    from vlm_models.build import build_model
    from vlm_models.presets import tiny_config

    torch.manual_seed(0)
    source = build_model(tiny_config())
    torch.manual_seed(1)
    engine = HFEngine(build_model(tiny_config()), device="cpu", max_batch_size=2)
    bucket = [(n, p.detach().clone()) for n, p in source.named_parameters()]
    message = pack_bucket(FlatBuffers(torch.device("cpu")), bucket, 0)
    assert isinstance(message, PackedBucket) and message.names == [
        n for n, t in bucket if t.dtype == bucket[0][1].dtype
    ] + [n for n, t in bucket if t.dtype != bucket[0][1].dtype]
    assert load_packed_bucket(engine, message) == len(bucket)
    loader = WeightLoader(engine.model)
    for name, tensor in bucket:
        torch.testing.assert_close(loader.target(name), tensor, rtol=0, atol=0)


class LocalLink:
    """An engine link in this process (rl-runtime's RemoteEngine runs the same in a Ray actor)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[str] = []

    def submit(self, fn, *args) -> Future:
        self.calls.append(fn.__name__)
        future: Future = Future()
        future.set_result(fn(self.engine, *args))
        return future


def test_transport_on_cpu_buffers_updates_every_engine_in_place():
    from vlm_models.build import build_model
    from vlm_models.presets import tiny_config
    from weight_sync import iter_weight_buckets

    torch.manual_seed(0)
    source = build_model(tiny_config())
    engines = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        engines.append(HFEngine(build_model(tiny_config()), device="cpu", max_batch_size=2))
    before = [dict(e.model.named_parameters()) for e in engines]
    links = [LocalLink(e) for e in engines]
    transport = CudaIpc()(links)
    named = [(n, p.detach()) for n, p in source.named_parameters()]
    buckets = list(iter_weight_buckets(named, 64 << 10))
    assert len(buckets) > 2  # the double buffer really turns over
    assert transport.send(buckets) == len(named)
    for engine, params in zip(engines, before, strict=True):
        loader = WeightLoader(engine.model)
        for name, tensor in named:
            assert loader.target(name) is params[name]  # in place
            torch.testing.assert_close(loader.target(name), tensor, rtol=0, atol=0)
    assert links[0].calls == ["load_packed_bucket"] * len(buckets)


# ------------------------------------------------------------------------------- GPU


# The engine's side in a process of its own (started by path: test modules are not importable
# by name here): an engine with in-place ``update_weights``, answering each job in order.
# The engine's answers carry its parameters as torch.save bytes: once torch.multiprocessing is
# imported (opening a handle imports it), a tensor pickled onto a Connection travels as a file
# descriptor that only a multiprocessing child can fetch (AuthenticationError in this separately
# started process: seen on the H200, 2026-12-01). The handles themselves are plain bytes.
ENGINE_PROCESS = """
import io
import sys
from multiprocessing.connection import Client

import torch

from weight_sync.cuda_ipc import load_packed_bucket


class Engine:
    def __init__(self):
        self.params = {}

    def update_weights(self, buckets):
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in self.params:
                    self.params[name] = torch.empty_like(tensor)
                self.params[name].copy_(tensor, non_blocking=True)


conn = Client(("127.0.0.1", int(sys.argv[1])), authkey=b"glimpse")
engine = Engine()
while True:
    job = conn.recv()
    if job is None:
        break
    fn, args = job
    result = fn(engine, *args)
    if fn is load_packed_bucket:
        buf = io.BytesIO()
        torch.save({n: t.cpu() for n, t in engine.params.items()}, buf)
        result = (result, buf.getvalue())
    conn.send(result)
"""


class PipeLink:
    """A link to the engine process (submission order kept, one answer per job)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.seen: list[dict] = []

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self.lock:
            self.conn.send((fn, args))
            result = self.conn.recv()
        if fn is load_packed_bucket:
            result, params = result
            self.seen.append(torch.load(io.BytesIO(params), weights_only=True))
        future.set_result(result)
        return future


@pytest.mark.gpu
def test_real_cuda_ipc_handoff_between_two_processes():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    listener = Listener(("127.0.0.1", 0), authkey=b"glimpse")
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, str(listener.address[1])])
    parent = listener.accept()
    try:
        link = PipeLink(parent)
        transport = CudaIpc()([link])
        g = torch.Generator(device="cuda").manual_seed(0)
        buckets = [
            [
                (f"b{i}.w", torch.randn(64, 33, device="cuda", generator=g).bfloat16()),
                (f"b{i}.b", torch.randn(17, device="cuda", generator=g)),
            ]
            for i in range(5)
        ]
        assert transport.send(buckets) == 10
        final = link.seen[-1]
        for bucket in buckets:
            for name, tensor in bucket:
                torch.testing.assert_close(final[name], tensor.cpu(), rtol=0, atol=0)
        # each answer saw its own bucket, though buffers were reused: no overwrite before the ack
        for i, seen in enumerate(link.seen):
            torch.testing.assert_close(seen[f"b{i}.w"], buckets[i][0][1].cpu(), rtol=0, atol=0)
    finally:
        parent.send(None)
        proc.wait(timeout=60)
        listener.close()


def test_transport_choice_follows_the_layout():
    from rollout_sglang.launch import choose_weight_transport
    from weight_sync.disk import Disk
    from weight_sync.nccl import Nccl

    def pick(**kw):
        return choose_weight_transport(**{"sglang": False, "num_trainers": 1, **kw})

    assert pick(colocate=True, use_gpu=True) == CudaIpc()
    assert pick(colocate=True, use_gpu=True, sglang=True) == CudaIpc(sglang=True)
    assert pick(colocate=True, use_gpu=True, num_trainers=8) is None  # rank 0's GPU only
    assert pick(colocate=False, use_gpu=True, sglang=True, ranks_per_engine=2) == Nccl(2)
    assert not Nccl().restartable and CudaIpc().restartable
    assert pick(colocate=False, use_gpu=True) is None  # the HF engine has no NCCL receiver
    assert pick(colocate=True, use_gpu=False) is None  # CPU: the caller's object store
    # a forced kind: the object store serves every layout, the others only their own
    assert pick(colocate=True, use_gpu=True, kind="object-store") is None
    assert pick(colocate=True, use_gpu=True, kind="cuda-ipc") == CudaIpc()
    assert pick(colocate=False, use_gpu=True, sglang=True, kind="nccl") == Nccl()
    # disk: every layout, into the folder given (a temporary one without), never chosen by auto
    for layout in (dict(colocate=True, use_gpu=False), dict(colocate=False, use_gpu=True)):
        assert pick(**layout, kind="disk", disk_folder="/run/ws") == Disk("/run/ws")
    assert pick(colocate=True, use_gpu=False, kind="disk") == Disk()
    for bad in (
        dict(colocate=True, use_gpu=True, num_trainers=2, kind="cuda-ipc"),
        dict(colocate=True, use_gpu=False, kind="cuda-ipc"),
        dict(colocate=False, use_gpu=True, kind="nccl"),  # the HF engine: no NCCL receiver
        dict(colocate=True, use_gpu=True, sglang=True, kind="nccl"),
        dict(colocate=True, use_gpu=True, kind="rdma"),
    ):
        with pytest.raises(ValueError, match="weight transport"):
            pick(**bad)
