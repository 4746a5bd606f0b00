"""The remembered verdict: a restart trusts it only while every file it covers is exactly as checked, and the
resume log line says what the check cost. Torch-format and torch_dist Megatron saves, committed as resume
commits them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch

from ft_plugins.checkpoint import commit, find_latest
from ft_plugins.checkpoint import select as select_module
from ft_plugins.checkpoint.distcp import MetadataWalk
from ft_plugins.checkpoint.verdicts import VERDICT_FILE
from ft_plugins.checkpoint.errors import NoIntactCheckpoint
from ft_plugins.features.resume import Resume


def _save(root: Path, iteration: int, dist: bool) -> Path:
    """One committed Megatron checkpoint: ``mp_rank_00`` and ``mp_rank_01`` files, or a torch_dist directory."""
    directory = root / f"iter_{iteration:07d}"
    if dist:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.full((64,), float(iteration))}, checkpoint_id=str(directory), no_dist=True)
        torch.save({"iteration": iteration}, directory / "common.pt")
        (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                             "common_backend": "torch"}))
    else:
        for rank in range(2):
            (directory / f"mp_rank_{rank:02d}").mkdir(parents=True)
            torch.save({"iteration": iteration, "w": torch.full((64,), float(rank))},
                       directory / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
    commit(directory)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return directory


def _data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"), None) or checkpoint / "mp_rank_01" / "model_optim_rng.pt"


@pytest.fixture(params=["torch", "torch_dist"])
def save(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    for iteration in (2, 4):
        _save(tmp_path, iteration, request.param == "torch_dist")
    return tmp_path


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file the selection probes in full."""
    probed: list[str] = []
    real = select_module.probe

    def counted(path: str, deep: bool = False, stat_of: Callable[[str], os.stat_result] = os.stat,
                walk: MetadataWalk | None = None) -> str | None:
        probed.append(path)
        return real(path, deep, stat_of, walk)

    monkeypatch.setattr(select_module, "probe", counted)
    return probed


def test_a_restart_reads_the_verdict_instead_of_probing(save: Path, probes: list[str]) -> None:
    newest = save / "iter_0000004"
    assert find_latest(save).path == str(newest) and probes
    assert (newest / VERDICT_FILE).is_file() and not (save / "iter_0000002" / VERDICT_FILE).exists()
    probes.clear()
    assert find_latest(save).path == str(newest) and probes == []


def _rewrite_same_size_and_mtime(path: Path) -> None:
    """Change one byte in place and put the modification time back: only the change time still tells."""
    status = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert path.stat().st_size == status.st_size and path.stat().st_mtime_ns == status.st_mtime_ns


def _replace_with_copy_of_older(path: Path) -> None:
    older = Path(str(path).replace("iter_0000004", "iter_0000002"))
    replacement = path.with_name(path.name + ".new")
    replacement.write_bytes(older.read_bytes())
    status = path.stat()
    os.utime(replacement, ns=(status.st_atime_ns, status.st_mtime_ns))
    os.replace(replacement, path)


