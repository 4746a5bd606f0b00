"""The framework-neutral core on small files: errors, the manifest's atomic commit, no unpickling, the feature."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ft_plugins.checkpoint import CheckpointError, ManifestError, find_latest, verify, write_manifest
from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.checkpoint.probes import probe
from ft_plugins.cli import main as cli_main
from ft_plugins.features import FEATURES
from ft_plugins.checkpoint.errors import NoIntactCheckpoint
from ft_plugins.features.resume import Resume
from ft_plugins.hooks import newest_intact_checkpoint
from ft_plugins.runtime import activate


class _Trap:
    """Unpickling this creates the file named in it: proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _megatron_iteration(root: Path, iteration: int, payload: object) -> Path:
    rank_dir = root / f"iter_{iteration:07d}" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save(payload, rank_dir / "model_optim_rng.pt")
    return rank_dir.parent


def test_unreadable_directory_is_a_clear_error_and_exit_1(tmp_path: Path, capsys) -> None:
    with pytest.raises(CheckpointError, match="no such directory"):
        find_latest(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory.*ckpt verify"):
        find_latest(tmp_path / "file")
    with pytest.raises(CheckpointError, match="unknown checkpoint format 'pt'"):
        find_latest(tmp_path, "pt")
    assert cli_main(["ckpt", "latest", str(tmp_path / "absent")]) == 1
    assert "no such directory" in capsys.readouterr().err
    assert cli_main(["ckpt", "verify", str(tmp_path / "absent")]) == 1


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for argv in (["ckpt"], ["ckpt", "latest"], ["ckpt", "latest", str(tmp_path), "--format", "pt"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2


def test_empty_directory_has_nothing_to_resume(tmp_path: Path, capsys) -> None:
    code = cli_main(["ckpt", "latest", str(tmp_path), "--json"])
    assert code == 3
    assert json.loads(capsys.readouterr().out) == {"path": None, "iteration": None, "format": None, "skipped": []}
    assert newest_intact_checkpoint(str(tmp_path / "not-yet")) is None


def test_probing_never_unpickles(tmp_path: Path, metadata_walk: str) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Trap(control)))
    assert control.exists()  # the trap works when something does unpickle it
    marker = tmp_path / "unpickled"
    iteration = _megatron_iteration(tmp_path, 2, {"trap": _Trap(marker)})
    (iteration / ".metadata").write_bytes(pickle.dumps(_Trap(marker)))
    (iteration / "common.pt").write_bytes((iteration / "mp_rank_00" / "model_optim_rng.pt").read_bytes())
    for deep in (False, True):
        find_latest(tmp_path, deep=deep)
        verify(iteration, deep=deep)
        assert probe(str(iteration / ".metadata"), deep) is None
    assert not marker.exists()


def test_torch_zip_probe_catches_truncation_and_non_torch_zips(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(10_000.0)}, path)
    assert probe(str(path)) is None
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    assert "not a readable torch zip archive" in probe(str(path))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("readme.txt", "hello")
    path.write_bytes(buffer.getvalue())
    assert probe(str(path)) == "zip archive without data.pkl: not a torch.save file"


def test_manifest_is_written_atomically_and_refuses_incomplete_input(tmp_path: Path) -> None:
    iteration = _megatron_iteration(tmp_path, 2, {"w": torch.ones(3)})
    with pytest.raises(ManifestError, match="missing.pt is not readable"):
        write_manifest(iteration, ["mp_rank_00/model_optim_rng.pt", "missing.pt"])
    assert os.listdir(iteration) == ["mp_rank_00"]  # neither a manifest nor a temporary left behind
    path = write_manifest(iteration, full=True)
    manifest = json.loads(Path(path).read_text())
    assert list(manifest["files"]) == ["mp_rank_00/model_optim_rng.pt"] and "sha256" in manifest["files"][
        "mp_rank_00/model_optim_rng.pt"]
    assert sorted(os.listdir(iteration)) == [MANIFEST, "mp_rank_00"]
    (iteration / MANIFEST).write_text("{")
    assert "manifest ft_manifest.json is unreadable" in verify(iteration).reasons[0]


