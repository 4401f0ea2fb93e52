from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from vlm_data.images import ImageError, ImageLoader


def _png(color=(10, 200, 30), size=(8, 6), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def loader(tmp_path: Path) -> ImageLoader:
    return ImageLoader(base_dir=tmp_path, cache_dir=tmp_path / "cache", timeout_s=2.0)


def test_every_accepted_form_decodes_to_the_same_rgb_image(loader, tmp_path):
    data = _png()
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(data)
    forms = [
        {"bytes": data, "path": "ignored.png"},
        {"bytes": None, "path": "imgs/a.png"},  # relative: inside the dataset folder
        Image.open(io.BytesIO(data)),
        data,
        "imgs/a.png",
        str(tmp_path / "imgs" / "a.png"),
        tmp_path / "imgs" / "a.png",
        base64.b64encode(data).decode(),
        "data:image/png;base64," + base64.b64encode(data).decode(),
    ]
    for value in forms:
        image = loader.load(value)
        assert image.mode == "RGB" and image.size == (8, 6)
        assert image.getpixel((3, 3)) == (10, 200, 30)


def test_transparent_background_becomes_white(loader):
    image = loader.load(_png(color=(0, 0, 0, 0), mode="RGBA"))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"bytes": b"\x89PNG\r\n\x1a\nnot really a png", "path": "x.png"}, "corrupt"),
        (b"garbage bytes", "corrupt"),
        ("missing/file.png", "not found"),
        ({"bytes": None, "path": None}, "neither bytes nor path"),
        ("data:image/png;base64,@@@not-base64@@@", "invalid data URI"),
        (12345, "unsupported"),
    ],
)
def test_bad_values_raise_image_error_naming_the_problem(loader, value, match):
    with pytest.raises(ImageError, match=match):
        loader.load(value)


def test_truncated_png_is_reported_as_corrupt(loader):
    data = _png(size=(64, 64))
    with pytest.raises(ImageError, match="corrupt"):
        loader.load(data[: len(data) // 2])


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/slow"):
            time.sleep(3)
        if self.path.startswith(("/drip", "/endless")):
            return self._hostile()
        super().do_GET()

    def _hostile(self):
        """/drip: a small body, one byte every 0.1 s (each read is quick, the whole is not);
        /endless: an unbounded body with no Content-Length."""
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path.startswith("/drip"):
            self.send_header("Content-Length", "600")
        self.end_headers()
        for _ in range(600 if self.path.startswith("/drip") else 10**6):
            self.wfile.write(b"\0" if self.path.startswith("/drip") else b"\0" * 4096)
            self.wfile.flush()
            if self.path.startswith("/drip"):
                time.sleep(0.1)

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the client hung up on purpose (timeout and size-cap tests)


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    server = _QuietServer(("127.0.0.1", 0), lambda *a: _Handler(*a, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_url_is_downloaded_once_then_read_from_the_disk_cache(loader, http_root):
    root, base = http_root
    (root / "a.png").write_bytes(_png())
    url = f"{base}/a.png"
    assert loader.load(url).getpixel((0, 0)) == (10, 200, 30)
    (root / "a.png").unlink()  # a second load must not need the server
    assert loader.load(url).getpixel((0, 0)) == (10, 200, 30)
    assert len(list(loader.cache_dir.iterdir())) == 1


def test_url_size_cap_timeout_and_missing_file(tmp_path, http_root):
    root, base = http_root
    (root / "big.png").write_bytes(_png(size=(256, 256), color=(1, 2, 3)) + b"\0" * 4096)
    (root / "slow.png").write_bytes(_png())
    loader = ImageLoader(cache_dir=tmp_path / "c", max_bytes=1024, timeout_s=0.5)
    with pytest.raises(ImageError, match="cap"):
        loader.load(f"{base}/big.png")
    with pytest.raises(ImageError, match="local path"):
        loader.load(f"{base}/slow.png")
    with pytest.raises(ImageError, match="could not download"):
        loader.load(f"{base}/absent.png")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_partly_transparent_image_keeps_opaque_pixels(loader):
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    image.putpixel((1, 1), (0, 0, 255, 255))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    rgb = loader.load(buffer.getvalue())
    assert rgb.getpixel((1, 1)) == (0, 0, 255) and rgb.getpixel((0, 0)) == (255, 255, 255)
    opaque = loader.load(_png(color=(5, 6, 7, 255), mode="RGBA"))
    assert opaque.mode == "RGB" and opaque.getpixel((2, 2)) == (5, 6, 7)


def test_hostile_servers_are_cut_off_by_size_and_total_time(tmp_path, http_root):
    """A server that trickles a small image a byte at a time never trips the per-read timeout;
    the whole download has a deadline. A body without a length stops at the size cap."""
    _, base = http_root
    loader = ImageLoader(
        cache_dir=tmp_path / "c", max_bytes=1024, timeout_s=2.0, total_timeout_s=1.0
    )
    with pytest.raises(ImageError, match="took longer than 1 s to download"):
        loader.load(f"{base}/drip.png")
    with pytest.raises(ImageError, match="exceeds the size cap of 1024 bytes"):
        loader.load(f"{base}/endless.png")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels (decoding it would need gigabytes)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_as_an_image_error(loader):
    with pytest.raises(ImageError, match="image refused"):
        loader.load(_png_header_only(40_000, 40_000))
