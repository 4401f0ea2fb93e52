"""MegatronActor against a plain transformers GRPO step (float32, CPU, two gloo processes).

The reference: the HF model with the same random init, log-probs of each sample alone,
``rl_algos.grpo_loss`` (token-mean over the whole batch), gradient clipping, one AdamW step.
The actor runs it as TP=2 with sequence parallelism (both ranks hold both samples; megatron-core's
plain optimizer) and as DP=2 (one sample per rank; the distributed optimizer).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos import GrpoLossConfig, TrainBatch, aligned_logprobs, grpo_loss
from rl_algos.optimizer import OptimConfig
from vlm_models.build import build_model
from vlm_models.presets import tiny_config

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("actor_worker.py")
LR = 1e-3
COMMON = dict(
    model="qwen3-vl-tiny",
    optim=OptimConfig(lr=LR, weight_decay=0.0, max_grad_norm=1.0),
    export_dtype="float32",
)
SCENARIOS = {
    # megatron-core's plain optimizer (the whole state on each rank)
    "tp2_sp": dict(
        config=dict(tp=2, sp=True, reference_model=True, distributed_optimizer=False),
        share=True,
        resume=True,
    ),
    # the distributed optimizer: each rank saves and resumes its own shard of the state
    "dp2": dict(config=dict(tp=1), share=False, sft=True, nonfinite=True, resume=True),
}


def _batch(geo3k_dir: Path, qwen3vl_dir: Path, config) -> TrainBatch:
    """Two real prompts (image + question) with 12 response tokens each."""
    import pandas as pd
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen3vl_dir)
    rows = pd.read_parquet(geo3k_dir / "validation.parquet").head(2)
    gen = torch.Generator().manual_seed(0)
    fields: dict[str, list] = {
        k: [] for k in ("input_ids", "loss_mask", "advantages", "pixel_values", "image_grid_thw")
    }
    for sign, (_, row) in zip((1.0, -0.5), rows.iterrows(), strict=True):
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": row["problem"]}],
            }
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out = processor(text=[text], images=[image], return_tensors="pt", max_pixels=64 * 32 * 32)
        prompt = out["input_ids"][0]
        response = torch.randint(0, 150000, (12,), generator=gen)
        ids = torch.cat([prompt, response])
        mask = torch.zeros(len(ids))
        mask[len(prompt) :] = 1.0
        fields["input_ids"].append(ids)
        fields["loss_mask"].append(mask)
        fields["advantages"].append(mask * sign)
        fields["pixel_values"].append(out["pixel_values"])
        fields["image_grid_thw"].append(out["image_grid_thw"])
    return TrainBatch(**fields)


def _hf_logprobs(model, batch: TrainBatch) -> list[torch.Tensor]:
    out = []
    for i in range(len(batch)):
        ids = batch.input_ids[i]
        logits = model(
            input_ids=ids[None],
            pixel_values=batch.pixel_values[i],
            image_grid_thw=batch.image_grid_thw[i],
            mm_token_type_ids=(ids == model.config.image_token_id).int()[None],
        ).logits[0]
        out.append(aligned_logprobs(logits, ids, [0, len(ids)]))
    return out


@pytest.fixture(scope="module")
def run(geo3k_dir, qwen3vl_dir, tmp_path_factory, launch_ranks):
    torch.manual_seed(0)  # as the actor does before its random init
    model = build_model(tiny_config())
    batch = _batch(geo3k_dir, qwen3vl_dir, model.config)
    with torch.no_grad():
        before = _hf_logprobs(model, batch)
    batch.old_logprobs = [t.clone() for t in before]
    lp = torch.cat(_hf_logprobs(model, batch))
    cu = [0, batch.lengths[0], batch.num_tokens]
    loss, _ = grpo_loss(
        lp,
        old_logprobs=torch.cat(batch.old_logprobs),
        advantages=torch.cat(batch.advantages),
        loss_mask=torch.cat(batch.loss_mask),
        cu_seqlens=cu,
        config=GrpoLossConfig(),
        denominator=float(sum(m.sum() for m in batch.loss_mask)),
    )
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0).step()
    with torch.no_grad():
        after = _hf_logprobs(model, batch)

    workdir = tmp_path_factory.mktemp("megatron_actor")
    torch.save(dict(config=COMMON, scenarios=SCENARIOS, batch=batch), workdir / "case.pt")
    results = launch_ranks(WORKER, workdir, 2)
    reference = dict(
        before=before,
        after=after,
        masks=batch.loss_mask,
        loss=float(loss),
        grad_norm=grad_norm,
        state=model.state_dict(),
    )
    return reference, results


def _close(got: list[torch.Tensor], expected: list[torch.Tensor], masks=None) -> float:
    """Largest difference, over the loss tokens when ``masks`` are given (the actor scores only
    those; other positions hold 0, as the token alignment convention allows)."""
    masks = masks or [torch.ones_like(e) for e in expected]
    diffs = [(g - e)[m > 0].abs() for g, e, m in zip(got, expected, masks, strict=True)]
    return max(float(d.max()) for d in diffs) if diffs else 0.0


def test_tp_sp_step_matches_hf(run):
    ref, results = run
    for r in range(2):
        res = results[r]["tp2_sp"]
        assert _close(res["before"], ref["before"], ref["masks"]) < 1e-5
        # positions outside the loss mask are not scored
        unscored = zip(res["before"], ref["masks"], strict=True)
        assert all(float(t[m == 0].abs().max()) == 0.0 for t, m in unscored)
        assert abs(ref["loss"]) > 0.1
        assert abs(res["metrics"]["loss"] - ref["loss"]) < 1e-6
        assert ref["grad_norm"] > 1.0  # clipping is exercised
        assert abs(res["metrics"]["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"]
        moved = _close(ref["after"], ref["before"], ref["masks"])
        assert moved > 1e-2  # the step changed the model
        assert _close(res["after"], ref["after"], ref["masks"]) < 1e-3


def test_data_parallel_step_matches_hf(run):
    ref, results = run
    for r in range(2):
        res = results[r]["dp2"]
        assert _close(res["before"], [ref["before"][r]], [ref["masks"][r]]) < 1e-5
        assert abs(res["metrics"]["loss"] - ref["loss"]) < 1e-6  # global, not this rank's
        assert _close(res["after"], [ref["after"][r]], [ref["masks"][r]]) < 1e-3


def test_sft_step_loss_is_the_global_token_mean_nll(run):
    ref, results = run
    mask = [m > 0 for m in ref["masks"]]
    expected = -sum(float(a[m].sum()) for a, m in zip(ref["after"], mask, strict=True)) / sum(
        int(m.sum()) for m in mask
    )
    for r in range(2):
        assert abs(results[r]["dp2"]["sft"]["loss"] - expected) < 1e-3


@pytest.mark.parametrize("scenario", ["tp2_sp", "dp2"])
def test_checkpoint_resume_is_exact(run, scenario):
    _, results = run
    for r in range(2):
        res = results[r][scenario]
        assert all(
            torch.equal(a, b) for a, b in zip(res["second"], res["second_resumed"], strict=True)
        )
        # the resumed step is a real one: a second update moved the model again
        assert any(not torch.equal(a, b) for a, b in zip(res["after"], res["second"], strict=True))


def test_distributed_optimizer_checkpoint_holds_this_ranks_shard(run):
    """Each DP rank's file keeps AdamW moments for about half of the parameters; the plain
    optimizer's holds them all."""
    _, results = run
    for r in range(2):
        sharded, whole = results[r]["dp2"], results[r]["tp2_sp"]
        assert 0.4 < sharded["saved_moments"] / sharded["trainable"] < 0.6
        assert whole["saved_moments"] == whole["trainable"]


@pytest.mark.parametrize("scenario", ["tp2_sp", "dp2"])
def test_export_has_hf_names(run, scenario):
    ref, results = run
    expected = sorted(k for k in ref["state"] if k != "lm_head.weight")
    assert results[0][scenario]["exported_keys"] == expected


def test_reference_model_keeps_the_initial_weights(run):
    """After the update the reference still scores as the policy did before it."""
    ref, results = run
    for r in range(2):
        res = results[r]["tp2_sp"]
        assert _close(res["reference_after"], res["before"], ref["masks"]) == 0.0
        assert _close(res["reference_after"], res["after"], ref["masks"]) > 1e-3


def test_nonfinite_loss_skips_the_update(run):
    _, results = run
    for r in range(2):
        res = results[r]["dp2"]
        assert res["nonfinite"]["update_skipped"] == 1.0
        assert res["nonfinite"]["grad_norm"] != res["nonfinite"]["grad_norm"]  # NaN
        assert not res["nonfinite_moved"]


def test_tampered_checkpoint_is_refused_without_running_code(run):
    _, results = run
    for r in range(2):
        assert results[r]["tp2_sp"]["tampered"] == "refused"
        assert not results[r]["tp2_sp"]["tampered_code_ran"]
