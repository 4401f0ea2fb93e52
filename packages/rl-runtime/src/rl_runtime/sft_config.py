"""The SFT loop's settings (`SftLoopConfig`) and a GRPO run's SFT warm-up (`WarmupConfig`),
plain data without torch, so that a launcher parses (and refuses) them before torch loads;
`rl_runtime.sft` runs with them."""

from __future__ import annotations

from dataclasses import dataclass

from rl_algos.optimizer import Schedule
from rl_runtime.config_fields import option


@dataclass
class SftLoopConfig:
    sft_num_steps: int = option(500, "SFT optimizer steps", ge=1)
    sft_batch_size: int = option(64, "conversations per SFT step", ge=1)
    sft_save_interval: int = option(100, "checkpoint every N SFT steps (0: only at the end)", ge=0)
    sft_keep_checkpoints: int = option(2, "how many SFT checkpoints to keep (0: all)", ge=0)
    sft_seed: int = option(1234, "seed of the SFT data order", ge=0)


@dataclass
class WarmupConfig:
    """A GRPO run's SFT warm-up, without --load: a random model learns the answer format. Its
    settings are its own: the trainer's optimizer settings (--lr, --lr-schedule, ...) are the
    GRPO steps'; the warm-up trains at the constant rate --warmup-sft-lr."""

    warmup_sft_steps: int = option(
        0, "without --load: SFT steps to run first (the tiny preset's format warm-up)", ge=0
    )
    warmup_sft_batch_size: int = option(32, "SFT warm-up batch size", ge=1)
    warmup_sft_lr: float = option(
        3e-3,
        "SFT warm-up learning rate, constant (the --lr schedule settings are GRPO's)",
        gt=0,
    )

    def schedule(self) -> Schedule:
        """The warm-up's learning rate: constant, whatever schedule the GRPO steps follow."""
        return Schedule(lr=self.warmup_sft_lr)

    def loop(self, seed: int) -> SftLoopConfig:
        """The warm-up's SFT loop: a checkpoint only at the end."""
        return SftLoopConfig(
            sft_num_steps=self.warmup_sft_steps,
            sft_batch_size=self.warmup_sft_batch_size,
            sft_save_interval=0,
            sft_seed=seed,
        )
