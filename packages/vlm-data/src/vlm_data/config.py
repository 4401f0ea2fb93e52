"""`DataConfig`: which rows, which columns, which prompt template. Plain data, light to import:
the launchers parse it (and refuse a bad value) before transformers loads."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Prompt templates by name. `{problem}` is the row's problem text, placeholders included.
TEMPLATES: dict[str, str] = {
    # The problem as it is, as the reference recipes (miles, slime) feed geo3k.
    "none": "{problem}",
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    # The R1-style template of EasyR1 and verl's geo3k example.
    "think-boxed": (
        "{problem} You FIRST think about the reasoning process as an internal monologue and then "
        "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> "
        "tags. The final answer MUST BE put in \\boxed{{}}."
    ),
}

#: `dataset` names of the built-in synthetic tasks (`synthetic:color`, ...).
SYNTHETIC = "synthetic"


def _setting(default: object, help: str, **bounds: object) -> object:
    return field(default=default, metadata={"help": help, **bounds})


@dataclass
class DataConfig:
    """The dataset and how its rows become prompts (settings of `vlm_data.prompt_source`)."""

    dataset: str = _setting(
        "chenhegu/geo3k_imgurl",
        "dataset: hub name, local parquet/jsonl file or folder, or 'synthetic[:task]'",
    )
    train_split: str = _setting("train", "training split")
    eval_split: str = _setting("test", "evaluation split (falls back to 'validation')")
    prompt_key: str = _setting("problem", "column with the question (and <image> placeholders)")
    answer_key: str = _setting("answer", "column with the ground-truth answer")
    image_key: str = _setting("images", "column with the images")
    template: str = _setting("boxed", "prompt template", choices=tuple(TEMPLATES))
    max_prompt_length: int | None = _setting(None, "drop (and count) longer prompts", ge=1)
    min_pixels: int | None = _setting(None, "image processor min pixels", ge=1)
    max_pixels: int | None = _setting(None, "image processor max pixels", ge=1)
    synthetic_train_size: int = _setting(1024, "synthetic task: training rows", ge=1)
    synthetic_eval_size: int = _setting(64, "synthetic task: evaluation rows", ge=1)

    def check(self) -> None:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"--min-pixels {self.min_pixels} is above --max-pixels {self.max_pixels}"
            )

    @property
    def synthetic_task(self) -> str | None:
        """The synthetic task `dataset` names, or None for a real dataset."""
        if self.dataset == SYNTHETIC or self.dataset.startswith(SYNTHETIC + ":"):
            return self.dataset.partition(":")[2] or "count-dots"
        return None
