"""Per-request checks shared by the engines: a bad request fails alone, with a clear message."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_sglang.types import GenerateRequest


@dataclass(frozen=True)
class RequestLimits:
    """What a request must satisfy. ``image_token_id`` and ``merge_size`` come from the model
    config (``config.image_token_id``, ``config.vision_config.spatial_merge_size``)."""

    image_token_id: int
    merge_size: int = 2
    max_prompt_length: int | None = None
    needs_pixels: bool = True  # the HF engine needs pixel_values; SGLang needs the images


def request_error(request: GenerateRequest, limits: RequestLimits, index: int) -> str | None:
    """Why ``request`` cannot be generated from, or None when it can. ``index`` names it."""
    where = f"request {index}" + (f" ({request.request_id})" if request.request_id else "")
    length = request.prompt_length
    if length == 0:
        return f"{where}: empty prompt (no input_ids)"
    if limits.max_prompt_length is not None and length > limits.max_prompt_length:
        return (
            f"{where}: prompt has {length} tokens, more than the limit {limits.max_prompt_length}"
        )
    n_placeholders = int((request.input_ids == limits.image_token_id).sum())
    grid = request.image_grid_thw
    if limits.needs_pixels:
        has_pixels = request.pixel_values is not None and request.pixel_values.numel() > 0
        if n_placeholders == 0:
            return (
                f"{where}: pixel_values given but the prompt has no image tokens"
                if has_pixels
                else None
            )
        if not has_pixels or grid is None or grid.numel() == 0:
            return (
                f"{where}: prompt has {n_placeholders} image tokens but no pixel_values / "
                "image_grid_thw"
            )
        grid = grid.reshape(-1, 3)
        n_patches = int(grid.prod(-1).sum())
        if request.pixel_values.shape[0] != n_patches:
            return (
                f"{where}: pixel_values has {request.pixel_values.shape[0]} patches but "
                f"image_grid_thw {grid.tolist()} needs {n_patches}"
            )
        expected = n_patches // limits.merge_size**2
        if expected != n_placeholders:
            return (
                f"{where}: prompt has {n_placeholders} image tokens but its images "
                f"(image_grid_thw {grid.tolist()}) give {expected}"
            )
        return None
    # SGLang: the server processes the images itself; check what can be checked here.
    if n_placeholders and not request.images:
        return f"{where}: prompt has {n_placeholders} image tokens but no images"
    if request.images and not n_placeholders:
        return f"{where}: {len(request.images)} images given but the prompt has no image tokens"
    if grid is not None and grid.numel() and n_placeholders:
        expected = int(grid.reshape(-1, 3).prod(-1).sum()) // limits.merge_size**2
        if expected != n_placeholders:
            return (
                f"{where}: prompt has {n_placeholders} image tokens but image_grid_thw "
                f"{grid.reshape(-1, 3).tolist()} gives {expected}"
            )
    return None
