"""Single-process parity: the Megatron model's logits equal HF's (float32, CPU, TP=1).

Tolerance: 1e-5 absolute on logits of magnitude ~1 (the two models run the same float32 ops
in a slightly different order; measured differences are ~1e-6).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from vlm_models.megatron import (
    Parallelism,
    build_megatron_model,
    compile_decoder_layers,
    compile_vision_blocks,
    initialize_model_parallel,
    load_hf_weights,
)
from vlm_models.presets import tiny_config

ATOL = 1e-5


@pytest.fixture(scope="module")
def tp1():
    initialize_model_parallel(Parallelism())


def _megatron(config, hf_model):
    model = build_megatron_model(config, Parallelism()).eval()
    load_hf_weights(model, hf_model.state_dict())
    return model


def _packed(cu: torch.Tensor) -> PackedSeqParams:
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


@torch.no_grad()
def test_logits_match_hf_with_images(tp1, tiny_setup, to_megatron_inputs):
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    expected = hf_model(**batch).logits
    model = _megatron(config, hf_model)
    got = model(**inputs["sbhd"])
    valid = inputs["valid"]
    assert got.shape == expected.shape
    assert (got - expected)[valid].abs().max() < ATOL
    assert expected[valid].abs().max() > 0.5  # the comparison is not between near-zero tensors


@torch.no_grad()
def test_packed_thd_matches_per_sample_hf(tp1, tiny_setup, to_megatron_inputs):
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    expected = hf_model(**batch).logits[inputs["valid"]]  # [T, V] in packing order
    model = _megatron(config, hf_model)
    thd = dict(inputs["thd"])
    packed = _packed(thd.pop("cu_seqlens"))
    got = model(**thd, packed_seq_params=packed)[0]
    assert (got - expected).abs().max() < ATOL


@torch.no_grad()
def test_deepstack_and_vision_change_the_logits(tp1, tiny_setup, to_megatron_inputs):
    """Negative control: the parity above would fail without deepstack or the image features."""
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    model = _megatron(config, hf_model)
    reference = model(**inputs["sbhd"])
    for merger in model.visual.deepstack_merger_list:
        for p in merger.parameters():
            p.zero_()
    no_deepstack = model(**inputs["sbhd"])
    valid = inputs["valid"]
    assert (no_deepstack - reference)[valid].abs().max() > 100 * ATOL
    text_only = dict(inputs["sbhd"], pixel_values=None, image_grid_thw=None)
    assert (model(**text_only) - no_deepstack)[valid].abs().max() > 100 * ATOL


@torch.no_grad()
def test_untied_embeddings(tp1, tiny_setup, to_megatron_inputs, make_hf_model):
    _, _, batch = tiny_setup
    config = tiny_config(tie_word_embeddings=False)
    hf_model = make_hf_model(config, seed=1)
    assert not torch.equal(
        hf_model.lm_head.weight, hf_model.model.language_model.embed_tokens.weight
    )
    inputs = to_megatron_inputs(config, batch)
    model = _megatron(config, hf_model)
    assert "language_model.output_layer.weight" in model.state_dict()
    got = model(**inputs["sbhd"])
    expected = hf_model(**batch).logits
    assert (got - expected)[inputs["valid"]].abs().max() < ATOL


def test_image_token_count_mismatch_is_a_clear_error(tp1, tiny_setup, to_megatron_inputs):
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)["sbhd"]
    model = _megatron(config, hf_model)
    broken = dict(
        inputs,
        image_grid_thw=inputs["image_grid_thw"][:1],
        pixel_values=inputs["pixel_values"][:224],
    )
    with pytest.raises(ValueError, match="image tokens"), torch.no_grad():
        model(**broken)


@torch.no_grad()
def test_moe_logits_match_hf_with_images(tp1, tiny_setup, to_megatron_inputs, make_hf_model):
    """Qwen3-VL-MoE shape: 8 experts, top-2 routing (Megatron: top-k then softmax over the k)."""
    _, _, batch = tiny_setup
    config = tiny_config("qwen3-vl-moe-tiny")
    hf_model = make_hf_model(config, seed=6)
    inputs = to_megatron_inputs(config, batch)
    model = _megatron(config, hf_model)
    assert "language_model.decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight" in (
        model.state_dict()
    )
    got = model(**inputs["sbhd"])
    expected = hf_model(**batch).logits
    assert (got - expected)[inputs["valid"]].abs().max() < ATOL


def test_full_activation_recompute_gives_the_same_gradients(tp1, tiny_setup, to_megatron_inputs):
    """Recomputed layers get the deepstack features again (they are a block argument)."""
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(9))
    weights[~inputs["valid"]] = 0.0
    grads = []
    for recompute in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ):
        model = build_megatron_model(config, Parallelism(), **recompute).train()
        load_hf_weights(model, hf_model.state_dict())
        logits = model(**inputs["sbhd"])
        (logits.logsumexp(-1) * weights).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("deepstack_merger_list" in n for n in grads[0])
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, rtol=1e-5, atol=1e-7), name


def test_packed_thd_gradients_equal_padded_batch(tp1, tiny_setup, to_megatron_inputs):
    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    valid = inputs["valid"]
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(10))
    grads = []
    for packed in (False, True):
        model = build_megatron_model(config, Parallelism()).train()
        load_hf_weights(model, hf_model.state_dict())
        if packed:
            thd = dict(inputs["thd"])
            packed_params = _packed(thd.pop("cu_seqlens"))
            logits = model(**thd, packed_seq_params=packed_params)[0]
            loss = (logits.logsumexp(-1) * weights[valid]).sum()
        else:
            logits = model(**inputs["sbhd"])
            loss = (logits.logsumexp(-1)[valid] * weights[valid]).sum()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, rtol=1e-4, atol=1e-6), name


def test_host_side_image_inputs_equal_and_free_the_merge_of_host_syncs(
    tp1, tiny_setup, to_megatron_inputs
):
    """Image-token positions and the tower's inputs computed on the host (the grid kept there)
    give the same logits and gradients as the device path, and the merge, forward and backward,
    then dispatches no op that would make the host wait for a GPU. (transformers' sdpa vision
    attention still reads ``cu_seqlens`` as a list, which on CPU is no op and is not seen.)"""
    from vlm_models.sync_free import HostSyncRecorder

    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)["sbhd"]
    model = _megatron(config, hf_model).train()
    grid = inputs["image_grid_thw"]
    host = dict(
        inputs,
        image_positions=(inputs["input_ids"].reshape(-1) == config.image_token_id).nonzero()[:, 0],
        vision_inputs=model.vision_inputs.compute(grid),
    )

    def merged(**kw):
        embeddings = model.language_model.embedding(input_ids=kw["input_ids"], position_ids=None)
        return model._merge_vision(
            embeddings,
            kw["input_ids"],
            kw["pixel_values"],
            kw["image_grid_thw"],
            image_positions=kw.get("image_positions"),
            vision_inputs=kw.get("vision_inputs"),
        )

    ref_emb, ref_ctx = merged(**inputs)
    with HostSyncRecorder() as seen:
        emb, ctx = merged(**host)
        (emb.square().sum() + ctx.square().sum()).backward()
    assert seen.found == []
    assert torch.equal(emb, ref_emb) and torch.equal(ctx, ref_ctx)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (ref_emb.square().sum() + ref_ctx.square().sum()).backward()
    assert grads and any(n.startswith("visual.") for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(**host), model(**inputs), atol=0, rtol=0)


def test_compiled_layers_trace_whole_and_match_eager(tp1, tiny_setup, to_megatron_inputs):
    """Packed THD forward and backward with every decoder layer compiled (aot_eager: the same
    dynamo/AOTAutograd graphs, no kernel generation): whole graphs, eager's numbers."""
    import torch._dynamo.testing

    config, hf_model, batch = tiny_setup
    inputs = to_megatron_inputs(config, batch)
    valid = inputs["valid"]
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(11))[valid]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        # reset() leaves the process-wide counters: an earlier test's graph breaks (the FSDP
        # actor's compiled CPU vision attention has some) would be counted as ours
        torch._dynamo.utils.counters.clear()
        model = build_megatron_model(config, Parallelism()).train()
        load_hf_weights(model, hf_model.state_dict())
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        if compiled:
            assert (
                compile_decoder_layers(model, backend=counter)
                == config.text_config.num_hidden_layers
            )
        thd = dict(inputs["thd"])
        packed = _packed(thd.pop("cu_seqlens"))
        logits = model(**thd, packed_seq_params=packed)[0]
        (logits.logsumexp(-1) * weights).sum().backward()
        if compiled:  # no graph break, and the layers share their graph (no per-layer recompile)
            assert not torch._dynamo.utils.counters["graph_break"]
            assert 1 <= counter.frame_count < config.text_config.num_hidden_layers
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_logits, eager_grads), (logits, grads) = results
    assert (logits - eager_logits).abs().max() < ATOL
    for name, grad in eager_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_compiled_vision_blocks_match_eager(tp1, tiny_setup, to_megatron_inputs):
    """The HF vision tower compiled block by block (as the FSDP actor does; aot_eager): eager's
    logits and vision gradients. (On CPU its attention runs per image, so it breaks graphs.)"""
    config, hf_model, batch = tiny_setup
    thd = dict(to_megatron_inputs(config, batch)["thd"])
    packed = _packed(thd.pop("cu_seqlens"))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_megatron_model(config, Parallelism()).train()
        load_hf_weights(model, hf_model.state_dict())
        if compiled:
            assert compile_vision_blocks(model, backend="aot_eager") == config.vision_config.depth
        logits = model(**thd, packed_seq_params=packed)[0]
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("visual.")}
        results.append((logits.detach(), grads))
    (eager_logits, eager_grads), (logits, grads) = results
    assert (logits - eager_logits).abs().max() < ATOL
    assert eager_grads and all(g is not None for g in eager_grads.values())
    for name, grad in eager_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name
