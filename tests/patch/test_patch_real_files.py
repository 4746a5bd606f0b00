"""``ft-plugins patch`` on every target: real megatron-core, mindformers and torch files, shaped fixtures.

For each: patch, compile, markers in place, a second run changes nothing, ``--check`` answers,
``--revert`` restores the bytes, ``--dry-run`` and refusals write nothing at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from patch_cases import CASES, Case, run_cli, snapshot
from ft_plugins.patch.codemod import marker
from ft_plugins.patch.engine import STATE_DIR


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Case, Path]:
    built = CASES[request.param]
    return built, built.build(tmp_path)


def test_patch_check_second_run_and_revert(case: tuple[Case, Path], capsys: pytest.CaptureFixture[str]) -> None:
    spec, directory = case
    path = directory / spec.file
    original = path.read_bytes()

    assert run_cli(capsys, directory, "--check")[0] == 3
    code, out = run_cli(capsys, directory)
    assert code == 0, out
    assert f"found {spec.target}" in out
    patched = path.read_bytes()
    compile(patched, str(path), "exec", dont_inherit=True)
    text = patched.decode()
    assert text.count("import ft_plugins.hooks") == 1
    for edit in spec.edits:
        assert marker(edit) in text
    assert run_cli(capsys, directory, "--check")[0] == 0

    code, out = run_cli(capsys, directory)
    assert (code, path.read_bytes()) == (0, patched)
    assert "already patched" in out
    assert run_cli(capsys, directory, "--dry-run")[1].count("+++") == 0

    code, out = run_cli(capsys, directory, "--revert")
    assert code == 0, out
    assert path.read_bytes() == original
    assert not list(directory.rglob(STATE_DIR))
    assert run_cli(capsys, directory, "--check")[0] == 3


def test_dry_run_prints_the_diff_and_writes_nothing(case: tuple[Case, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    spec, directory = case
    before = snapshot(directory)
    code, out = run_cli(capsys, directory, "--dry-run")
    assert code == 0, out
    assert any(line.startswith("+++ b/") and spec.file.endswith(line[6:]) for line in out.splitlines())
    assert any(line.startswith("+") and line.strip().endswith(marker(spec.edits[0])) for line in out.splitlines())
    assert snapshot(directory) == before


def _break_anchor(spec: Case, directory: Path) -> str:
    """Rename the first edit's anchor call, as a fork that renamed the function would."""
    from ft_plugins.patch.recipes import load_recipes

    edit = next(e for r in load_recipes(spec.target) for e in r.edits if e.id == spec.edits[0])
    path = directory / spec.file
    path.write_text(path.read_text().replace(f"{edit.call}(", f"{edit.call}_renamed("))
    return edit.call


def test_file_without_the_anchor_is_refused_without_any_write(case: tuple[Case, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec, directory = case
    call = _break_anchor(spec, directory)
    before = snapshot(directory)
    code, out = run_cli(capsys, directory)
    assert code == 3
    assert spec.file.split("/")[-1] in out and f"anchor not found: no call to {call}()" in out
    assert snapshot(directory) == before


def test_file_changed_after_patching_is_not_reverted(case: tuple[Case, Path],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec, directory = case
    assert run_cli(capsys, directory)[0] == 0
    path = directory / spec.file
    path.write_bytes(path.read_bytes() + b"\n# a local change\n")
    before = snapshot(directory)
    code, out = run_cli(capsys, directory, "--revert")
    assert code == 3
    assert "was changed after it was patched" in out and str(path.resolve()) in out
    assert snapshot(directory) == before
