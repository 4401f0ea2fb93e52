"""Small synthetic visual tasks with verifiable answers, for end-to-end learning tests on CPU.

Rows have the geo3k shape (`problem` with one `<image>`, `answer`, `images` as `{bytes, path}`
PNG dicts), are deterministic by seed (same seed -> same bytes), and have few short answers
("1" .. "5") so a tiny model can learn them after a brief SFT warm-up.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from typing import Any

from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
}


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def _count_dots(rng: random.Random, size: int, max_count: int) -> tuple[Image.Image, str, str]:
    """k dots (1..max_count) in distinct cells of a 4x4 grid, so dots never touch."""
    count = rng.randint(1, max_count)
    cells = rng.sample(range(16), count)
    cell = size / 4
    radius = max(2, int(cell * 0.3))
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for c in cells:
        cx = (c % 4 + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
        cy = (c // 4 + 0.5) * cell + rng.uniform(-0.1, 0.1) * cell
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=(0, 0, 0))
    return image, "<image>How many dots are in the image?", str(count)


def _color(rng: random.Random, size: int, max_count: int) -> tuple[Image.Image, str, str]:
    """A filled square of one of three colours; the answer is the colour's name."""
    name = rng.choice(sorted(COLORS))
    image = Image.new("RGB", (size, size), (255, 255, 255))
    margin = rng.randint(size // 8, size // 4)
    ImageDraw.Draw(image).rectangle(
        (margin, margin, size - margin, size - margin), fill=COLORS[name]
    )
    return image, "<image>What color is the square?", name


TASKS: dict[str, Callable[[random.Random, int, int], tuple[Image.Image, str, str]]] = {
    "count-dots": _count_dots,
    "color": _color,
}


def make_synthetic_rows(
    n: int, seed: int = 0, task: str = "count-dots", *, image_size: int = 64, max_count: int = 5
) -> list[dict[str, Any]]:
    """`n` rows of a synthetic task, deterministic by `seed`.

    task: "count-dots" (answer "1".."max_count") or "color" ("red", "green", "blue").
    image_size: side in pixels; 64 gives 4 vision tokens per image with `tiny_processor()`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {sorted(TASKS)}")
    if not 1 <= max_count <= 16:
        raise ValueError(f"max_count must be in 1..16, got {max_count}")
    rng = random.Random(f"{task}:{seed}")
    rows = []
    for i in range(n):
        image, problem, answer = TASKS[task](rng, image_size, max_count)
        rows.append(
            {
                "id": i,
                "problem": problem,
                "answer": answer,
                "images": [{"bytes": _png(image), "path": f"{task}-{seed}-{i}.png"}],
            }
        )
    return rows
