"""Turn whatever a dataset row holds for an image into a decoded RGB PIL image.

Accepted forms: `datasets.Image` dicts (`{"bytes": ..., "path": ...}`), PIL images, raw bytes,
file paths (a relative one resolves inside the dataset's own folder), `data:` URIs or bare base64
strings, and http(s) URLs (fetched with a size cap and a time limit on the whole download, and
cached on disk). Decoding an image never runs code; a header that declares a decompression bomb
is refused before any pixel is decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

logger = logging.getLogger(__name__)


class ImageError(ValueError):
    """An image value that could not be read or decoded; the message says which and why."""


def _default_cache_dir() -> Path:
    """$GLIMPSE_CACHE/images, else $XDG_CACHE_HOME (or ~/.cache)/glimpse/images."""
    if root := os.environ.get("GLIMPSE_CACHE"):
        return Path(root) / "images"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "glimpse" / "images"


@dataclass
class ImageLoader:
    """Decodes image values; URL downloads are bounded and cached.

    base_dir: folder that relative file paths resolve against (the dataset's own folder).
    timeout_s / max_bytes: limits for one URL download (timeout_s for each network read,
    total_timeout_s for the whole download, so a server that trickles bytes cannot hold a
    worker). cache_dir: where downloads are kept (file name = sha256 of the URL), so a second
    epoch or a second run reads from disk.
    """

    base_dir: Path | None = None
    timeout_s: float = 10.0
    total_timeout_s: float = 60.0
    max_bytes: int = 32 * 1024 * 1024
    cache_dir: Path = field(default_factory=_default_cache_dir)
    convert_rgb: bool = True

    def load(self, value: Any) -> Image.Image:
        image = self._open(value)
        try:
            image.load()
        except (OSError, SyntaxError) as exc:
            raise ImageError(f"corrupt image data ({_describe(value)}): {exc}") from exc
        if self.convert_rgb and image.mode != "RGB":
            image = _to_rgb(image)
        return image

    def _open(self, value: Any) -> Image.Image:
        if isinstance(value, Image.Image):
            return value
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return _decode_bytes(value["bytes"], _describe(value))
            if value.get("path"):
                return self._open(str(value["path"]))
            raise ImageError(f"image dict has neither bytes nor path: keys {sorted(value)}")
        if isinstance(value, bytes | bytearray | memoryview):
            return _decode_bytes(bytes(value), "raw bytes")
        if isinstance(value, Path):
            return self._open_file(value)
        if isinstance(value, str):
            if value.startswith(("http://", "https://")):
                return _decode_bytes(self.fetch(value), value)
            if value.startswith("data:"):
                _, _, payload = value.partition(",")
                return _decode_bytes(_b64decode(payload, "data URI"), "data URI")
            path = self._resolve(value)
            if path.is_file():
                return self._open_file(path)
            if _looks_like_base64(value):
                return _decode_bytes(_b64decode(value, "base64 string"), "base64 string")
            raise ImageError(f"image file not found: {path}")
        raise ImageError(f"unsupported image value of type {type(value).__name__}")

    def _resolve(self, value: str) -> Path:
        path = Path(value).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        return path

    def _open_file(self, path: Path) -> Image.Image:
        path = self._resolve(str(path))
        if not path.is_file():
            raise ImageError(f"image file not found: {path}")
        return _decode_bytes(path.read_bytes(), str(path))

    def fetch(self, url: str) -> bytes:
        """Download `url` (bounded by timeout_s and max_bytes), or read it from the disk cache."""
        cached = self.cache_dir / hashlib.sha256(url.encode()).hexdigest()
        if cached.is_file():
            return cached.read_bytes()
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and int(declared) > self.max_bytes:
                    raise ImageError(f"image at {url} is {declared} bytes > cap {self.max_bytes}")
                data = self._read_bounded(response, url)
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise ImageError(
                f"could not download {url}: {exc}; without network, pass a local path "
                "(a parquet/JSONL with image bytes or files) instead"
            ) from exc
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(cached)  # atomic: a concurrent reader never sees a partial file
        return data

    def _read_bounded(self, response: Any, url: str) -> bytes:
        """The body, read in chunks until the size cap or the whole-download deadline."""
        deadline = time.monotonic() + self.total_timeout_s
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read1(1 << 16):
            size += len(chunk)
            if size > self.max_bytes:
                raise ImageError(f"image at {url} exceeds the size cap of {self.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise ImageError(
                    f"image at {url} took longer than {self.total_timeout_s:g} s to download "
                    f"({size} bytes so far)"
                )
            chunks.append(chunk)
        return b"".join(chunks)


def _decode_bytes(data: bytes, where: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageError(f"image refused ({where}): {exc}") from exc
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageError(f"corrupt or unknown image data ({where}): {exc}") from exc


def _b64decode(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"invalid {where}: {exc}") from exc


_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")


def _looks_like_base64(value: str) -> bool:
    """Long and only base64 characters: a file name has a dot, a base64 image never does."""
    return len(value) >= 64 and _BASE64.fullmatch(value[:4096]) is not None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (a plain convert would expose their hidden colour,
    often black). Opaque RGBA (all geo3k diagrams) converts directly, as the processor would."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA"):
        alpha = image.getchannel("A")
        if alpha.getextrema()[0] < 255:
            background = Image.new("RGB", image.size, (255, 255, 255))
            background.paste(image.convert("RGB"), mask=alpha)
            return background
    return image.convert("RGB")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"path={value.get('path')!r}" if value.get("path") else "inline bytes"
    return type(value).__name__


def is_relative_file_path(value: str) -> bool:
    """A string that names a relative file (not a URL, data URI, absolute path or base64 blob)."""
    if value.startswith(("http://", "https://", "data:", "/", "~")):
        return False
    return not _looks_like_base64(value)
