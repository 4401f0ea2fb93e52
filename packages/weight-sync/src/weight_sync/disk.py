"""Weight sync through files: each bucket written as a safetensors file, loaded by the engines.

The slowest transport and the easiest to debug: what the engines loaded lies on disk, readable
with ``safetensors`` (names in the bucket's order in each file's metadata, a ``manifest.json``
per sync), so a suspect update can be inspected or replayed by hand. The folder is a run
directory's subfolder (the files of the last sync stay there) or a temporary one (removed at
:meth:`DiskTransport.close`). Engines must see the folder: same node, or a shared filesystem.

The trainer writes every bucket of a sync, then each engine loads the files one at a time
(:func:`load_bucket_files`, in the engine's process) into its ``update_weights``: one update
(one SGLang weight-update session) per sync, at most one bucket in the engine's memory.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor

from weight_sync.files import save_safetensors
from weight_sync.protocol import NamedTensors

logger = logging.getLogger(__name__)

#: The metadata key holding a file's tensor names in the bucket's order (safetensors keeps its
#: own order).
NAMES_KEY = "names"
MANIFEST = "manifest.json"


def write_bucket(bucket: NamedTensors, path: Path) -> None:
    """Write one bucket as a safetensors file (host copies; tensors that share storage are
    copied apart, which safetensors requires)."""
    tensors: dict[str, Tensor] = {}
    storages: set[int] = set()
    for name, tensor in bucket:
        if name in tensors:
            raise ValueError(f"weight sync: {name!r} twice in one bucket")
        cpu = tensor.detach().to("cpu").contiguous()
        ptr = cpu.untyped_storage().data_ptr()
        if ptr in storages:
            cpu = cpu.clone()
        storages.add(cpu.untyped_storage().data_ptr())
        tensors[name] = cpu
    metadata = {NAMES_KEY: json.dumps([name for name, _ in bucket])}
    tmp = path.with_suffix(".tmp")
    save_safetensors(tensors, tmp, metadata)
    tmp.replace(path)  # a reader never sees half a file


def read_bucket(path: str | Path) -> NamedTensors:
    """One bucket file back, in the order it was written."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        names = json.loads(metadata[NAMES_KEY]) if NAMES_KEY in metadata else list(f.keys())
        return [(name, f.get_tensor(name)) for name in names]


def load_bucket_files(engine: Any, paths: list[str]) -> int:
    """The engine's side (runs in the engine's process): every file, read lazily one at a time,
    into one ``update_weights``. Returns the number of tensors loaded."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(
            f"disk weight sync: {len(missing)} bucket file(s) not visible to this engine, first "
            f"{missing[0]} (the engines must see the trainer's folder: same node or a shared "
            "filesystem)"
        )
    count = 0

    def buckets() -> Iterator[NamedTensors]:
        nonlocal count
        for path in paths:
            bucket = read_bucket(path)
            count += len(bucket)
            yield bucket

    engine.update_weights(buckets())
    return count


class DiskTransport:
    """Buckets to the engines as safetensors files in ``folder``; a
    :class:`~weight_sync.protocol.WeightTransport`.

    ``engines`` are links (``submit(fn, *args) -> Future``: rl-runtime's ``RemoteEngine``).
    ``folder=None`` makes a temporary folder, removed by :meth:`close`; a given folder is kept,
    holding the last sync's files (each sync replaces the previous one's).
    """

    def __init__(self, engines: Sequence[Any], folder: str | Path | None = None) -> None:
        self.engines = list(engines)
        self.temporary = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="weight-sync-") if folder is None else folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.syncs = 0

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        for old in self.folder.glob("bucket-*.safetensors"):
            old.unlink()  # a shorter sync must not leave the last one's files to be loaded
        paths: list[str] = []
        manifest: list[dict[str, Any]] = []
        for i, bucket in enumerate(buckets):
            path = self.folder / f"bucket-{i:05d}.safetensors"
            write_bucket(bucket, path)
            paths.append(str(path))
            manifest.append({"file": path.name, "names": [name for name, _ in bucket]})
        self.syncs += 1
        (self.folder / MANIFEST).write_text(
            json.dumps({"sync": self.syncs, "buckets": manifest}, indent=1)
        )
        futures = [e.submit(load_bucket_files, paths) for e in self.engines]
        counts = [f.result() for f in futures]  # an engine's error is raised as it came
        sent = sum(len(b["names"]) for b in manifest)
        if any(c != sent for c in counts):
            raise RuntimeError(f"disk weight sync: wrote {sent} tensors, engines loaded {counts}")
        logger.info("disk weight sync %d: %d tensors in %s", self.syncs, sent, self.folder)
        return sent

    def close(self) -> None:
        """Remove a temporary folder; a given one keeps the last sync's files."""
        if self.temporary:
            shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class Disk:
    """Builds a :class:`DiskTransport` in the trainer's process (a picklable factory);
    ``folder=None``: a temporary folder."""

    folder: str | None = None
    restartable: ClassVar[bool] = True  # a new engine reads the same files

    def __call__(self, engines: Sequence[Any]) -> DiskTransport:
        return DiskTransport(engines, self.folder)
