"""geo3k_grpo's configuration: the packages' own configs as one tree (`GrpoConfig`'s sections
with this app's engines and trainers), the recipe's values and the presets. Nothing is
declared here a second time: each setting is its package's field.

Every setting has a dotted flag (`--trainer.optim.lr`, `--loop.num-rollout`) and a short one
(`--lr`, `--num-rollout`: the names of the README's migration table); `--backend` picks the
trainer section. The environment names (`GEO3K_*`, then the recipes' `MILES_SCRIPT_*` and
`SLIME_SCRIPT_*`) are `rl_runtime.recipe_env_aliases`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trainers_fsdp.build
import trainers_megatron.build
from rl_runtime import ActorClass, choice, recipe_env_aliases, section
from rl_runtime.grpo_app import GrpoConfig
from rollout_sglang import RolloutConfig
from trainers_fsdp import FsdpConfig
from trainers_megatron import MegatronConfig

DESCRIPTION = """GRPO on Geometry3K (the miles / slime geo3k VLM recipe), `uv run apps/geo3k_grpo`.
Defaults are the recipe's: 3000 rollouts of 64 prompts x 8 samples, global batch 512, the
problem as is in the chat template, temperature 0.8, responses up to 4096 tokens, eps_clip
0.2 / 0.28, no KL, seq-mean-token-mean, lr 1e-6 constant, Adam betas 0.9 / 0.98, weight decay
0.1, the math reward, evaluation at step 0 and every 20 steps on the test split.
--preset tiny runs the whole thing on a CPU in minutes (with a short SFT warm-up first)."""

TRAINERS = {"megatron": MegatronConfig, "fsdp": FsdpConfig}
#: each backend's actor class, imported on call (in a trainer rank; its settings above name
#: nothing they build)
ACTORS: dict[str, ActorClass] = {
    "megatron": trainers_megatron.build.actor_class,
    "fsdp": trainers_fsdp.build.actor_class,
}
ENV_ALIASES = recipe_env_aliases("GEO3K")


@dataclass
class Geo3kGrpoConfig(GrpoConfig):
    """`GrpoConfig`'s sections, with the rollout engines' and the trainers' of this app."""

    rollout: RolloutConfig = section(RolloutConfig)
    trainer: MegatronConfig | FsdpConfig = choice(TRAINERS, by="backend")


#: The recipe's values where a package's default is not the recipe's (the rest are).
DEFAULTS: dict[str, Any] = {
    "backend": "megatron",
    "output_dir": "runs/geo3k_grpo",
    "wandb_project": "glimpse-geo3k",
    # the problem as the row has it, in the chat template (--input-key problem
    # --apply-chat-template); --template boxed adds an instruction to answer in \boxed{}
    "template": "none",
    # no --calculate-per-token-loss: each sample's tokens averaged, then the samples
    "loss_agg_mode": "seq-mean-token-mean",
    "num_rollout": 3000,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A CPU run in minutes: a random-init tiny Qwen3-VL, the offline tiny processor and the
    # synthetic "what colour is the square" task. The warm-up teaches the answer format (greedy
    # answers are right, sampled ones mostly are not); GRPO then raises the sampled reward.
    "tiny": {
        "backend": "fsdp",
        "num_gpus": 0,
        "model_name": "qwen3-vl-tiny",
        "tokenizer": "tiny",
        "dataset": "synthetic:color",
        "attn_implementation": "sdpa",
        "output_dir": "runs/geo3k_grpo_tiny",
        # 16-token replies: the tests' learning figures (2026-12-01/02) were measured with it
        "loss_agg_mode": "token-mean",
        "rollout_engine": "hf",
        "num_rollout": 30,
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "global_batch_size": 64,
        "rollout_temperature": 1.0,
        "rollout_max_response_len": 16,
        "eval_interval": 10,
        "eval_max_prompts": 32,
        "save_interval": 10,
        "lr": 5e-4,
        "weight_decay": 0.0,
        "reward_workers": 1,
        "warmup_sft_steps": 36,
        "warmup_sft_batch_size": 32,
        "warmup_sft_lr": 3e-3,
    },
}


#: The slime recipe's Qwen3.5-35B-A3B run (examples/geo3k_vlm/run_geo3k_qwen35.sh, MoE branch)
#: on one node of 8 GPUs, colocated; its GRPO, optimizer and rollout values are the recipe's
#: defaults above. Glimpse packs samples into micro-batches where slime runs one at a time
#: (micro-batch 1, no dynamic batch size: megatron-core's gated delta net refuses packed rows;
#: ours resets its state at each sample's boundary, so packing gives the same log-probs).
PRESETS["qwen3.5-35b-a3b"] = {
    "backend": "megatron",
    "num_gpus": 8,
    "model_name": "Qwen3.5-35B-A3B",
    "output_dir": "runs/geo3k_grpo_qwen35_35b_a3b",
    # attention over TP2 + SP (two KV groups: TP 2 at most), whole experts over EP8
    "tensor_parallel": 2,
    "sequence_parallel": True,
    "expert_parallel": 8,
    "expert_tensor_parallel": 1,
    "recompute": "full",
    # SGLang as the script's SGLANG_ARGS (slime 624b824, run_geo3k_qwen35.sh lines 110-123):
    # one engine of 8 GPUs, experts over EP8, decode graphs up to 256, 512 requests at once,
    # speculative decoding from the checkpoint's MTP head (EAGLE, 2 steps, top-1, 3 tokens)
    "rollout_engine": "sglang",
    "rollout_num_gpus_per_engine": 8,
    "sglang_ep_size": 8,
    "sglang_mem_fraction_static": 0.7,
    "sglang_cuda_graph_bs": (1, 2, 4, *range(8, 257, 8)),
    "sglang_speculative_algorithm": "EAGLE",
    "sglang_speculative_num_steps": 2,
    "sglang_speculative_eagle_topk": 1,
    "sglang_speculative_num_draft_tokens": 3,
    "sglang_max_running_requests": 512,
    # the script's `--rm-type deepscaler`: only the answer after `</think>` counts
    "reward_type": "deepscaler",
}
