"""What a crash leaves of the Trainer dump's replacement of ``checkpoint-K``, at each point, finished or cleared as
the next Trainer is built (``tidy``), and the replacement itself with and without a swap in one rename. Folders
stand in for checkpoints: a commit is its manifest, ``old`` / ``new`` a file saying which save a folder holds."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.torch.hf import ttp


def _folder(path: Path, holds: str, committed: bool) -> None:
    path.mkdir()
    (path / holds).write_text("")
    if committed:
        (path / MANIFEST).write_text("{}")


def _state(run: Path) -> dict[str, list[str]]:
    return {folder.name: sorted(entry.name for entry in folder.iterdir()) for folder in run.iterdir()}


NEW, OLD = ["ft_manifest.json", "new"], ["old"]
# (what a crash left: name -> (holds, committed)), what the tidy makes of it, the lines it writes
CRASHES = {
    "committed, not yet in place": ({"checkpoint-4": ("old", False), "tmp-checkpoint-4": ("new", True)},
                                    {"checkpoint-4": NEW}, ["put in place"]),
    "swapped, old not yet removed": ({"checkpoint-4": ("new", True), "tmp-checkpoint-4": ("old", False)},
                                     {"checkpoint-4": NEW}, ["removed"]),
    "old aside, new not yet in": ({"tmp-checkpoint-4.replaced": ("old", False), "tmp-checkpoint-4": ("new", True)},
                                  {"checkpoint-4": NEW}, ["put in place", "removed"]),
    "new in, old aside not yet removed": ({"checkpoint-4": ("new", True), "tmp-checkpoint-4.replaced": ("old", False)},
                                          {"checkpoint-4": NEW}, ["removed"]),
    "old aside, no dump": ({"tmp-checkpoint-4.replaced": ("old", False)}, {"checkpoint-4": OLD}, ["restored"]),
    "dump never committed": ({"checkpoint-4": ("old", False), "tmp-checkpoint-4": ("new", False)},
                             {"checkpoint-4": OLD, "tmp-checkpoint-4": ["new"]}, []),
}


@pytest.mark.parametrize("left, tidied, said", CRASHES.values(), ids=CRASHES.keys())
def test_what_a_crash_left_is_finished_or_cleared_at_the_next_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, left: dict[str, tuple[str, bool]],
        tidied: dict[str, list[str]], said: list[str]) -> None:
    for name, (holds, committed) in left.items():
        _folder(tmp_path / name, holds, committed)
    with caplog.at_level(logging.WARNING, "ft_plugins.ttp"):
        ttp.tidy(str(tmp_path))
    assert _state(tmp_path) == tidied
    assert len(caplog.records) == len(said) and all(part in record.getMessage()
                                                    for part, record in zip(said, caplog.records)), caplog.text


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "aside"])
def test_the_dump_replaces_an_uncommitted_checkpoint_and_leaves_nothing_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool) -> None:
    if not swap:
        monkeypatch.setattr(ttp, "_exchange", lambda first, second: False)
    _folder(tmp_path / "checkpoint-4", "old", False)
    _folder(tmp_path / "tmp-checkpoint-4", "new", True)
    ttp.put_in_place(str(tmp_path / "tmp-checkpoint-4"), str(tmp_path / "checkpoint-4"))
    assert _state(tmp_path) == {"checkpoint-4": NEW}


def test_folders_swap_in_one_rename_on_this_machine_s_file_system(tmp_path: Path) -> None:
    """The real swap the dump uses where it can (ext4, xfs, btrfs, tmpfs: every Linux file system here)."""
    _folder(tmp_path / "a", "first", False)
    _folder(tmp_path / "b", "second", False)
    assert ttp._exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    assert _state(tmp_path) == {"a": ["second"], "b": ["first"]}
