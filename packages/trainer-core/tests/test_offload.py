"""HostCopies: offloads reuse one host buffer per tensor, modules keep their objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer_core import HostCopies
from vlm_models.build import build_model

CPU = torch.device("cpu")


def test_offloads_reuse_the_host_buffer_and_round_trip_exactly():
    copies = HostCopies(pin=False)
    x = torch.randn(1000)
    first = copies.to_host("x", x)
    assert torch.equal(first, x) and first.data_ptr() != x.data_ptr()  # a copy, not a view
    back = copies.to_device(first, CPU)
    y = back * 2
    second = copies.to_host("x", y)
    assert second.data_ptr() == first.data_ptr()  # same buffer, written again
    assert torch.equal(second, x * 2)
    assert copies.nbytes == 4000
    # a new shape or dtype under the same key gets its own buffer
    assert copies.to_host("x", torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert copies.nbytes == 6


def test_move_module_keeps_parameter_and_buffer_objects():
    model = build_model("qwen3-vl-tiny")
    model.register_buffer("extra", torch.arange(5.0))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copies = HostCopies(pin=False)
    copies.move_module(model, CPU)
    held = copies.nbytes
    assert held == sum(t.numel() * t.element_size() for t in [*params.values(), *buffers.values()])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    copies.move_module(model, CPU)  # a second offload writes the same buffers
    assert copies.nbytes == held
    assert all(params[k] is p for k, p in model.named_parameters())
    assert all(buffers[k] is b for k, b in model.named_buffers())
    tied = dict(model.named_parameters(remove_duplicate=False))  # lm_head shares the embedding
    for name, value in model.state_dict().items():
        expected = before[name] * 3 if name in tied else before[name]
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_tied_parameters_move_once():
    emb = nn.Embedding(7, 4)
    head = nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    copies = HostCopies(pin=False)
    copies.move_module(model, CPU)
    assert copies.nbytes == 7 * 4 * 4
    assert model["head"].weight is model["emb"].weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_pinned_buffers_are_locked_at_their_own_size():
    """A 65 MiB buffer from the caching host allocator would lock 128 MiB; registered, it
    is page-locked (copies from it are DMA) and holds what it was asked for."""
    from trainer_core import pinned_empty

    n = (65 << 20) // 4
    host = pinned_empty(n, torch.float32)
    assert host.is_pinned() and host.numel() == n
    device = torch.arange(n, dtype=torch.float32, device="cuda")
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, device.cpu())
    assert not pinned_empty(n, torch.float32, pin=False).is_pinned()
