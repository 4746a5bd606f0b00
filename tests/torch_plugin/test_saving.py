"""The dump's archive writer (``ft_plugins/torch/saving.py``): ``torch.save``'s bytes, its CRC-32s computed by
zlib-ng (Python's zlib where it is missing), and ``torch.save`` itself wherever that cannot be done."""

from __future__ import annotations

import struct
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from ft_plugins.torch import saving

def _state() -> dict:
    """What a Megatron save holds, in small: nested dicts and lists, tensors of several dtypes (a view into a larger
    storage, an empty one), numbers and strings."""
    generator = torch.Generator().manual_seed(7)
    big = torch.randn(3 * 4096 + 11, generator=generator)
    return {"model": {"weight": torch.randn(17, 5, generator=generator).bfloat16(), "bias": torch.zeros(5),
                      "view": big[100:200], "empty": torch.empty(0, dtype=torch.float16)},
            "optimizer": {"state": {0: {"exp_avg": big, "step": torch.tensor(4)}}, "param_groups": [{"lr": 1e-3}]},
            "iteration": 12, "checkpoint_version": 3.0, "args": "namespace"}


def _same_but_the_id(ours: Path, theirs: Path) -> bytes:
    """``ours``' bytes with ``theirs``' random serialization id (and that record's CRC-32) put in its place."""
    def serialization_id(path: Path) -> bytes:
        with zipfile.ZipFile(path) as archive:
            return archive.read(f"{path.stem}/.data/serialization_id")

    mine, other = serialization_id(ours), serialization_id(theirs)
    data = ours.read_bytes()
    assert data.count(mine) == 1
    return data.replace(mine, other).replace(struct.pack("<I", zlib.crc32(mine)), struct.pack("<I", zlib.crc32(other)))


def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.save was called: the archive was not this writer's")

    monkeypatch.setattr(torch, "save", refused)


@pytest.mark.parametrize("crc32", ["zlib-ng", "zlib"])
def test_the_archive_is_torch_saves_byte_for_byte_but_the_random_id(tmp_path: Path, monkeypatch, crc32: str) -> None:
    if crc32 == "zlib":
        monkeypatch.setitem(sys.modules, "zlib_ng", None)  # a platform zlib-ng has no wheel for
        monkeypatch.setattr(saving, "CRC32", saving._fastest_crc32())
    assert saving.CRC32.__module__ == ("zlib" if crc32 == "zlib" else "zlib_ng.zlib_ng")  # installed here
    state = _state()
    (tmp_path / "theirs").mkdir()
    (tmp_path / "ours").mkdir()
    torch.save(state, tmp_path / "theirs" / "model_optim_rng.pt")
    _no_fallback(monkeypatch)
    saving.save(state, str(tmp_path / "ours" / "model_optim_rng.pt"))
    theirs = (tmp_path / "theirs" / "model_optim_rng.pt").read_bytes()
    assert _same_but_the_id(tmp_path / "ours" / "model_optim_rng.pt", tmp_path / "theirs" / "model_optim_rng.pt") \
        == theirs


def test_every_crc_is_right_and_the_state_loads_back(tmp_path: Path, monkeypatch) -> None:
    state, path = _state(), tmp_path / "model_optim_rng.pt"
    _no_fallback(monkeypatch)
    saving.save(state, str(path))
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        assert all(member.CRC for member in archive.infolist() if member.file_size)
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert loaded["model"]["empty"].dtype == torch.float16 and loaded["iteration"] == 12


def test_a_torch_without_the_writer_this_was_made_for_gets_torch_save(tmp_path: Path, monkeypatch) -> None:
    """The writer refuses how it is made here (as an older torch's takes a file name only); torch.save's works."""
    real, made = torch._C.PyTorchFileWriter, []

    def other_writer(*args: object) -> object:
        made.append(args)
        if len(made) == 1:
            raise TypeError("__init__(): incompatible constructor arguments")
        return real(*args)

    monkeypatch.setattr(torch._C, "PyTorchFileWriter", other_writer)
    path = tmp_path / "model_optim_rng.pt"
    saving.save(_state(), str(path))
    assert len(made) == 2, "torch.save made a writer of its own"
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None


@pytest.mark.parametrize("ours", [False, True])
def test_a_torch_whose_archive_writer_takes_other_arguments_gets_torch_save(tmp_path: Path, monkeypatch,
                                                                            ours: bool) -> None:
    """``torch.serialization._save`` with other arguments (a torch after the one this was made for): torch.save
    writes the file; one more argument with a default is still taken here."""
    real_save, real_torch_save, saved = torch.serialization._save, torch.save, []

    def moved(obj, zip_file, pickle_module, pickle_protocol, byteorder, storage_filter):  # noqa: ANN001, ANN202
        raise AssertionError("called with arguments it does not take")

    def extended(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record,  # noqa: ANN001, ANN202
                 hook=None):  # noqa: ANN001
        return real_save(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    def torch_save(obj: object, path: str) -> None:  # torch's save, with torch's own _save back for its write
        saved.append(path)
        monkeypatch.setattr(torch.serialization, "_save", real_save)
        real_torch_save(obj, path)

    monkeypatch.setattr(torch.serialization, "_save", extended if ours else moved)
    monkeypatch.setattr(torch, "save", torch_save)
    path = tmp_path / "model_optim_rng.pt"
    saving.save(_state(), str(path))
    assert saved == ([] if ours else [str(path)])
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    assert torch.load(path, weights_only=False).keys() == _state().keys()


def test_an_archive_laid_out_otherwise_is_written_again_by_torch_save(tmp_path: Path, monkeypatch) -> None:
    """Where the CRCs cannot be filled in, the file is ``torch.save``'s: never one whose CRCs are zero."""
    monkeypatch.setattr(saving, "_DESCRIPTOR", b"PK\x09\x09")  # as if torch no longer wrote data descriptors
    saved: list[str] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, path: saved.append(str(path)) or real(obj, path))
    path = tmp_path / "model_optim_rng.pt"
    saving.save(_state(), str(path))
    assert saved == [str(path)]
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        assert all(member.CRC for member in archive.infolist() if member.file_size)


def test_a_saves_writes_are_timed_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grace learns the file system's speed from a save's own writes, not from its gathers and barriers: on a clock
    that moves one second at each look, each ``torch.save`` to a file counts one second and what runs around it
    none; a save to a buffer is no write."""
    import io
    import itertools

    clock = itertools.count()
    monkeypatch.setattr(saving.time, "monotonic", lambda: float(next(clock)))
    original = torch.save
    with saving.timed_writes() as writes:
        torch.save({"w": torch.zeros(10)}, tmp_path / "a.pt")
        torch.save({"w": torch.zeros(1000)}, str(tmp_path / "b.pt"))
        torch.save({"w": torch.zeros(10)}, io.BytesIO())
    assert writes == [(1.0, (tmp_path / "a.pt").stat().st_size), (1.0, (tmp_path / "b.pt").stat().st_size)]
    assert torch.save is original
