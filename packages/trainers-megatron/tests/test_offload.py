"""StorageOffload frees whole storages and brings them back with every view still attached
(megatron-core's DDP parameters and gradients are views into contiguous buffers)."""

from __future__ import annotations

import pytest
import torch

from trainers_megatron.offload import StorageOffload


def test_views_survive_an_offload_round_trip():
    buffer = torch.arange(12, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.empty(3, 2))
    weight.data = buffer[:6].view(3, 2)  # as DDP maps a parameter into its buffer
    shard = buffer[6:]  # as the distributed optimizer views its shard
    state = torch.randn(5)
    expected = (buffer.clone(), state.clone())

    offload = StorageOffload()
    moved = offload.offload([weight, shard, buffer, state])
    assert moved == (12 + 5) * 4  # each storage once, however many views name it
    assert buffer.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
    assert offload.offloaded
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload([state])

    offload.onload()
    assert not offload.offloaded
    assert torch.equal(buffer, expected[0]) and torch.equal(state, expected[1])
    buffer.add_(1.0)  # the views still share the buffer's memory
    assert torch.equal(weight.detach().reshape(-1), buffer[:6])
    assert torch.equal(shard, buffer[6:])


def _host_ptrs(offload: StorageOffload) -> list[int]:
    return [h.data_ptr() for _, h in offload._direct + offload._buckets]


def test_the_next_offload_reuses_the_host_buffers():
    """A colocated run offloads the same storages every step: the host memory is taken once."""
    weight, state = torch.randn(6), torch.randn(4)
    offload = StorageOffload(direct_bytes=20)  # the weight alone, the state in a bucket
    offload.offload([weight, state])
    assert len(offload._direct) == 1 and len(offload._buckets) == 1
    first = _host_ptrs(offload)
    offload.onload()
    weight.mul_(2.0)  # the training step changes the values in between
    expected = weight.clone()
    offload.offload([weight, state])
    assert _host_ptrs(offload) == first
    assert offload.host_bytes == (6 + 4) * 4
    offload.onload()
    assert torch.equal(weight, expected)

    bigger = torch.randn(8)  # another storage in that place gets a buffer of its own size
    offload.offload([weight, bigger])
    assert offload.host_bytes == (6 + 8) * 4
    offload.onload()


def test_small_storages_cross_in_buckets_and_dropped_ones_come_back_zero():
    """Many small storages pack into a few buckets (one copy each), large ones go alone, and a
    dropped storage (a gradient buffer between steps) is not copied but returns zero-filled;
    every kept value comes back bit for bit, dtypes and views included."""
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(n, generator=gen) for n in (3, 5, 7, 11, 13)]  # 12 .. 52 bytes
    small.append(torch.randint(0, 2**15, (9,), generator=gen, dtype=torch.int16))
    small.append(torch.randn(4, generator=gen).to(torch.bfloat16))
    large = torch.randn(64, generator=gen)  # 256 bytes: copied alone
    view = large[10:20].view(2, 5)  # a view of a storage already listed
    grads = torch.randn(32, generator=gen)
    expected = [t.clone() for t in (*small, large)]

    offload = StorageOffload(direct_bytes=100, bucket_bytes=64)
    moved = offload.offload([*small, large, view, grads], drop=[grads])
    assert moved == sum(t.untyped_storage().nbytes() for t in expected)  # grads not copied
    assert len(offload._direct) == 1
    assert 1 < len(offload._buckets) < len(small)  # several small storages per copy
    assert all(b.nbytes <= 64 for b, _ in offload._buckets)
    assert all(t.untyped_storage().nbytes() == 0 for t in (*small, large, grads))

    assert offload.onload() == moved
    assert not offload.offloaded
    for got, want in zip((*small, large), expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(grads, torch.zeros(32))
    large.add_(1.0)  # the view still shares the storage
    assert torch.equal(view.reshape(-1), large[10:20])


def _text_batch():
    """Two text-only samples, 8 response tokens each (no image: the vision tower idles)."""
    from rl_algos import TrainBatch

    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 150000, (n,), generator=gen) for n in (20, 28)]
    masks = [torch.cat([torch.zeros(len(i) - 8), torch.ones(8)]) for i in ids]
    return TrainBatch(
        input_ids=ids,
        loss_mask=masks,
        advantages=[m * s for m, s in zip(masks, (1.0, -1.0), strict=True)],
        pixel_values=[None, None],
        image_grid_thw=[None, None],
    )


def test_actor_state_round_trips_bit_exactly(one_process):
    """The Megatron actor (MoE preset, distributed optimizer, flat masters) moved out and back:
    parameters, masters and AdamW's moments return bit for bit, the zero gradient buffers are
    not copied, and the next step equals that of a twin actor that never moved (the views
    into megatron-core's buffers still connect the optimizer to the model). The CPU stands in
    for both ends (the actor offloads only from a GPU)."""
    from rl_algos.optimizer import OptimConfig
    from trainers_megatron import MegatronConfig
    from trainers_megatron.actor import MegatronActor

    optim = OptimConfig(lr=1e-3, weight_decay=0.0)
    config = MegatronConfig(model="qwen3-vl-moe-tiny", optim=optim)
    moved, twin = MegatronActor(config), MegatronActor(config)
    batch = _text_batch()
    for actor in (moved, twin):
        actor.train_step(batch)
    state = {n: t.clone() for n, t in moved.module.state_dict().items() if torch.is_tensor(t)}
    opt_state = [t.clone() for t in moved._device_tensors()]
    grads = [b.grad_data for b in moved._ddp_buffers()]
    assert moved._grads_zero and all(not g.any() for g in grads)

    storages = {t.untyped_storage().data_ptr(): t for t in moved._device_tensors()}
    total = sum(t.untyped_storage().nbytes() for t in storages.values())
    grad_bytes = sum(g.untyped_storage().nbytes() for g in grads)
    copied = moved._move_out()
    assert all(t.untyped_storage().nbytes() == 0 for t in storages.values())
    assert grad_bytes > 0 and copied == total - grad_bytes  # every storage but the gradients
    assert moved._offload.onload() == copied

    for name, value in moved.module.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, state[name]), name
    for got, want in zip(moved._device_tensors(), opt_state, strict=True):
        assert torch.equal(got, want)
    after = moved.train_step(batch), twin.train_step(batch)
    for key in ("loss", "grad_norm", "lr"):
        assert after[0][key] == after[1][key], key
    twin_state = twin.module.state_dict()
    for name, value in moved.module.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, twin_state[name]), name