CHANGES = {
    "truncated": (lambda path: os.truncate(path, path.stat().st_size // 2), "the manifest says"),
    "same size and mtime, one byte changed": (_rewrite_same_size_and_mtime, "content differs from the manifest"),
    "replaced by the older save's file, mtime kept": (_replace_with_copy_of_older, "content differs from the manifest"),
    "removed": (os.unlink, "missing"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_file_changed_after_the_verdict_is_checked_again_and_refused(save: Path, probes: list[str],
                                                                       change: str) -> None:
    newest = save / "iter_0000004"
    find_latest(save)
    damage, reason = CHANGES[change]
    damage(_data_file(newest))
    probes.clear()
    selection = find_latest(save)
    assert probes  # the verdict no longer stands: the full check ran
    assert selection.path == str(save / "iter_0000002")
    assert selection.skipped[0].path == str(newest) and reason in selection.skipped[0].reason


def test_a_file_changed_while_the_check_runs_leaves_no_verdict_that_stands(save: Path, probes: list[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict is of the one stat taken of each file before it was read: a byte changed after that (here
    right after the manifest's digests were read, while the files may still be probed) leaves a verdict that
    no longer matches, so the next check is full and finds the change."""
    newest = save / "iter_0000004"
    compared = select_module.content_problems

    def changing(*args: object, **kwargs: object) -> list[str]:
        found = compared(*args, **kwargs)
        time.sleep(0.05)  # past a tick of the file system's clock, which a same-tick change would share
        _rewrite_same_size_and_mtime(_data_file(newest))
        return found

    monkeypatch.setattr(select_module, "content_problems", changing)
    assert find_latest(save).path == str(newest)  # the digests were read before the change
    probes.clear()
    selection = find_latest(save)
    assert probes and selection.path == str(save / "iter_0000002")
    assert "content differs from the manifest" in selection.skipped[0].reason


def test_a_file_added_or_a_manifest_changed_makes_the_verdict_count_for_nothing(save: Path, probes: list[str]) -> None:
    newest = save / "iter_0000004"
    find_latest(save)
    manifest = newest / "ft_manifest.json"
    manifest.write_text(manifest.read_text().replace('"size": ', '"size": 1'))
    probes.clear()
    assert find_latest(save).path == str(save / "iter_0000002") and probes
    commit(newest)
    find_latest(save)
    extra = newest / ("__9_0.distcp" if any(newest.glob("*.distcp")) else "mp_rank_00/distrib_optim.pt")
    extra.write_bytes(b"x")
    probes.clear()
    find_latest(save)
    assert probes


def test_a_garbage_or_forged_verdict_and_a_fast_one_for_a_deep_check_count_for_nothing(
        save: Path, probes: list[str]) -> None:
    newest = save / "iter_0000004"
    verdict = newest / VERDICT_FILE
    for text in ("{", json.dumps({"version": 1, "deep": True, "fingerprint": "0" * 40}), "[]"):
        verdict.write_text(text)
        probes.clear()
        assert find_latest(save).path == str(newest) and probes
    recorded = json.loads(verdict.read_text())
    assert recorded["deep"] is False
    verdict.write_text(json.dumps({**recorded, "version": recorded["version"] + 1}))
    probes.clear()
    find_latest(save)
    assert probes
    probes.clear()
    find_latest(save, deep=True)
    assert probes and json.loads(verdict.read_text())["deep"] is True
    probes.clear()
    find_latest(save)  # a deep verdict serves the fast check
    assert probes == []


def test_a_damaged_newest_is_remembered_and_a_restart_refuses_it_on_its_stats_alone(
        save: Path, probes: list[str]) -> None:
    """The damage found is kept in the damaged checkpoint's own verdict: a restart stats its files and refuses it
    for the same reason, without probing or reading it again; the damaged file put right makes the verdict count
    for nothing, and the newest is chosen again."""
    newest, older = save / "iter_0000004", save / "iter_0000002"
    damaged = _data_file(newest)
    intact = damaged.read_bytes()
    os.truncate(damaged, 10)
    first = find_latest(save)
    remembered = json.loads((newest / VERDICT_FILE).read_text())
    assert first.path == str(older) and remembered["manifest"] + remembered["probes"], remembered
    probes.clear()
    again = find_latest(save)
    assert again.path == str(older) and probes == [], probes
    assert again.skipped[0].reason == first.skipped[0].reason
    damaged.write_bytes(intact)
    probes.clear()
    assert find_latest(save).path == str(newest) and probes
    assert "manifest" not in json.loads((newest / VERDICT_FILE).read_text())


def test_a_file_the_metadata_names_that_was_missing_is_covered_by_the_damaged_verdict(tmp_path: Path,
                                                                                       probes: list[str]) -> None:
    """A torch_dist save Megatron wrote alone (no manifest) that lacks a ``.distcp`` file its ``.metadata`` names:
    the verdict covers that file as absent, so when it appears the full check runs again."""
    for iteration in (2, 4):
        _save(tmp_path, iteration, dist=True)
    newest = tmp_path / "iter_0000004"
    for manifest in tmp_path.glob("iter_*/ft_manifest.json"):
        manifest.unlink()
    shard = next(newest.glob("*.distcp"))
    held = shard.read_bytes()
    shard.unlink()
    assert find_latest(tmp_path).path == str(tmp_path / "iter_0000002")
    assert json.loads((newest / VERDICT_FILE).read_text())["beyond"] == [shard.name]
    probes.clear()
    assert find_latest(tmp_path).path == str(tmp_path / "iter_0000002") and probes == []
    shard.write_bytes(held)
    assert find_latest(tmp_path).path == str(newest) and probes


def test_damage_from_a_read_error_is_never_remembered_nor_a_verdict_where_it_cannot_be_written(
        save: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    newest, older = save / "iter_0000004", save / "iter_0000002"
    real = select_module.probe
    monkeypatch.setattr(select_module, "probe", lambda path, *args: "unreadable: Input/output error" if
                        path == str(_data_file(newest)) else real(path, *args))
    monkeypatch.setattr(select_module, "content_problems", lambda *args, **kwargs: [])
    os.truncate(_data_file(newest), 10)  # refused on its stats, then probed: a read error
    assert find_latest(save).path == str(older)
    assert not (newest / VERDICT_FILE).exists() and (older / VERDICT_FILE).exists()
    (older / VERDICT_FILE).unlink()
    older.chmod(0o555)
    try:
        assert find_latest(save).path == str(older)
        assert not (older / VERDICT_FILE).exists() or os.geteuid() == 0
    finally:
        older.chmod(0o755)


def test_damage_only_a_deep_check_found_does_not_refuse_a_fast_check(save: Path, probes: list[str]) -> None:
    """An intact verdict serves a check no deeper than its own, a damaged one a check no shallower."""
    newest = save / "iter_0000004"
    os.truncate(_data_file(newest), 10)
    find_latest(save)
    verdict = newest / VERDICT_FILE
    shallow = json.loads(verdict.read_text())
    verdict.write_text(json.dumps({**shallow, "deep": True}))
    probes.clear()
    find_latest(save)
    assert probes  # a deep check's damage is not taken for a fast check
    verdict.write_text(json.dumps(shallow))
    probes.clear()
    find_latest(save, deep=True)
    assert [path for path in probes if path.startswith(str(newest))] == []  # a fast check's damage holds deep


def test_the_verdict_file_is_left_out_of_a_later_commit(save: Path) -> None:
    newest = save / "iter_0000004"
    find_latest(save)
    manifest = json.loads(Path(commit(newest)).read_text())
    assert VERDICT_FILE not in manifest["files"]


def test_resume_says_what_the_check_cost(save: Path, caplog: pytest.LogCaptureFixture) -> None:
    resume = Resume("pt", {option.name: option.default for option in Resume.options})
    resume.start()
    with caplog.at_level(logging.INFO, logger="ft_plugins"):
        resume.choose(str(save))
        os.truncate(_data_file(save / "iter_0000004"), 10)
        resume.choose(str(save))
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith(f"resume: newest checkpoint {save / 'iter_0000004'} is intact (checked in ")
               and line.endswith(" s)") for line in lines), lines
    assert any(line.startswith(f"resume: using {save / 'iter_0000002'} instead (checked in ") for line in lines), lines
    os.truncate(_data_file(save / "iter_0000002"), 10)
    with pytest.raises(NoIntactCheckpoint, match=r"rank 0 logs why\), checked in \d+\.\d s; fix or remove"):
        resume.choose(str(save))
    resume.settings["allow_scratch"] = True
    with caplog.at_level(logging.INFO, logger="ft_plugins"):
        resume.choose(str(save))
    assert caplog.records[-1].getMessage().startswith(f"resume: no intact checkpoint in {save} (checked in ")


def _text(value: str) -> bytes:
    return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()


def test_metadata_reader_imports_and_calls_nothing_the_file_names(tmp_path: Path, metadata_walk: str) -> None:
    """A shard record of a module that does not exist, beside a call of os.system: the extents are read,
    no module is imported, nothing is called, by the walk here or in a process of its own."""
    from ft_plugins.checkpoint.probes import probe

    called = tmp_path / "called"
    record = (b"cft_never_imported.filesystem\n_StorageInfo\n)\x81}(" + _text("relative_path") + _text("__0_0.distcp")
              + _text("offset") + b"K\x08" + _text("length") + b"K\x04ub")
    call = b"cos\nsystem\n" + _text(f"touch {called}") + b"\x85R"
    data = b"\x80\x02" + record + call + b"\x86."
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 11)
    before = set(sys.modules)
    assert probe(str(tmp_path / ".metadata")) == "__0_0.distcp holds 11 bytes, its shards need 12 (truncated)"
    assert set(sys.modules) == before and not called.exists()


def test_calls_that_wait_on_the_file_system_go_side_by_side_in_order() -> None:
    """What a slow metadata server costs is waiting, which threads overlap: once the first few calls of a batch
    waited (here 1 ms each), the rest run over the check's threads, and every result keeps its place."""
    import threading

    from ft_plugins.checkpoint.parallel import each

    def waiting(item: int) -> tuple[int, str]:
        time.sleep(0.001)
        return item, threading.current_thread().name

    results = each(waiting, range(200))
    assert [item for item, _ in results] == list(range(200))
    assert {name for _, name in results[:8]} == {threading.current_thread().name}
    assert all(name.startswith("ft-ckpt-check") for _, name in results[8:])


def test_a_large_save_is_judged_at_commit_in_a_process_of_its_own(save: Path, probes: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict written at commit: a restart after it probes nothing. Started while a training thread holds
    a lock (fork and exec run no Python in between: nothing held is inherited); a small save gets no process,
    and a save removed before its check leaves nothing behind."""
    import threading

    from ft_plugins.checkpoint import judging

    newest = save / "iter_0000004"
    assert judging.judge_later(str(newest)) is None  # two entries: its check at start costs milliseconds
    monkeypatch.setattr(judging, "WORTH", 1)
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: (logging._lock.acquire(), held.set(), release.wait(),  # type: ignore
                                              logging._lock.release()))  # type: ignore
    holder.start()
    held.wait()
    try:
        process = judging.judge_later(str(newest))
        assert process is not None and process.wait(timeout=120) == 0
    finally:
        release.set()
        holder.join()
    assert (newest / VERDICT_FILE).is_file()
    assert find_latest(save).path == str(newest) and probes == []
    shutil.rmtree(save / "iter_0000002")
    assert judging.judge_later(str(save / "iter_0000002")) is None and not (save / "iter_0000002").exists()


def test_the_check_at_commit_finds_a_save_named_relative_to_training_s_directory(
        save: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs where this ft_plugins lies (``python -c`` puts its current directory first on the path), not
    where training runs: a save named relative to training's directory is still the one it checks."""
    from ft_plugins.checkpoint import judging

    newest = save / "iter_0000004"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(judging, "WORTH", 1)
    process = judging.judge_later(os.path.relpath(newest, tmp_path))
    assert process is not None and process.wait(timeout=120) == 0
    assert (newest / VERDICT_FILE).is_file()


def test_a_newest_damaged_after_its_commit_is_refused_on_its_stats(save: Path, probes: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of another size than its manifest says refuses the checkpoint before any file is read: no
    content is compared, and only the damaged file is probed, to say what is wrong with it."""
    from ft_plugins.checkpoint import manifest

    digested: list[str] = []
    real = manifest.sample_digest
    monkeypatch.setattr(manifest, "sample_digest", lambda path, *args, **kwargs: (digested.append(path),
                                                                                real(path, *args, **kwargs))[1])
    newest = save / "iter_0000004"
    damaged = _data_file(newest)
    os.truncate(damaged, 10)
    selection = find_latest(save)
    assert selection.path == str(save / "iter_0000002")
    assert "10 bytes, the manifest says" in selection.skipped[0].reason, selection.skipped
    assert [path for path in probes if path.startswith(str(newest))] == [str(damaged)]
    assert not [path for path in digested if path.startswith(str(newest))] and digested


def test_a_save_never_judged_has_its_content_compared_while_its_files_are_probed(
        save: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full check reads every file's samples (waiting on the file system) side by side with the probes (the
    ``.metadata`` walk: CPU), so it takes about the longer of the two, not both; the choice is the same."""
    import threading

    from ft_plugins.checkpoint import manifest

    probing, overlapped = threading.Event(), []
    probe, digest = select_module.probe, manifest.sample_digest
    monkeypatch.setattr(select_module, "probe", lambda *args, **kwargs: (probing.set(), probe(*args, **kwargs))[1])
    monkeypatch.setattr(manifest, "sample_digest", lambda *args, **kwargs: (
        overlapped.append(probing.wait(timeout=0 if overlapped else 10)), digest(*args, **kwargs))[1])
    assert find_latest(save).path == str(save / "iter_0000004")
    assert overlapped and all(overlapped), overlapped


def test_a_metadata_walk_begins_before_the_other_files_are_stat_ed_and_ends_with_the_check(
        tmp_path: Path, probes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A save never judged: the walk of its ``.metadata`` (in a process of its own; a second or more of CPU at
    10,000 ranks) begins right after that file's stat and before the stats of every other file, so that it runs
    beside them. Where a verdict is recorded, none begins. A walk no probe finished (the newest refused on its
    stats) is ended with the check, its process gone."""
    import signal
    import subprocess

    from ft_plugins.checkpoint import distcp

    for iteration in (2, 4):
        _save(tmp_path, iteration, dist=True)
    events: list[tuple[str, str]] = []
    children: list[subprocess.Popen] = []
    stalled: list[bool] = []  # the next walk begun answers never
    stat, walk_apart = os.stat, distcp._walk_apart

    def walking(descriptor: int, size: int) -> subprocess.Popen | None:
        events.append(("walk", ""))
        children.append(walk_apart(descriptor, size) if not stalled else subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE))
        stalled.clear()
        return children[-1]

    monkeypatch.setattr(distcp, "_APART", 0)
    monkeypatch.setattr(distcp, "_walk_apart", walking)
    monkeypatch.setattr(os, "stat", lambda path, *args, **kwargs: (
        events.append(("stat", os.path.relpath(path, tmp_path))), stat(path, *args, **kwargs))[1])
    assert find_latest(tmp_path).path == str(tmp_path / "iter_0000004")
    newest = [kind if kind == "walk" else path for kind, path in events
              if kind == "walk" or path.startswith("iter_0000004/") and "ft_" not in path]
    assert newest[:2] == ["iter_0000004/.metadata", "walk"] and len(newest) > 3, newest
    assert str(tmp_path / "iter_0000004" / ".metadata") in probes

    events.clear()
    assert find_latest(tmp_path).path == str(tmp_path / "iter_0000004")
    assert ("walk", "") not in events, events  # its verdict, recorded by the check above, stands

    (tmp_path / "iter_0000004" / VERDICT_FILE).unlink()
    truncated = _data_file(tmp_path / "iter_0000004")
    truncated.write_bytes(truncated.read_bytes()[:-1])
    probes.clear()
    children.clear()
    stalled.append(True)
    assert find_latest(tmp_path).path == str(tmp_path / "iter_0000002")
    assert str(tmp_path / "iter_0000004" / ".metadata") not in probes and len(children) == 2
    assert [child.returncode for child in children] == [-signal.SIGKILL, 0]
