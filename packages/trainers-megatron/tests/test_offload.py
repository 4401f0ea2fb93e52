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


def test_the_next_offload_reuses_the_host_buffers():
    """A colocated run offloads the same storages every step: the host memory is taken once."""
    weight, state = torch.randn(6), torch.randn(4)
    offload = StorageOffload()
    offload.offload([weight, state])
    first = [h.data_ptr() for _, h in offload._saved]
    offload.onload()
    weight.mul_(2.0)  # the training step changes the values in between
    expected = weight.clone()
    offload.offload([weight, state])
    assert [h.data_ptr() for _, h in offload._saved] == first
    assert offload.host_bytes == (6 + 4) * 4
    offload.onload()
    assert torch.equal(weight, expected)

    bigger = torch.randn(8)  # another storage in that place gets a buffer of its own size
    offload.offload([weight, bigger])
    assert offload.host_bytes == (6 + 8) * 4
    offload.onload()
