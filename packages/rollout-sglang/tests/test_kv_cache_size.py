"""How the transformers engine sizes its KV cache at each allocation (``hf.kv_cache.cache_size``).

On an H200, colocated with the FSDP trainer, the Qwen3.5-35B-A3B 8-layer cut's engine sized its
cache as half of the memory free, less 256 slots of gated-delta-net state (12.4 MiB each, 3.1
GiB): the trainer kept more than planned, the states took the whole share, and the cache held
1 token ("needs 487 KV-cache tokens, the cache holds 1"). A planned size is now checked against
the free memory (one clear error), the states take at most half the share, and every allocation
says in one line what it got and why. The GPU's free memory is the one input a CPU cannot give:
``torch.cuda.mem_get_info`` is set to the figures of that run.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rollout_sglang.hf.kv_cache import CacheSize, KVCache, KVCacheTooSmall, cache_size

GiB = 1 << 30
CUDA = torch.device("cuda")
PER_TOKEN = 4096  # the cut's keys and values: 2 full-attention layers of 2 x 256 bf16 each
SLOT = 6 * (8192 * 4 * 2 + 4 * 32 * 128 * 128)  # its 6 gated-delta-net layers' states


@pytest.fixture
def free_gib(monkeypatch):
    """Set the free memory ``cache_size`` sees on ``CUDA`` (of a 139.8 GiB GPU)."""

    def set_free(gib: float) -> None:
        monkeypatch.setattr(
            torch.cuda, "mem_get_info", lambda device=None: (int(gib * GiB), int(139.8 * GiB))
        )

    return set_free


def _size(**kwargs) -> CacheSize:
    options = (
        dict(device=CUDA, bytes_per_token=PER_TOKEN, mem_fraction=0.5, cpu_tokens=65536) | kwargs
    )
    return cache_size(**options)


def test_a_planned_cache_the_free_memory_cannot_hold_is_one_clear_error(free_gib):
    """The plan's tokens and the slots' states against the memory free: taken as planned where
    they fit, else an error naming both, the free memory and who is likely to hold it."""
    free_gib(48.0)
    size = _size(planned_tokens=5_000_000, slot_bytes=SLOT, max_slots=256)
    assert size.tokens == 5_000_000 and size.slots is None
    assert size.how.startswith("as planned (cache_tokens); 48.00 GiB were free"), size.how
    free_gib(4.8)
    with pytest.raises(KVCacheTooSmall) as err:
        _size(planned_tokens=800_000, slot_bytes=SLOT, max_slots=256)
    message = str(err.value)
    assert "the planned 800000 tokens (3.05 GiB) and 3.09 GiB of 256 slots'" in message
    assert "need 6.15 GiB, but 4.80 of the 139.8 GiB of cuda are free" in message
    assert "a colocated trainer" in message and "release_cache" in message


def test_recurrent_states_leave_the_keys_half_of_the_share(free_gib):
    """Without a plan: half of 4.8 GiB free is less than 256 slots' states (3.1 GiB), which
    left a 1-token cache; the states now take at most half of the share, for fewer slots, and
    the cache holds the rollout's sequences in turns. Where the states fit, nothing changes."""
    free_gib(4.8)
    size = _size(slot_bytes=SLOT, max_slots=256)
    budget = int(4.8 * GiB * 0.5)
    assert size.slots == budget // 2 // SLOT == 99
    assert size.tokens == (budget - 99 * SLOT) // PER_TOKEN
    assert size.tokens // 1408 >= 99  # every slot holds a 1,408-token sequence
    cache = KVCache(
        num_layers=2,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        budget_tokens=lambda: size,
    )
    cache.fit(1408, 256)
    assert (cache.slots, cache.seq_cap) == (99, 1408)
    assert "of 256: the states may take half" in size.how, size.how
    free_gib(48.0)
    roomy = _size(slot_bytes=SLOT, max_slots=256)
    assert roomy.slots is None
    assert roomy.tokens == (int(48 * GiB * 0.5) - 256 * SLOT) // PER_TOKEN


