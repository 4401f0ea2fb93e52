"""Safetensors files with the permissions every other file gets.

safetensors writes through a temporary file that it renames into place (since 0.8, against
reading from a file being overwritten), and that temporary file is always created mode 0600: an
exported model folder would hold ``config.json`` readable by the group and the weights readable
by their owner alone (safetensors/safetensors#782). :func:`save_safetensors` gives the file the
mode a plain ``open()`` would have given it, ``0o666 & ~umask``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

_umask_lock = threading.Lock()


def umask_mode() -> int:
    """The mode of a file that ``open(path, "w")`` creates now: ``0o666`` less the umask. The
    umask can be read only by setting it; the lock keeps two readers here from racing."""
    with _umask_lock:
        mask = os.umask(0o077)
        os.umask(mask)
    return 0o666 & ~mask


def save_safetensors(
    tensors: Mapping[str, Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file``, then the umask's mode (see the module docstring)."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, umask_mode())
    return path
