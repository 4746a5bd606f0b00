"""Corrupting real saves: every test copies a pristine save and breaks the copy one way."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from ft_plugins.cli import main as cli_main
from support import NEWER_MEGATRON, fake_env, run_megatron


def copy_save(source: Path, target: Path) -> Path:
    """A writable copy (MindSpore writes its checkpoints read-only)."""
    shutil.copytree(source, target)
    for directory, _, names in os.walk(target):
        for name in names:
            path = Path(directory, name)
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return target


def truncate(path: Path, keep: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(int(size * keep))


def zero(path: Path) -> None:
    path.write_bytes(b"")


def flip_byte(path: Path, offset: int) -> None:
    """Change one byte in place (same size); a negative offset counts from the end."""
    with open(path, "r+b") as handle:
        handle.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        value = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([value[0] ^ 0xFF]))


def strip_manifests(root: Path) -> None:
    for path in root.rglob("ft_manifest*.json"):
        path.unlink()


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = cli_main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def run_ok(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _walked_here(data: bytes) -> dict[str, int]:
    raise AssertionError("walked in the checking process")


@pytest.fixture(params=["here", "apart"])
def metadata_walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each ``.metadata`` walked in the checking process, then in a process of its own, as a large one is; in
    the second the walk here fails, so every answer comes from that process."""
    from ft_plugins.checkpoint import distcp

    if request.param == "apart":
        monkeypatch.setattr(distcp, "_APART", 0)
        monkeypatch.setattr(distcp, "storage_extents", _walked_here)
    return request.param


@pytest.fixture(scope="session")
def damage() -> SimpleNamespace:
    return SimpleNamespace(copy=copy_save, truncate=truncate, zero=zero, flip=flip_byte,
                           strip_manifests=strip_manifests, cli_json=cli_json, run_ok=run_ok)


@pytest.fixture(scope="session")
def newer_megatron_dist_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iterations 2 and 4 saved in torch_dist format by megatron-core 0.19's real ``pretrain()``, with
    ft_plugins on (default FT_PLUGINS=auto): the format without ``common.pt``."""
    if not (NEWER_MEGATRON / "megatron" / "training").is_dir():
        pytest.fail(f"megatron-core 0.19 is not installed in {NEWER_MEGATRON}; run scripts/setup.sh")
    workdir = tmp_path_factory.mktemp("megatron019")
    save = workdir / "ckpt"
    result = run_megatron(workdir, 1, fake_env(workdir / "calls.jsonl", NEWER_MEGATRON), "--save", str(save),
                          "--save-interval", "2", "--train-iters", "4", "--ckpt-format", "torch_dist")
    (workdir / "output.txt").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert str(NEWER_MEGATRON / "megatron") in result.stderr  # megatron's warnings name the files they came from
    return save
