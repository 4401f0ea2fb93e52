"""Which weight names SGLang's Qwen3-VL loader consumes: a check before any bucket is sent.

SGLang's ``Qwen3VLForConditionalGeneration.load_weights`` (sglang 0.5.23
``srt/models/qwen3_vl.py``) renames each HF name and then silently skips any name that is not
one of its parameters (``if name in params_dict ... else: continue``). A tensor renamed on our
side would leave the engine on stale weights without a word. :func:`sglang_param_name` mirrors
that renaming; :class:`WeightNameCheck` knows the engine's parameters (the renamed names of the
checkpoint it loaded at start) and fails loudly on a name that would land nowhere. The mirror
is tested against the real ``load_weights`` of the pinned wheel (``tests/test_sglang_real.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

# (SGLang parameter, HF shard) of the text model's fused projections, in the loader's order
# (``stacked_params_mapping`` of ``Qwen3VLForConditionalGeneration.load_weights``).
_STACKED = (
    (".qkv_proj", ".q_proj"),
    (".qkv_proj", ".k_proj"),
    (".qkv_proj", ".v_proj"),
    ("gate_up_proj", "up_proj"),
    ("gate_up_proj", "gate_proj"),
)


def sglang_param_name(name: str) -> str | None:
    """The SGLang parameter an HF weight name loads into, or None for a name the loader
    drops on purpose (rotary ``inv_freq`` buffers)."""
    if "rotary_emb.inv_freq" in name:
        return None
    if "language_model" in name:
        name = name.replace("model.language_model.", "model.")
    if "visual" in name:  # the vision tower: its fused qkv keeps HF's layout, renamed
        return name.replace("attn.qkv.", "attn.qkv_proj.").replace("model.visual.", "visual.")
    for param, shard in _STACKED:
        if shard in name:
            return name.replace(shard, param)
    return name


class WeightNameCheck:
    """The parameter names of a running SGLang Qwen3-VL engine, and the check against them.

    ``params`` are SGLang parameter names; :meth:`from_names` builds them from the HF names of
    the checkpoint the engine was started from (SGLang consumed exactly those at start), and
    :meth:`from_checkpoint` reads those names from a local folder's safetensors files.
    """

    def __init__(self, params: Iterable[str]) -> None:
        self.params = set(params)

    @classmethod
    def from_names(cls, hf_names: Iterable[str]) -> WeightNameCheck:
        params = {p for n in hf_names if (p := sglang_param_name(n)) is not None}
        params.add("lm_head.weight")  # SGLang always has it (tied: the embedding itself)
        return cls(params)

    @classmethod
    def from_checkpoint(cls, model_path: str | Path) -> WeightNameCheck | None:
        """From ``model.safetensors.index.json`` or ``model.safetensors`` of a local folder;
        None (and a log line) where there is none, e.g. a hub id not downloaded yet."""
        folder = Path(model_path)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return cls.from_names(json.loads(index.read_text())["weight_map"])
        single = folder / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return cls.from_names(f.keys())
        logger.info("no safetensors in %s: weight names sent to SGLang are not checked", folder)
        return None

    def unknown(self, names: Iterable[str]) -> list[str]:
        """Names SGLang's loader would skip without a word."""
        out = []
        for name in names:
            param = sglang_param_name(name)
            if param is not None and param not in self.params:
                out.append(name)
        return out


def check_weight_names(names: Iterable[str], check: WeightNameCheck | None) -> None:
    """Raise if any of ``names`` would be skipped by SGLang's loader (no check: no-op)."""
    if check is None:
        return
    unknown = check.unknown(names)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            f"weight update: {shown}{more} would be skipped by SGLang's Qwen3-VL loader "
            f"(no such parameter after its renaming); the engine would keep stale weights"
        )
