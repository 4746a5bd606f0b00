"""``ft-plugins patch`` never loses work: files replaced or edited after patching, missing or broken
state, symlinks, concurrent runs, unwritable files and empty feature lists."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patch_cases import CASES, run_cli, snapshot
from ft_plugins.patch import apply, detect, make_plan
from ft_plugins.patch.codemod import marker
from ft_plugins.patch.engine import MANIFEST, STATE_DIR

FILE = "megatron/training.py"


@pytest.fixture
def legacy(tmp_path: Path) -> Path:
    return CASES["megatron-legacy"].build(tmp_path)


def test_a_file_replaced_after_patching_gets_a_fresh_backup(legacy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = legacy / FILE
    assert run_cli(capsys, legacy)[0] == 0
    upstream = CASES["megatron-legacy"].build(legacy.parent / "upstream").joinpath(FILE).read_bytes() \
        + b"\n\ndef added_upstream():\n    return 1\n"
    path.write_bytes(upstream)  # `git pull` brought a new version of the file
    assert run_cli(capsys, legacy)[0] == 0
    code, out = run_cli(capsys, legacy, "--revert")
    assert code == 0, out
    assert path.read_bytes() == upstream  # not the stale original of the first patch


def test_a_patched_file_edited_by_hand_is_not_patched_further(legacy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = legacy / FILE
    assert run_cli(capsys, legacy, "--features", "taskd")[0] == 0
    path.write_bytes(path.read_bytes() + b"\n# a local change\n")
    before = snapshot(legacy)
    code, out = run_cli(capsys, legacy, "--features", "mstx")
    assert code == 3 and "was changed by hand after it was patched" in out
    assert snapshot(legacy) == before
    code, out = run_cli(capsys, legacy, "--revert")
    assert code == 3 and "was changed after it was patched" in out
    assert snapshot(legacy) == before


def test_missing_backup_and_broken_state_give_a_clear_error(legacy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, legacy)[0] == 0
    state = legacy / "megatron" / STATE_DIR
    (state / "backup" / "training.py").unlink()
    before = snapshot(legacy)
    code, out = run_cli(capsys, legacy, "--revert")
    assert code == 1 and "the backup of" in out and "is missing" in out and "Traceback" not in out
    assert snapshot(legacy) == before
    (state / MANIFEST).write_text(json.dumps({"files": {"training.py": "0" * 64}}))
    for args in (("--revert",), ()):
        code, out = run_cli(capsys, legacy, *args)
        assert code == 1 and "is not an ft-plugins patch record" in out, args


def test_revert_with_an_unknown_target_or_markers_without_state(legacy: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, legacy, "--revert", "--target", "bogus")
    assert code == 2 and "unknown target 'bogus'" in out
    assert run_cli(capsys, legacy)[0] == 0
    (legacy / "megatron" / STATE_DIR / MANIFEST).unlink()
    before = snapshot(legacy)
    code, out = run_cli(capsys, legacy, "--revert")
    assert code == 3 and str((legacy / FILE).resolve()) in out and "no backup to restore" in out
    assert snapshot(legacy) == before


def test_a_symlinked_source_file_is_written_through(legacy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = legacy / FILE
    real = legacy / "vendored" / "training.py"
    real.parent.mkdir()
    path.rename(real)
    path.symlink_to(real)
    original = real.read_bytes()
    assert run_cli(capsys, legacy)[0] == 0
    assert path.is_symlink() and marker("taskd-worker") in real.read_text()
    assert run_cli(capsys, legacy, "--revert")[0] == 0
    assert path.is_symlink() and real.read_bytes() == original


def _blocked_on_a_lock(process: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Whether ``process`` shows up in /proc/locks as waiting for a lock (``->`` lines) before it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open("/proc/locks") as locks:
            if any("->" in line and f" {process.pid} " in line for line in locks):
                return True
        time.sleep(0.05)
    return False


def test_concurrent_runs_take_turns_and_keep_both_sets_of_edits(legacy: Path) -> None:
    from ft_plugins.patch import locked

    root = detect(legacy).root
    (root / ".training.py.ft-plugins-tmp").mkdir()  # a temporary name another run might hold
    with locked(root):
        other = subprocess.Popen([sys.executable, "-m", "ft_plugins.cli", "patch", str(legacy), "--features", "mstx"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert _blocked_on_a_lock(other)  # the kernel lists it as a waiter: it reached the lock and waits there
        assert other.poll() is None and marker("step-range") not in (legacy / FILE).read_text()
        apply(make_plan(detect(legacy), ["taskd"]))
    output, _ = other.communicate(timeout=120)
    assert other.returncode == 0, output
    text = (legacy / FILE).read_text()
    assert marker("taskd-worker") in text and marker("step-range") in text


def test_an_unwritable_file_is_named_and_empty_features_are_a_usage_error(
        legacy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run_cli(capsys, legacy, "--features", ",")
    assert code == 2 and "--features names no feature" in out
    path = (legacy / FILE).resolve()
    replace = os.replace

    def immutable(source: str, destination: str) -> None:
        if Path(destination) == path:
            raise PermissionError(errno.EPERM, "Operation not permitted", source)
        replace(source, destination)

    monkeypatch.setattr(os, "replace", immutable)
    code, out = run_cli(capsys, legacy)
    assert code == 1 and f"cannot write {path} (Operation not permitted)" in out and "ft-plugins-tmp" not in out
    assert not list(path.parent.glob("*.ft-plugins-tmp"))
