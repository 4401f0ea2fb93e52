"""Context parallelism in the Megatron actor against the same step without it (float32, CPU,
four gloo processes, one launch).

Each model (tiny dense Qwen3-VL, tiny Qwen3.5 with its gated-delta-net layers) runs a GRPO step
from the same initial weights on the same three packed samples (two with an image, one
text-only; lengths that the zigzag split must pad) as:

* ``ref``: no CP (four data-parallel replicas of the whole batch: the same gradient as one,
  scaled by a power of two, which is exact);
* ``cp2``: CP 2 x DP 2, so gradients are reduced over data- and context-parallel ranks;
* ``cp2_tp2_sp``: CP 2 x TP 2 with sequence parallelism (each CP part split again over TP).

Log-probs before and after the step and every weight after it must agree with the
reference's to 1e-5, the gradient norm to a relative 1e-5. The reference step moves weights
by about ``LR`` = 1e-3 (Adam's first step is ``lr * g / (|g| + eps)``); a CP rank that lost
its peers' keys, a gradient counted twice or missing a rank's rows moves log-probs, the norm
and weights by far more, while reordered float32 sums move log-probs by about 1e-6.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from rl_algos import TrainBatch
from rl_algos.optimizer import OptimConfig
from vlm_models.presets import PRESETS

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("cp_worker.py")
WORLD = 4
LR = 1e-3
ATOL = 1e-5
# Adam's first step moves a weight by lr * g / (|g| + eps), whose slope in g is at most
# lr / eps: float32 sums taken in another order change the gradient by up to 5e-9 where it is
# itself that small (measured: the gated delta net's A_log and dt_bias, whose gradients are
# ill-conditioned sums over every token), which at the default eps of 1e-8 moves such a weight
# by up to 5e-4. eps = 1e-6 bounds that at 5e-6, inside the 1e-5 the weights are held to.
EPS = 1e-6
OPTIM = OptimConfig(lr=LR, eps=EPS, weight_decay=0.0, max_grad_norm=1.0)
COMMON = dict(optim=OPTIM, export_dtype="float32", seed=0)
LAYOUTS = {
    "ref": dict(),
    "cp2": dict(cp=2),
    "cp2_tp2_sp": dict(cp=2, tp=2, sp=True),
}
IDS = dict(
    vocab_size=151936,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
MODELS = {"dense": dict(model="qwen3-vl-tiny")}
if "qwen3.5-tiny" in PRESETS:  # two KV heads (four query heads) so that TP 2 splits them
    q35 = dict(IDS, num_key_value_heads=2, num_attention_heads=4)
    MODELS["q35"] = dict(model="qwen3.5-tiny", model_overrides=q35)


def _batch(geo3k_dir: Path, qwen3vl_dir: Path) -> TrainBatch:
    """Image prompt, text-only prompt, image prompt; responses of 24, 9 and 17 tokens (the
    loss rows then fall on both CP ranks)."""
    import pandas as pd
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen3vl_dir)
    rows = pd.read_parquet(geo3k_dir / "validation.parquet").head(2)
    images = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows.iloc]
    gen = torch.Generator().manual_seed(0)
    fields: dict[str, list] = {
        k: [] for k in ("input_ids", "loss_mask", "advantages", "pixel_values", "image_grid_thw")
    }
    for image, text, sign, n in (
        (images[0], "Find x.", 1.0, 24),
        (None, "2+2?", -1.0, 9),
        (images[1], "Why?", 0.5, 17),
    ):
        content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        out = processor(
            text=[prompt], images=[image] if image else None, return_tensors="pt",
            max_pixels=32 * 32 * 16,
        )  # fmt: skip
        ids = torch.cat([out["input_ids"][0], torch.randint(0, 150000, (n,), generator=gen)])
        mask = torch.zeros(len(ids))
        mask[-n:] = 1.0
        fields["input_ids"].append(ids)
        fields["loss_mask"].append(mask)
        fields["advantages"].append(mask * sign)
        fields["pixel_values"].append(out.get("pixel_values"))
        fields["image_grid_thw"].append(out.get("image_grid_thw"))
    return TrainBatch(**fields)


@pytest.fixture(scope="module")
def results(geo3k_dir, qwen3vl_dir, tmp_path_factory, launch_ranks) -> dict[str, dict]:
    """Rank 0's results (every rank holds the whole batch's log-probs)."""
    batch = _batch(geo3k_dir, qwen3vl_dir)
    assert all(n % 4 for n in batch.lengths[:2])  # the split pads samples
    case = dict(config=COMMON, model_configs=MODELS, models=dict.fromkeys(MODELS, LAYOUTS))
    case["batch"] = batch
    workdir = tmp_path_factory.mktemp("megatron_cp")
    torch.save(case, workdir / "case.pt")
    out = launch_ranks(WORKER, workdir, WORLD, OMP_NUM_THREADS="1")
    for r in range(1, WORLD):  # every rank returns the whole log-probs
        for key, res in out[r].items():
            for a, b in zip(res["after"], out[0][key]["after"], strict=True):
                assert torch.equal(a, b), (r, key)
    return out[0]


def _max_diff(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2_sp"])
def test_context_parallel_step_matches_no_cp(results, model, layout):
    ref, res = results[f"{model}_ref"], results[f"{model}_{layout}"]
    assert ref["update"] > 0.5 * LR  # the step moved the weights
    assert _max_diff(ref["after"], ref["before"]) > 1e-3  # ... and the log-probs
    assert min(float(t.abs().max()) for t in ref["before"]) > 1.0  # real log-probs scored
    assert _max_diff(res["before"], ref["before"]) < ATOL
    assert abs(res["metrics"]["loss"] - ref["metrics"]["loss"]) < ATOL
    grad_norm = ref["metrics"]["grad_norm"]
    assert grad_norm > 1.0  # clipping is exercised
    assert abs(res["metrics"]["grad_norm"] - grad_norm) < 1e-5 * grad_norm
    assert res["weight_diff"] < ATOL, res["worst"]
    assert _max_diff(res["after"], ref["after"]) < ATOL
