"""The log-prob gap between the transformers engine and the FSDP trainer, per compute dtype.

The figure the GRPO loop's alarm judges (``rl_runtime.logprob_guard``): the mean over response
tokens of |trainer - engine| log-prob, for the same weights and the same sampled responses.
The engine samples ``--prompts`` x ``--samples`` responses of the synthetic colour task at
temperature 1; the trainer recomputes their log-probs; both sides compute in each ``--dtypes``
entry (the weights of an HF folder, e.g. a tiny run's ``hf/``). On a CPU the engine runs in
bfloat16 / float16 only here (the launcher keeps it in float32 there). Prints one line per
dtype: mean and max of the gap over the response tokens.

    uv run python tools/logprob_gap.py runs/geo3k_grpo_tiny/hf
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an HF folder (the tiny preset's run folder's hf/)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    from rl_runtime.rollout_batch import build_train_batch
    from rollout_sglang.hf.engine import ENGINE_MODEL_OPTIONS, HFEngine
    from rollout_sglang.types import GenerateRequest, SamplingParams
    from trainers_fsdp import FsdpConfig
    from trainers_fsdp.actor import FsdpActor
    from vlm_data.processor import tiny_processor
    from vlm_data.prompts import PromptBuilder
    from vlm_data.synthetic import make_synthetic_rows
    from vlm_models.build import build_model

    proc = tiny_processor()
    builder = PromptBuilder(proc, template="none")
    rows = make_synthetic_rows(args.prompts, task="color")
    prompts = [builder.build(r, i) for i, r in enumerate(rows)]
    eos = [proc.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    samples = [p for p in prompts for _ in range(args.samples)]
    results = {}
    for name in args.dtypes.split(","):
        model = build_model(
            args.model, dtype=getattr(torch, name), device="cpu", **ENGINE_MODEL_OPTIONS
        )
        engine = HFEngine(model, device="cpu", eos_token_ids=eos)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
        completions = engine.generate([GenerateRequest.from_prompt(p) for p in samples], params)
        # as the GRPO loop does: a response that writes an image placeholder has no pixels
        # behind it, and the trainer refuses it (the loop drops it: rl_runtime.loop)
        placeholders = {model.config.image_token_id, getattr(model.config, "video_token_id", None)}
        pairs = [
            (p, c)
            for p, c in zip(samples, completions, strict=True)
            if c.token_ids and not placeholders & set(c.token_ids)
        ]
        batch = build_train_batch(
            [p for p, _ in pairs], [c for _, c in pairs], torch.zeros(len(pairs))
        )
        trainer = FsdpActor(
            FsdpConfig(model=args.model, device="cpu", attn_implementation="sdpa", param_dtype=name)
        )
        old = trainer.compute_logprobs(batch)
        assert batch.rollout_logprobs is not None  # the transformers engine reports them
        gaps = torch.cat(
            [
                (o - r)[m.bool()].abs()
                for o, r, m in zip(old, batch.rollout_logprobs, batch.loss_mask, strict=True)
            ]
        )
        results[name] = {"mean": gaps.mean().item(), "max": gaps.max().item(), "tokens": len(gaps)}
        print(
            f"{name}: mean {results[name]['mean']:.3g}, max {results[name]['max']:.3g} over "
            f"{len(gaps)} response tokens",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
