"""The disk transport end to end without Ray: buckets written as safetensors files, read back by
the engine-side half in the engine's update, exactly (dtypes, shapes, order), inspectable."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from weight_sync import WeightTransport
from weight_sync.disk import Disk, DiskTransport, read_bucket


class Engine:
    """Records what its ``update_weights`` received, bucket by bucket."""

    def __init__(self) -> None:
        self.updates: list[list[list[tuple[str, torch.Tensor]]]] = []

    def update_weights(self, buckets) -> None:
        self.updates.append([list(b) for b in buckets])


class Link:
    """An engine link that runs the engine-side half at once (rl-runtime's runs it in the
    engine's actor)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(self.engine, *args))
        except Exception as exc:
            future.set_exception(exc)
        return future


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(4, 3, generator=g)
    return [
        [
            ("model.z.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("model.a.bias", torch.randn(7, generator=g)),
            ("visual.patch.weight", torch.randn(2, 3, 1, 2, 2, generator=g).half()),
        ],
        # two names over one storage (a tied pair) and a non-contiguous view
        [("lm_head.weight", shared), ("embed.weight", shared), ("t.weight", shared.t())],
    ]


def test_every_engine_gets_every_bucket_exactly_in_order(tmp_path):
    engines = [Engine(), Engine()]
    transport = Disk(str(tmp_path / "sync"))([Link(e) for e in engines])
    assert isinstance(transport, WeightTransport)
    sent = _buckets()
    assert transport.send(sent) == 6
    for engine in engines:
        (got,) = engine.updates  # one update per sync: one SGLang weight-update session
        assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in sent]
        for bucket, expected in zip(got, sent, strict=True):
            for (_, t), (_, e) in zip(bucket, expected, strict=True):
                assert t.dtype == e.dtype and t.shape == e.shape
                assert torch.equal(t, e)


def test_files_are_there_to_inspect_and_a_sync_replaces_the_last(tmp_path):
    folder = tmp_path / "sync"
    transport = DiskTransport([Link(Engine())], folder)
    transport.send(_buckets())
    assert sorted(p.name for p in folder.iterdir()) == [
        "bucket-00000.safetensors",
        "bucket-00001.safetensors",
        "manifest.json",
    ]
    plain = load_file(folder / "bucket-00000.safetensors")  # any safetensors reader opens it
    assert plain.keys() == {"model.z.weight", "model.a.bias", "visual.patch.weight"}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["sync"] == 1 and manifest["buckets"][1]["names"][0] == "lm_head.weight"
    # a second, shorter sync leaves no stale bucket of the first to be loaded
    engine = Engine()
    second = DiskTransport([Link(engine)], folder)
    assert second.send([[("only", torch.ones(2))]]) == 1
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["bucket-00000.safetensors"]
    assert [n for n, _ in read_bucket(folder / "bucket-00000.safetensors")] == ["only"]
    assert [[n for n, _ in b] for b in engine.updates[0]] == [["only"]]
    second.close()
    assert folder.is_dir()  # a given folder keeps the last sync's files


def test_a_temporary_folder_is_removed_at_close():
    transport = DiskTransport([Link(Engine())])
    transport.send(_buckets())
    assert any(transport.folder.glob("*.safetensors"))
    transport.close()
    assert not transport.folder.exists()


def test_an_engine_that_cannot_see_the_files_fails_naming_them(tmp_path):
    from weight_sync.disk import load_bucket_files

    with pytest.raises(FileNotFoundError, match="shared filesystem"):
        load_bucket_files(Engine(), [str(tmp_path / "nowhere.safetensors")])


def test_an_engine_error_reaches_the_trainer(tmp_path):
    class Broken(Engine):
        def update_weights(self, buckets) -> None:
            next(iter(buckets))
            raise RuntimeError("engine refused")

    transport = DiskTransport([Link(Broken())], tmp_path)
    with pytest.raises(RuntimeError, match="engine refused"):
        transport.send(_buckets())


def test_factories_compare_by_folder_and_survive_a_restart():
    assert Disk("a") == Disk("a") != Disk("b")
    assert Disk().restartable
