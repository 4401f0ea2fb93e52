"""Which classes run: transformers' modules converted in place to our subclasses.

A model file (:mod:`vlm_models.qwen3_vl.model`, :mod:`vlm_models.qwen3_5.model`) lists, per
model family, one :class:`Swap` per transformers class it replaces: the ``build_model`` option
that turns it on, transformers' class and our subclass. Our subclasses add no parameters or
buffers (only methods), so a module is converted by assigning its ``__class__`` (as torch's
FSDP2 ``fully_shard`` does): parameter names, state dicts and weight sync stay transformers'.

Only modules whose type is exactly the listed transformers class are converted, and only after
our subclass's :meth:`Ours.layout_matches` accepted the first such module (once per class and
parent class): a transformers version with another layout keeps its own class, and is logged.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from torch import nn

logger = logging.getLogger(__name__)


class Ours:
    """Base of our subclasses: the check that a transformers class has the layout they assume."""

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        """Whether ``module`` (of transformers' class ``theirs``, held by ``parent`` as ``name``)
        can run as ``cls``. The default: yes."""
        return True


class Swap(NamedTuple):
    """One row of a model file's table: ``option`` of ``build_model`` makes ``theirs`` run as
    ``ours``."""

    option: str
    theirs: type
    ours: type


#: The options of :func:`select_classes` (``build_model`` passes them on) and their defaults.
OPTIONS: dict[str, bool] = {
    "fast_patch_embed": True,  # GEMM instead of Conv3d
    "fused_vision_attention": False,  # bf16 rotary, all images in one varlen kernel
    "fused_rms_norm": False,  # F.rms_norm where the formula matches
    "sync_free": False,  # image merge and DeepStack without host syncs
    "packed_linear_attention": False,  # gated delta net state reset at sample boundaries
    "routing_replay": False,  # MoE routers that can route to given expert ids
}


_MODEL_FILES = ("vlm_models.qwen3_vl.model", "vlm_models.qwen3_5.model")


@functools.cache
def _tables() -> tuple[Swap, ...]:
    """Every model file's rows (a family this transformers lacks, e.g. Qwen3.5, is skipped)."""
    rows: list[Swap] = []
    for name in _MODEL_FILES:
        try:
            table = importlib.import_module(name).CLASSES
        except ImportError as err:
            logger.debug("%s not available: %s", name, err)
            continue
        rows += [row for family in table.values() for row in family]
    return tuple(rows)


_verdicts: dict[tuple[type, type | None, str], bool] = {}


def _accepts(row: Swap, module: nn.Module, parent: nn.Module | None, name: str) -> bool:
    """``row.ours.layout_matches`` once per (class, parent class, attribute); refusals logged."""
    key = (row.ours, type(parent) if parent is not None else None, name)
    if key not in _verdicts:
        _verdicts[key] = row.ours.layout_matches(row.theirs, module, parent, name)
        if not _verdicts[key]:
            logger.warning(
                "%s left as transformers' class: its layout does not match %s",
                row.theirs.__name__,
                row.ours.__name__,
            )
    return _verdicts[key]


def select_classes(
    root: nn.Module, *, table: Iterable[Swap] | None = None, **options: bool
) -> dict[str, int]:
    """Convert every module under ``root`` (included) whose type is exactly a table's
    transformers class to our subclass where its option is on, and back where it is off.
    Options left out take :data:`OPTIONS`' defaults. ``table`` (default: every model file's)
    is for tests. Returns how many modules now run our class, per option."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; known: {sorted(OPTIONS)}")
    wanted: Mapping[str, bool] = {**OPTIONS, **options}
    rows = tuple(table) if table is not None else _tables()
    by_class = {cls: row for row in rows for cls in (row.theirs, row.ours)}
    counts = dict.fromkeys(wanted, 0)
    parents: list[tuple[nn.Module | None, str, nn.Module]] = [(None, "", root)]
    parents += [(p, n, c) for p in root.modules() for n, c in p.named_children()]
    for parent, name, module in parents:
        row = by_class.get(type(module))
        if row is None:
            continue
        if wanted[row.option] and _accepts(row, module, parent, name):
            module.__class__ = row.ours
            counts[row.option] += 1
        else:
            module.__class__ = row.theirs
    selected = {k: v for k, v in counts.items() if v}
    if selected:
        logger.info("%s runs our classes: %s", type(root).__name__, selected)
    return counts
