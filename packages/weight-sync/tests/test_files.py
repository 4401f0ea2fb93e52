"""Safetensors files get the mode any other new file gets (safetensors alone writes 0600)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from weight_sync.files import save_safetensors, umask_mode


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_save_safetensors_honours_the_umask(tmp_path, umask):
    saved = os.umask(umask)
    try:
        path = save_safetensors({"w": torch.arange(4.0)}, tmp_path / "w.safetensors", {"a": "b"})
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(saved)
    assert umask_mode() == 0o666 & ~saved  # reading the umask left it as it was
    mode = path.stat().st_mode & 0o777
    assert mode == 0o666 & ~umask == (tmp_path / "plain.json").stat().st_mode & 0o777, oct(mode)
    assert torch.equal(load_file(path)["w"], torch.arange(4.0))
