"""Which weight names SGLang's loaders consume: a check before any bucket is sent.

SGLang's ``load_weights`` (sglang 0.5.23) renames each HF name and then silently skips any name
that is not one of its parameters (``if name in params_dict ... else: continue``). A tensor
renamed on our side would leave the engine on stale weights without a word.
:func:`sglang_param_name` mirrors that renaming for each loader family:

- ``qwen3_vl``: ``Qwen3VLForConditionalGeneration.load_weights`` (``srt/models/qwen3_vl.py``);
- ``qwen3_vl_moe``: ``Qwen3VLMoeForConditionalGeneration.load_weights``
  (``srt/models/qwen3_vl_moe.py``): as ``qwen3_vl``, and experts, per expert
  (``experts.{e}.gate_proj.``, ``FusedMoE.make_expert_params_mapping``) or stacked
  (``experts.gate_up_proj``, its ``fused_expert_params_mapping``), into ``experts.w13_weight``
  / ``experts.w2_weight``;
- ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
  ``.load_weights`` (``srt/models/qwen3_5.py``): names holding ``mtp`` skipped, ``.self_attn``
  dropped, the gated delta net's ``in_proj_qkv``/``in_proj_z`` into ``in_proj_qkvz`` and
  ``in_proj_b``/``in_proj_a`` into ``in_proj_ba``, experts as ``qwen3_vl_moe``.

:class:`WeightNameCheck` knows the engine's parameters (the renamed names of the checkpoint it
loaded at start) and fails loudly on a name that would land nowhere or that the loader skips.
The mirror is tested against the real ``load_weights`` of the pinned wheel
(``packages/rollout-sglang/tests/test_sglang_real.py``, ``test_wire_layout_sglang.py``).
"""

from __future__ import annotations

import json
import logging
import re
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


# Qwen3.5's extra fused projections (``stacked_params_mapping`` of ``qwen3_5.py``)
_STACKED_QWEN3_5 = (
    ("qkv_proj", "q_proj"),
    ("qkv_proj", "k_proj"),
    ("qkv_proj", "v_proj"),
    ("gate_up_proj", "gate_proj"),
    ("gate_up_proj", "up_proj"),
    ("in_proj_qkvz.", "in_proj_qkv."),
    ("in_proj_qkvz.", "in_proj_z."),
    ("in_proj_ba.", "in_proj_b."),
    ("in_proj_ba.", "in_proj_a."),
)
# an expert's tensor (per expert or stacked) -> SGLang's FusedMoE parameter
_EXPERT = re.compile(r"experts\.(\d+\.(gate|up|down)_proj\.|(gate_up|down)_proj$)")
FAMILIES = {
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
}


def sglang_skips(name: str, family: str = "qwen3_vl") -> bool:
    """Whether the loader skips ``name`` before any renaming (Qwen3.5: any name holding
    ``mtp``, the multi-token-prediction head, loaded by the draft model if at all)."""
    return family == "qwen3_5" and "mtp" in name


def _visual(name: str) -> str:
    return name.replace("attn.qkv.", "attn.qkv_proj.").replace("model.visual.", "visual.")


def _expert_param(name: str) -> str | None:
    """``...mlp.experts.w13_weight`` / ``w2_weight`` for an expert tensor, else None."""
    match = _EXPERT.search(name)
    if match is None or "mlp.experts" not in name:
        return None
    down = (match.group(2) or match.group(3)) == "down"
    return name[: match.start()] + ("experts.w2_weight" if down else "experts.w13_weight")


def sglang_param_name(name: str, family: str = "qwen3_vl") -> str | None:
    """The SGLang parameter an HF weight name loads into, or None for a name the loader
    drops on purpose (rotary ``inv_freq`` buffers)."""
    if "rotary_emb.inv_freq" in name:
        return None
    if "language_model" in name:
        name = name.replace("model.language_model.", "model.")
    if family == "qwen3_vl":
        if "visual" in name:  # the vision tower: its fused qkv keeps HF's layout, renamed
            return _visual(name)
        for param, shard in _STACKED:
            if shard in name:
                return name.replace(shard, param)
        return name
    stacked = _STACKED
    if family == "qwen3_5":
        stacked = _STACKED_QWEN3_5
        if ".self_attn." in name:
            name = name.replace(".self_attn", "")
    if "visual" in name:
        return _visual(name)
    if "mlp.experts" in name and (expert := _expert_param(name)) is not None:
        return expert
    for param, shard in stacked:
        if shard in name and "mlp.experts" not in name:
            return name.replace(shard, param)
    return name


class WeightNameCheck:
    """The parameter names of a running SGLang engine, and the check against them.

    ``params`` are SGLang parameter names; :meth:`from_names` builds them from the HF names of
    the checkpoint the engine was started from (SGLang consumed exactly those at start), and
    :meth:`from_checkpoint` reads those names (and the loader family, from ``config.json``'s
    ``model_type``) from a local folder.
    """

    def __init__(self, params: Iterable[str], family: str = "qwen3_vl") -> None:
        self.params = set(params)
        self.family = family

    @classmethod
    def from_names(cls, hf_names: Iterable[str], family: str = "qwen3_vl") -> WeightNameCheck:
        params = {
            p
            for n in hf_names
            if not sglang_skips(n, family) and (p := sglang_param_name(n, family)) is not None
        }
        params.add("lm_head.weight")  # SGLang always has it (tied: the embedding itself)
        return cls(params, family)

    @classmethod
    def from_checkpoint(cls, model_path: str | Path) -> WeightNameCheck | None:
        """From ``model.safetensors.index.json`` or ``model.safetensors`` of a local folder;
        None (and a log line) where there is none, e.g. a hub id not downloaded yet."""
        folder = Path(model_path)
        family = "qwen3_vl"
        if (config := folder / "config.json").is_file():
            model_type = json.loads(config.read_text()).get("model_type", "")
            family = FAMILIES.get(model_type, family)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return cls.from_names(json.loads(index.read_text())["weight_map"], family)
        single = folder / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                return cls.from_names(f.keys(), family)
        logger.info("no safetensors in %s: weight names sent to SGLang are not checked", folder)
        return None

    def unknown(self, names: Iterable[str]) -> list[str]:
        """Names SGLang's loader would skip without a word."""
        out = []
        for name in names:
            if sglang_skips(name, self.family):
                out.append(name)
                continue
            param = sglang_param_name(name, self.family)
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
            f"weight update: {shown}{more} would be skipped by SGLang's {check.family} loader "
            f"(no such parameter after its renaming); the engine would keep stale weights"
        )