def test_a_commit_asks_the_file_system_twice_for_each_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file's size and samples come from its open and one fstat, no stat before: at 10,000 ranks and 1 ms a
    metadata operation, a third of the round trips of every save's commit; a FIFO among the files is refused by
    name, never read."""
    for rank in range(5):
        (tmp_path / f"__{rank}_0.distcp").write_bytes(b"x" * (rank + 1) * 1000)
    asked: list[tuple[str, str]] = []
    stat, open_ = os.stat, os.open
    monkeypatch.setattr(os, "stat", lambda path, *args, **kwargs: (asked.append(("stat", os.fspath(path))),
                                                                   stat(path, *args, **kwargs))[1])
    monkeypatch.setattr(os, "open", lambda path, *args, **kwargs: (asked.append(("open", os.fspath(path))),
                                                                   open_(path, *args, **kwargs))[1])
    manifest = json.loads(Path(write_manifest(tmp_path)).read_text())
    assert {name: entry["size"] for name, entry in manifest["files"].items()} == {
        f"__{rank}_0.distcp": (rank + 1) * 1000 for rank in range(5)}
    assert sorted(kind for kind, path in asked if path.endswith(".distcp")) == ["open"] * 5, asked
    os.mkfifo(tmp_path / "__5_0.distcp")
    with pytest.raises(ManifestError, match="__5_0.distcp is not readable"):
        write_manifest(tmp_path)


def test_resume_feature_is_registered_needs_no_vendor_and_reads_its_options(tmp_path: Path, no_ft_env,
                                                                            monkeypatch) -> None:
    assert FEATURES["resume"] is Resume
    monkeypatch.setenv("FT_PLUGINS", "resume")
    monkeypatch.setenv("FT_PLUGINS_RESUME_DEEP", "1")
    monkeypatch.setenv("FT_PLUGINS_RESUME_ALLOW_SCRATCH", "yes")
    runtime = activate("pt")
    try:
        feature = runtime.feature("resume")
        assert isinstance(feature, Resume) and feature.settings["deep"] and feature.settings["allow_scratch"]
        _megatron_iteration(tmp_path, 2, {"w": torch.ones(3)})
        (tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")  # committed by Megatron, then damaged
        assert feature.choose(str(tmp_path)).path is None  # allowed: from scratch, with a warning
        assert "0 saves committed" in runtime.report()["resume"]["activity"]
    finally:
        runtime.stop()
    strict = Resume("pt", {option.name: option.default for option in Resume.options})
    strict.start()
    with pytest.raises(NoIntactCheckpoint, match="FT_PLUGINS_RESUME_ALLOW_SCRATCH=1"):
        strict.choose(str(tmp_path))


def test_resnet_style_directory_of_torch_files_newest_intact_by_mtime(tmp_path: Path) -> None:
    for age, name in enumerate(("checkpoint.pth.tar", "model_best.pth.tar", "epoch_1.pt")):
        torch.save({"epoch": 3 - age, "w": torch.ones(4)}, tmp_path / name)
        os.utime(tmp_path / name, (1_000_000 - age, 1_000_000 - age))
    assert newest_intact_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint.pth.tar")
    (tmp_path / "checkpoint.pth.tar").write_bytes((tmp_path / "checkpoint.pth.tar").read_bytes()[:-64])
    os.utime(tmp_path / "checkpoint.pth.tar", (1_000_000, 1_000_000))
    selection = find_latest(tmp_path)
    assert (selection.format, selection.path) == ("torch", str(tmp_path / "model_best.pth.tar"))
    assert "not a readable torch zip archive" in selection.skipped[0].reason
    file_given = str(tmp_path / "epoch_1.pt")
    assert newest_intact_checkpoint(file_given) is None  # a file is left to the caller's own logic


def test_one_error_hierarchy_and_a_picklable_no_intact_checkpoint() -> None:
    assert issubclass(ManifestError, CheckpointError) and issubclass(NoIntactCheckpoint, CheckpointError)
    error = NoIntactCheckpoint("none is intact", [("/save/iter_0000002", "truncated")])
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is NoIntactCheckpoint and str(copy) == "none is intact"
    assert copy.skipped == (("/save/iter_0000002", "truncated"),)


def test_the_package_face_imports_nothing_until_a_name_is_used() -> None:
    """Importing one submodule (atomic, to write a file whole) runs none of the selection code."""
    import subprocess
    import sys


    code = ("import sys, ft_plugins.checkpoint.atomic\n"
            "print(sorted(m for m in sys.modules if m.startswith('ft_plugins.checkpoint.')))\n"
            "from ft_plugins.checkpoint import find_latest\n"
            "print('ft_plugins.checkpoint.select' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.stdout.split("\n")[:2] == ["['ft_plugins.checkpoint.atomic']", "True"], result.stderr


def test_a_sample_digest_is_of_the_head_and_tail_however_short_the_reads(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's sample: the first 4 KiB and the last 64 KiB past them, read at offsets without a file
    object; reads the file system cuts short (here 7 bytes at most) are continued, so the digest is the same.
    Whole reads take one call each: none asks past the end for the end of the file (10,000 calls at 10,000 ranks)."""
    import hashlib

    from ft_plugins.checkpoint.manifest import sample_digest

    pread, cut, calls = os.pread, [7], []

    def short_pread(descriptor: int, length: int, offset: int) -> bytes:
        calls.append(offset)
        return pread(descriptor, min(length, *cut), offset)

    monkeypatch.setattr(os, "pread", short_pread)
    for size in (0, 100, 4096, 5000, 70_000, 200_000):
        path = tmp_path / f"f{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        expected = hashlib.blake2b(data[:4096] + data[max(4096, size - (64 << 10)):], digest_size=16).hexdigest()
        cut[:] = [7]
        assert sample_digest(str(path), size) == expected, size
        cut[:], calls[:] = [1 << 20], []
        assert sample_digest(str(path), size) == expected, size
        assert len(calls) == (size > 0) + (size > 4096), (size, calls)
