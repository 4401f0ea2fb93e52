"""Qwen3-VL's merge of image features into the text stream, without host syncs.

transformers' Qwen3-VL forward makes the host wait for the GPU seven times per forward and once
more in the backward: the image-placeholder check formats a device count into its message and
reads a device bool, the DeepStack merge indexes by a boolean mask (a ``nonzero`` whose size the
host must read) twice in each of the first three decoder layers, and the backward of the
features' ``masked_scatter`` selects by the mask. Each wait drains the GPU's queue, so whatever
the host does next (launching kernels, Python) is GPU idle time.

The model files' classes (``build_model(sync_free=True)``) override the two methods with
equivalents whose sizes the host already knows:

- :class:`SyncFreeDeepstack` (on the text model), ``_deepstack_process``: ``nonzero_static``
  sized by the number of visual embeddings, then ``index_add`` (the same sums, one rounding
  each, as the masked add it replaces);
- :class:`SyncFreePlaceholderMask` (on the inner ``*Model``), ``get_placeholder_mask``: the
  same masks without the device-side count check, as
  :class:`PlaceholderMask` when the features are given, so that the ``masked_scatter`` merging
  them is an ``index_copy``. The caller must check counts on the host instead
  (``trainers_fsdp.microbatch`` does, per sample, before anything reaches the GPU).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlm_models.classes import Ours

# Ops whose output size or value the host must read from the device: host syncs on CUDA.
_SIZE_FROM_DATA = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(), int(), tolist() of a scalar
    torch.ops.aten.masked_select.default,
    torch.ops.aten.masked_scatter_backward.default,  # a masked_select inside
    torch.ops.aten.is_nonzero.default,
}


class HostSyncRecorder(TorchDispatchMode):
    """Records the ops that would make the host wait for a CUDA device, on any device (so a
    CPU test can show a forward and backward free of them): reads of a device value, ops whose
    output size depends on the data, and indexing by a boolean mask (a ``nonzero`` inside).
    Reading a CPU tensor as Python numbers (``tolist()``) dispatches no op and is not seen.

    Example::

        with HostSyncRecorder() as seen:
            model(**inputs).logits.sum().backward()
        assert not seen.found, seen.found
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masks = [t for t in tree_leaves((args, kwargs)) if getattr(t, "dtype", None) is torch.bool]
        indexing = func.__name__.startswith(("index.", "index_put"))
        if func in _SIZE_FROM_DATA or (indexing and masks):
            self.found.append(str(func))
        return func(*args, **kwargs)


def _same_parameters(theirs: type, ours: type, name: str) -> bool:
    """Whether ``theirs.<name>`` takes the parameters of ``ours.<name>`` (so a transformers
    version that changed the method keeps its own)."""
    method = getattr(theirs, name, None)
    if method is None:
        return False
    mine = getattr(ours, name)
    return list(inspect.signature(method).parameters) == list(inspect.signature(mine).parameters)


class SyncFreeDeepstack(Ours, nn.Module):
    """Mixin before a Qwen3-VL ``*TextModel``: the DeepStack merge without a host sync."""

    def _deepstack_process(
        self, hidden_states: Tensor, visual_pos_masks: Tensor, visual_embeds: Tensor
    ) -> Tensor:
        """``hidden_states`` plus ``visual_embeds`` at the visual positions, out of place."""
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows = visual_pos_masks.to(flat.device).reshape(-1)
        index = torch.nonzero_static(rows, size=visual_embeds.shape[0]).reshape(-1)
        merged = flat.index_add(0, index, visual_embeds.to(flat.device, flat.dtype))
        return merged.view_as(hidden_states)

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        return _same_parameters(theirs, cls, "_deepstack_process")


class SyncFreePlaceholderMask(Ours, nn.Module):
    """Mixin before a Qwen3-VL / Qwen3.5 ``*Model``: placeholder masks without a host sync."""

    def get_placeholder_mask(
        self,
        input_ids: Tensor | None,
        inputs_embeds: Tensor,
        image_features: Tensor | None = None,
        video_features: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Image and video placeholder masks ``[B, L, 1]``; counts are the caller's to check."""
        if input_ids is None:
            embed = self.get_input_embeddings()

            def is_token(token_id: int) -> Tensor:
                probe = torch.full((), token_id, dtype=torch.long, device=inputs_embeds.device)
                return (inputs_embeds == embed(probe)).all(-1)

            image = is_token(self.config.image_token_id)
            video = is_token(self.config.video_token_id)
        else:
            image = input_ids == self.config.image_token_id
            video = input_ids == self.config.video_token_id
        device = inputs_embeds.device
        image, video = image.unsqueeze(-1).to(device), video.unsqueeze(-1).to(device)
        if image_features is not None:
            image = PlaceholderMask.of(image, image_features.shape[0])
        if video_features is not None:
            video = PlaceholderMask.of(video, video_features.shape[0])
        return image, video

    @classmethod
    def layout_matches(
        cls, theirs: type, module: nn.Module, parent: nn.Module | None, name: str
    ) -> bool:
        return _same_parameters(theirs, cls, "get_placeholder_mask")


class PlaceholderMask(Tensor):
    """A boolean placeholder mask ``[B, L, 1]`` that also holds the flat indices of its True
    rows, found without a host read because their count (the features' length) is known.

    transformers merges features by ``inputs_embeds.masked_scatter(mask, features)``, whose
    backward selects the features' gradient by the mask: a ``nonzero`` the host must wait for,
    in the middle of the backward. By this mask the merge is an ``index_copy`` (same values;
    its backward an ``index_select``). Any other op sees a plain boolean tensor.
    """

    index: Tensor

    @staticmethod
    def of(mask: Tensor, rows: int) -> PlaceholderMask:
        out = Tensor._make_subclass(PlaceholderMask, mask)
        out.index = torch.nonzero_static(mask.reshape(-1), size=rows).reshape(-1)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.masked_scatter and not kwargs and isinstance(args[1], cls):
            target, mask, source = args
            flat = target.reshape(-1, target.shape[-1])
            rows = source.reshape(-1, flat.shape[-1]).to(flat.dtype)
            return flat.index_copy(0, mask.index, rows).view_as(target)
        with torch._C.DisableTorchFunctionSubclass():  # plain tensors out
            return func(*args, **kwargs)