def test_each_allocation_logs_its_tokens_and_where_they_came_from(caplog):
    """On the CPU the sizes are fixed (``cpu_tokens``, or the planned ones); each allocation,
    the first and each after a release, says how many tokens and from where."""
    cpu = torch.device("cpu")
    plain = cache_size(device=cpu, bytes_per_token=PER_TOKEN, mem_fraction=0.5, cpu_tokens=64)
    assert (plain.tokens, plain.slots) == (64, None)
    planned = cache_size(
        device=cpu, bytes_per_token=PER_TOKEN, mem_fraction=0.5, cpu_tokens=64, planned_tokens=96
    )
    assert planned.tokens == 96
    sizes = iter([plain, planned])
    cache = KVCache(
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=cpu,
        budget_tokens=lambda: next(sizes),
    )
    with caplog.at_level(logging.INFO, logger="glimpse.memory"):
        cache.allocate()
        cache.release()
        cache.allocate()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")]
    assert lines == [
        "KV cache: 64 tokens (0.00 GiB) on cpu: the fixed size on cpu (cache_tokens unset)",
        "KV cache: 96 tokens (0.00 GiB) on cpu: cache_tokens (planned)",
    ]


@pytest.mark.parametrize(
    ("preset", "layers"),
    [("qwen3.5-tiny", None), ("qwen3.5-35b-a3b", None), ("qwen3.5-35b-a3b", 8)],
)
def test_the_plan_counts_the_states_the_engine_holds_per_slot(preset, layers):
    """What the colocation plan sets aside per sequence (``ModelShape.state_bytes_per_sequence``,
    from the config: ``vlm_models.linear_attention.linear_state_bytes``) is what the engine's
    decoder holds per slot (``LinearStates.bytes_per_slot``, from the built layers), at the
    engine's bf16; the 8-layer cut's is this file's ``SLOT``. Built on the meta device."""
    from rollout_sglang.hf.decode import TextDecoder
    from vlm_models.build import build_model
    from vlm_models.presets import PRESETS, preset_config
    from vlm_models.sources import model_shape

    if preset not in PRESETS:
        pytest.skip("transformers without Qwen3.5")
    config = preset_config(preset, **({} if layers is None else {"num_hidden_layers": layers}))
    with torch.device("meta"):
        model = build_model(config, dtype=torch.bfloat16)
    states = TextDecoder(model, moe="dense").linear_states(torch.device("meta"))
    assert states is not None and states.dtype == torch.bfloat16
    planned = model_shape(config)["state_bytes_per_sequence"]
    assert planned == states.bytes_per_slot() > 0
    if layers == 8:
        assert planned == SLOT


def test_an_engine_whose_planned_cache_does_not_fit_fails_every_request_with_the_reason(
    monkeypatch,
):
    """The engine does not raise out of generate (a Ray task error with a traceback): every
    request fails with the allocation's message, which the loop's rollout guard stops the run
    with, as for a rollout that returned nothing (rl_runtime.rollout_guard)."""
    from rollout_sglang.hf import engine as engine_module
    from rollout_sglang.hf.engine import HFEngine
    from rollout_sglang.types import GenerateRequest, SamplingParams
    from vlm_models.build import build_model

    def too_small(**_: object) -> CacheSize:
        raise KVCacheTooSmall("KV cache: the planned 800000 tokens need 6.15 GiB, 4.80 are free")

    monkeypatch.setattr(engine_module, "cache_size", too_small)
    engine = HFEngine(build_model("qwen3.5-tiny"), max_batch_size=2)
    requests = [GenerateRequest(input_ids=torch.arange(100, 100 + n)) for n in (5, 9)]
    out = engine.generate(requests, SamplingParams(max_new_tokens=4, seed=0))
    assert [c.ok for c in out] == [False, False]
    assert all("the planned 800000 tokens" in (c.error or "") for c in out)
    assert [c.prompt_length for c in out] == [5, 9]
