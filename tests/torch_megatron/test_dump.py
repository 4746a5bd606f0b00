"""The dump commit protocol on real files: coverage, mixed steps, killed writers, collisions, idempotency."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ft_plugins.checkpoint import find_latest, verify
from ft_plugins.checkpoint.dump import (LAYOUT_PREFIX, PART_RECORD, Part, clear_staging, commit_dump, complete_pending,
                                       layout_digest, pending_reason, uncovered, withdraw, write_part)
from ft_plugins.checkpoint.manifest import write_manifest
from ft_plugins.checkpoint.naming import TRACKER, dump_dir, tracker_iteration
from ft_plugins.checkpoint.naming import iteration_dir as final_dir

SHARDS = ("mp_rank_00", "mp_rank_01")


def _zip(path: str) -> None:
    import torch

    torch.save({"payload": b"weights"}, path)


def _part(save: Path, shard: str, iteration: int, writer: int = 0, shards: tuple[str, ...] = SHARDS) -> None:
    write_part(str(save), Part(shard, iteration, shards, writer), {"model_optim_rng.pt": _zip})


def _tracker(save: Path) -> str:
    return (save / TRACKER).read_text()


def test_commit_needs_every_shard_then_renames_manifests_and_moves_the_tracker(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("2")
    _part(tmp_path, "mp_rank_00", 5)
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert outcome.reasons == ["shard mp_rank_01 missing (no survivor holding it wrote it)"]
    assert _tracker(tmp_path) == "2" and Path(dump_dir(str(tmp_path), 5)).is_dir()
    _part(tmp_path, "mp_rank_01", 5, writer=1)
    outcome = commit_dump(str(tmp_path), 5)
    assert outcome.committed and outcome.path == final_dir(str(tmp_path), 5)
    assert not Path(dump_dir(str(tmp_path), 5)).exists()
    assert (Path(outcome.path) / "ft_manifest.json").is_file()
    assert _tracker(tmp_path) == "5"
    assert find_latest(tmp_path).iteration == 5 and verify(outcome.path).intact
    assert commit_dump(str(tmp_path), 5).committed  # idempotent: a second committer finds it done
    assert _tracker(tmp_path) == "5"


def test_tracker_never_goes_back(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("9")
    for shard in SHARDS:
        _part(tmp_path, shard, 5)
    assert commit_dump(str(tmp_path), 5).committed
    assert _tracker(tmp_path) == "9"


def test_parts_from_different_steps_are_never_committed(tmp_path: Path) -> None:
    _part(tmp_path, "mp_rank_00", 5)
    _part(tmp_path, "mp_rank_01", 4)
    stray = Path(dump_dir(str(tmp_path), 4)) / "mp_rank_01"
    stray.rename(Path(dump_dir(str(tmp_path), 5)) / "mp_rank_01")
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert "mp_rank_01: part of iteration 4 (mp_rank_01), not of 5 (parts from different steps)" in outcome.reasons


def test_an_earlier_attempts_part_is_never_committed_with_a_later_ones(tmp_path: Path) -> None:
    """The first attempt's dump of step 5 lost its mp_rank_00 writer; the restarted job reached step 5 again and
    its dump lost the mp_rank_01 writer: both halves are of step 5 and of one layout, and cover the run."""
    write_part(str(tmp_path), Part("mp_rank_01", 5, SHARDS, 1, attempt="first"), {"model_optim_rng.pt": _zip})
    write_part(str(tmp_path), Part("mp_rank_00", 5, SHARDS, 0, attempt="second"), {"model_optim_rng.pt": _zip})
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert outcome.reasons == ["parts of different dumps of the step (mp_rank_01 of first; mp_rank_00 of second): "
                               "an earlier attempt's parts are never committed with a later one's"]
    write_part(str(tmp_path), Part("mp_rank_01", 5, SHARDS, 1, attempt="second"), {"model_optim_rng.pt": _zip})
    assert commit_dump(str(tmp_path), 5).committed, "the later attempt's own part replaces the earlier one's"


def test_parts_of_another_layout_are_never_committed(tmp_path: Path) -> None:
    """A job restarted with another tensor-parallel size: its one shard's part beside the old layout's second."""
    write_part(str(tmp_path), Part("mp_rank_01", 5, SHARDS, 1, attempt="a"), {"model_optim_rng.pt": _zip})
    write_part(str(tmp_path), Part("mp_rank_00", 5, ("mp_rank_00",), 0, attempt="a"), {"model_optim_rng.pt": _zip})
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert ("parts of different layouts (mp_rank_00 of a run of 1 shard (mp_rank_00); mp_rank_01 of a run of 2 shards "
            "(mp_rank_00, ...))") in outcome.reasons, outcome.reasons


def test_every_writer_of_one_dump_agrees_on_its_attempt_through_torchruns_store() -> None:
    """The first value offered wins for every caller, through any prefix of the default group's store; without a
    store, every caller gets the same empty value (a process alone)."""
    script = (
        "import torch.distributed as dist\n"
        "from datetime import timedelta\n"
        "from ft_plugins.torch.store import agreed\n"
        "print(repr(agreed('k', 'alone')))\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=timedelta(seconds=10))\n"
        "dist.init_process_group('gloo', store=dist.PrefixStore('generation/', store), rank=0, world_size=1)\n"
        "print(agreed('k', 'first'), agreed('k', 'second'), store.get('k').decode())\n")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert found.stdout.split() == ["''", "first", "first", "first"], found.stdout + found.stderr


def test_a_writer_killed_mid_write_leaves_no_record_and_no_commit(tmp_path: Path) -> None:
    _part(tmp_path, "mp_rank_00", 5)
    script = (
        "import os, signal, sys\n"
        "from ft_plugins.checkpoint.dump import Part, write_part\n"
        "def dying(path):\n"
        "    with open(path, 'wb') as handle:\n"
        "        handle.write(b'PK' + b'x' * 4096)\n"
        "        handle.flush()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"write_part({str(tmp_path)!r}, Part('mp_rank_01', 5, {SHARDS!r}, 1), {{'model_optim_rng.pt': dying}})\n")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == -signal.SIGKILL
    shard = Path(dump_dir(str(tmp_path), 5)) / "mp_rank_01"
    assert sorted(str(p.relative_to(shard)) for p in shard.rglob("*")) == [".ft_partial-1",
                                                                           ".ft_partial-1/model_optim_rng.pt"]
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert outcome.reasons == ["mp_rank_01: no part record (its writer was killed mid-write)",
                               "shard mp_rank_01 missing (no survivor holding it wrote it)"]
    selection = find_latest(tmp_path, "megatron")
    assert selection.path is None
    assert [s.reason for s in selection.skipped] == ["dying-gasp dump never committed: " + "; ".join(outcome.reasons)]


def test_what_a_killed_attempt_of_the_same_writer_left_does_not_stop_its_next_dump(tmp_path: Path) -> None:
    """A dump of step 5 cut short (another file half-written in the writer's staging folder), then step 5 dumped
    again by that writer in a later launch: the part is written and committed without what was left (its manifest
    names none of it), the staging folder, empty, removed after the commit (off its path: a busy journal makes a
    directory's removal wait)."""
    staging = Path(dump_dir(str(tmp_path), 5)) / "mp_rank_00" / ".ft_partial-0"
    staging.mkdir(parents=True)
    (staging / "distrib_optim.pt").write_bytes(b"PK half")
    _part(tmp_path, "mp_rank_00", 5, shards=("mp_rank_00",))
    assert commit_dump(str(tmp_path), 5).committed
    shard = tmp_path / "iter_0000005" / "mp_rank_00"
    assert sorted(p.name for p in shard.iterdir()) == [".ft_partial-0", PART_RECORD, "model_optim_rng.pt"]
    assert list((shard / ".ft_partial-0").iterdir()) == []
    assert verify(str(tmp_path / "iter_0000005")).intact
    clear_staging(str(tmp_path), Part("mp_rank_00", 5, ("mp_rank_00",), 0))
    assert sorted(p.name for p in shard.iterdir()) == [PART_RECORD, "model_optim_rng.pt"]
    assert verify(str(tmp_path / "iter_0000005")).intact


def test_the_last_writer_counts_its_bytes_before_a_peer_commits_the_dump(tmp_path: Path, monkeypatch) -> None:
    """A peer commits the dump the moment the last part's record is there (the dump directory moves): the writer
    still knows what it wrote. It used to look its files up afterwards, and said "dump failed: FileNotFoundError"
    of a part the peer had just committed (seen under load, TP=2 x DP=2)."""
    from contextlib import contextmanager

    import ft_plugins.checkpoint.dump as dump

    _part(tmp_path, "mp_rank_00", 5)
    plain = dump.atomic_file

    @contextmanager
    def committed_by_a_peer_once_written(*args, **kwargs):
        with plain(*args, **kwargs) as handle:
            yield handle
        assert commit_dump(str(tmp_path), 5).committed

    monkeypatch.setattr(dump, "atomic_file", committed_by_a_peer_once_written)
    written = write_part(str(tmp_path), Part("mp_rank_01", 5, SHARDS, 1), {"model_optim_rng.pt": _zip})
    assert written == (tmp_path / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt").stat().st_size


def test_a_dumped_file_is_byte_for_byte_the_save_of_the_same_state(tmp_path: Path) -> None:
    """``torch.save`` names its zip archive after the file: written under a temporary name, a dump's archive was
    named otherwise than Megatron's save of the same state (loaded alike, but not the same bytes)."""
    _part(tmp_path, "mp_rank_00", 5)
    clear_staging(str(tmp_path), Part("mp_rank_00", 5, SHARDS, 0))
    saved = tmp_path / "model_optim_rng.pt"
    _zip(str(saved))
    shard = Path(dump_dir(str(tmp_path), 5)) / "mp_rank_00"
    assert (shard / "model_optim_rng.pt").read_bytes() == saved.read_bytes()
    assert sorted(p.name for p in shard.iterdir()) == [PART_RECORD, "model_optim_rng.pt"]  # no staging left


def test_a_dying_gasp_is_written_and_committed_without_one_fsync_and_a_start_up_commit_with_them(
        tmp_path: Path, monkeypatch) -> None:
    """The dump races the launcher's SIGKILL, which the page cache survives: its part and its commit wait for no disk
    (the writer syncs the file system after the commit). The commit at the next start-up has no clock: it syncs
    the directory, manifest and tracker it writes."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda descriptor: synced.append(descriptor) or real(descriptor))
    for shard in SHARDS:
        _part(tmp_path, shard, 5)
    assert commit_dump(str(tmp_path), 5, durable=False).committed
    assert synced == []
    for shard in SHARDS:
        _part(tmp_path, shard, 6)
    assert complete_pending(str(tmp_path))[0].committed
    assert len(synced) >= 4, "the rename's directory, the manifest, the tracker and its directory"
    assert tracker_iteration(str(tmp_path)) == 6


def test_a_committed_dump_a_crash_of_the_node_cut_short_before_its_sync_is_passed_over(tmp_path: Path) -> None:
    """Committed without an fsync, a dump's data may not reach the disk when the node itself crashes before the sync
    after the commit: the file comes back shorter than its manifest says (here, cut to half; on ext4 or XFS, down
    to what was written back). ``resume`` passes over it for the checkpoint before, naming the file."""
    for iteration in (4, 5):
        for shard in SHARDS:
            _part(tmp_path, shard, iteration)
        assert commit_dump(str(tmp_path), iteration, durable=False).committed
    cut = Path(final_dir(str(tmp_path), 5)) / "mp_rank_01" / "model_optim_rng.pt"
    os.truncate(cut, cut.stat().st_size // 2)
    selection = find_latest(tmp_path, "megatron")
    assert selection.iteration == 4
    assert [s.path for s in selection.skipped] == [final_dir(str(tmp_path), 5)]
    assert "mp_rank_01/model_optim_rng.pt" in selection.skipped[0].reason, selection.skipped[0].reason


def _large_zip(path: str) -> None:
    import torch

    torch.save({"weights": torch.arange(200_000, dtype=torch.float32)}, path)  # 800 KB: more than the sampled ends


def test_a_committed_dump_whose_node_crash_left_zeroed_extents_of_the_right_size_is_passed_over(tmp_path: Path) -> None:
    """A node crash can bring a file back at its size with extents never written back read as zeros: the sizes and
    the sampled head and tail match the manifest, and torch's reader does not check the archive's CRC-32s. A dump
    (committed without an fsync) is checked deep at its first judging: every member's CRC. A periodic save's
    fast check is not (reading every save whole at every start is not the fast check's cost)."""
    for iteration in (4, 5):
        for shard in SHARDS:
            write_part(str(tmp_path), Part(shard, iteration, SHARDS, 0), {"model_optim_rng.pt": _large_zip})
        assert commit_dump(str(tmp_path), iteration, durable=False).committed
    zeroed = Path(final_dir(str(tmp_path), 5)) / "mp_rank_01" / "model_optim_rng.pt"
    with open(zeroed, "r+b") as handle:
        handle.seek(200_000)
        handle.write(bytes(300_000))
    selection = find_latest(tmp_path, "megatron")
    assert selection.iteration == 4, selection
    assert [s.path for s in selection.skipped] == [final_dir(str(tmp_path), 5)]
    assert "mp_rank_01/model_optim_rng.pt: member" in selection.skipped[0].reason, selection.skipped[0].reason
    assert "fails its CRC check" in selection.skipped[0].reason
    assert find_latest(tmp_path, "megatron").iteration == 4, "judged again at the next start: no verdict was kept"


def test_a_dump_never_replaces_a_periodic_save_of_the_same_step(tmp_path: Path) -> None:
    (Path(final_dir(str(tmp_path), 5)) / "mp_rank_00").mkdir(parents=True)  # a periodic save, half-written
    for shard in SHARDS:
        _part(tmp_path, shard, 5)
    outcome = commit_dump(str(tmp_path), 5)
    assert not outcome.committed
    assert outcome.reasons == ["iter_0000005 already exists (a periodic save of the same step, maybe half-written): "
                               "the dump is not committed over it"]
    assert pending_reason(dump_dir(str(tmp_path), 5)).startswith("dying-gasp dump never committed: iter_0000005 already")


def test_a_periodic_save_over_a_committed_dump_withdraws_its_commit_first(tmp_path: Path) -> None:
    """A job that resumed from before a committed dump of step 5 (the dump judged damaged, another ``--load``) saves
    step 5 again into the same folder: cut short, its files beside the dump's must not pass for the dump."""
    for shard in SHARDS:
        _part(tmp_path, shard, 5)
    assert commit_dump(str(tmp_path), 5).committed
    manifest = Path(final_dir(str(tmp_path), 5)) / "ft_manifest.json"
    assert withdraw(str(tmp_path), 5) and not manifest.exists()
    assert not withdraw(str(tmp_path), 5), "withdrawn once"
    write_manifest(final_dir(str(tmp_path), 5))  # the save's own commit, once it completed
    assert not withdraw(str(tmp_path), 5) and manifest.exists(), "a save's commit is not a dump's: it stays"


def test_start_up_completes_a_commit_interrupted_after_the_rename(tmp_path: Path) -> None:
    (tmp_path / TRACKER).write_text("2")
    for shard in SHARDS:
        _part(tmp_path, shard, 5)
    os.rename(dump_dir(str(tmp_path), 5), final_dir(str(tmp_path), 5))  # the committer died here
    _part(tmp_path, "mp_rank_00", 7)  # an older incomplete dump of a later failure
    assert pending_reason(dump_dir(str(tmp_path), 7)).endswith("shard mp_rank_01 missing (no survivor holding it wrote it)")
    outcomes = complete_pending(str(tmp_path))
    assert [(o.iteration, o.committed) for o in outcomes] == [(7, False), (5, True)]
    assert _tracker(tmp_path) == "5"
    assert (Path(final_dir(str(tmp_path), 5)) / "ft_manifest.json").is_file()
    assert complete_pending(str(tmp_path))[0].iteration == 7  # nothing else left to do


def test_a_complete_uncommitted_dump_is_reported_as_such(tmp_path: Path) -> None:
    for shard in SHARDS:
        _part(tmp_path, shard, 3)
    assert pending_reason(dump_dir(str(tmp_path), 3)) == (
        "dying-gasp dump complete but not committed yet (ttp commits it at the next start-up)")
    record = json.loads((Path(dump_dir(str(tmp_path), 3)) / "mp_rank_00" / PART_RECORD).read_text())
    assert record == {"shard": "mp_rank_00", "iteration": 3, "layout": layout_digest(SHARDS), "writer": 0,
                      "files": ["model_optim_rng.pt"], "attempt": ""}


def test_the_runs_shards_are_written_once_and_a_record_names_them_by_digest(tmp_path: Path) -> None:
    """Each record names its run's layout by digest (at 10,240 shards a list in each record made 1.7 GB of names for
    the commit to read); the list itself, once, beside the shards: without it, or altered, nothing is committed."""
    for shard in SHARDS:
        _part(tmp_path, shard, 3)
    dump = Path(dump_dir(str(tmp_path), 3))
    layout = dump / f"{LAYOUT_PREFIX}{layout_digest(SHARDS)}.json"
    assert json.loads(layout.read_text()) == list(SHARDS)
    assert sorted(p.name for p in dump.iterdir()) == [layout.name, *SHARDS]
    listed = layout.read_text()
    layout.write_text(json.dumps(["mp_rank_00"]))
    reason = f"mp_rank_00, mp_rank_01: the run's shards ({layout.name}) missing"
    assert commit_dump(str(tmp_path), 3).reasons == [reason], "a list that is not the digest's is not the layout"
    layout.unlink()
    assert commit_dump(str(tmp_path), 3).reasons == [reason]
    layout.write_text(listed)
    assert commit_dump(str(tmp_path), 3).committed


def test_a_file_of_a_part_that_is_a_link_does_not_count(tmp_path: Path) -> None:
    """A part's file is its writer's own: a link in its place (to a file of the right content elsewhere) is not."""
    for shard in SHARDS:
        _part(tmp_path, shard, 3)
    named = Path(dump_dir(str(tmp_path), 3)) / "mp_rank_01" / "model_optim_rng.pt"
    named.rename(tmp_path / "elsewhere.pt")
    named.symlink_to(tmp_path / "elsewhere.pt")
    assert commit_dump(str(tmp_path), 3).reasons[0] == "mp_rank_01: model_optim_rng.pt missing beside its part record"


def test_a_dump_whose_records_list_the_shards_still_commits(tmp_path: Path) -> None:
    """A dump written by an earlier release, each record listing every shard, left uncommitted: the next start-up,
    with this one, commits it, and still never without all its shards."""
    for shard in SHARDS:
        directory = Path(dump_dir(str(tmp_path), 4)) / shard
        directory.mkdir(parents=True)
        _zip(str(directory / "model_optim_rng.pt"))
        if shard == "mp_rank_00":
            (directory / PART_RECORD).write_text(json.dumps({
                "shard": shard, "iteration": 4, "shards": list(SHARDS), "writer": 0, "files": ["model_optim_rng.pt"],
                "attempt": "old"}))
    assert commit_dump(str(tmp_path), 4).reasons == ["mp_rank_01: no part record (its writer was killed mid-write)",
                                                     "shard mp_rank_01 missing (no survivor holding it wrote it)"]
    (Path(dump_dir(str(tmp_path), 4)) / "mp_rank_01" / PART_RECORD).write_text(json.dumps({
        "shard": "mp_rank_01", "iteration": 4, "shards": list(SHARDS), "writer": 1, "files": ["model_optim_rng.pt"],
        "attempt": "old"}))
    assert [outcome.committed for outcome in complete_pending(str(tmp_path))] == [True]
    assert _tracker(tmp_path) == "4"


def test_a_file_the_record_names_but_missing_is_never_committed(tmp_path: Path) -> None:
    """A part of several files (the distributed optimizer's ``distrib_optim.pt`` beside the model) counts only whole."""
    _part(tmp_path, "mp_rank_00", 3)
    write_part(str(tmp_path), Part("mp_rank_01", 3, SHARDS, 1), {"distrib_optim.pt": _zip, "model_optim_rng.pt": _zip})
    (Path(dump_dir(str(tmp_path), 3)) / "mp_rank_01" / "distrib_optim.pt").unlink()
    outcome = commit_dump(str(tmp_path), 3)
    assert not outcome.committed
    assert outcome.reasons == ["mp_rank_01: distrib_optim.pt missing beside its part record",
                               "shard mp_rank_01 missing (no survivor holding it wrote it)"]


@pytest.mark.parametrize(("holders", "missing"), [
    ({"a": [0], "b": [1]}, []),
    ({"a": [0, 2]}, ["b"]),
    ({"a": [], "b": [3]}, ["a"]),
    ({}, ["a", "b"]),
])
def test_coverage_rule(holders: dict, missing: list) -> None:
    assert uncovered(["b", "a"], holders) == missing


def _resume() -> "Resume":
    from ft_plugins.features.resume import Resume

    feature = Resume("pt", {option.name: option.default for option in Resume.options})
    feature.start()
    return feature


def test_a_dump_cut_short_alone_never_stops_a_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The launcher's SIGKILL cut the only save short: no checkpoint was ever made, so the job starts as it
    would without one, and says which dump it passed over."""
    _part(tmp_path, "mp_rank_00", 5)  # mp_rank_01's writer was killed before it wrote
    with caplog.at_level("WARNING", logger="ft_plugins"):
        selection = _resume().choose(str(tmp_path))
    assert selection.path is None and [s.unfinished for s in selection.skipped] == [True]
    said = [record.getMessage() for record in caplog.records]
    assert any("iter_0000005_tmp: dying-gasp dump never committed: shard mp_rank_01 missing" in line for line in said)
    assert any(line.endswith("only saves that never finished (iter_0000005_tmp); starting as the job would "
                             "without one") for line in said), said


def test_a_dump_cut_short_beside_a_periodic_save_resumes_from_the_save(tmp_path: Path) -> None:
    for shard in SHARDS:
        _part(tmp_path, shard, 2)
    assert commit_dump(str(tmp_path), 2).committed
    _part(tmp_path, "mp_rank_00", 5)
    selection = _resume().choose(str(tmp_path))
    assert selection.iteration == 2 and [Path(s.path).name for s in selection.skipped] == ["iter_0000005_tmp"]


def test_a_broken_checkpoint_beside_a_dump_cut_short_still_stops_the_start(tmp_path: Path) -> None:
    from ft_plugins.checkpoint.errors import NoIntactCheckpoint

    for shard in SHARDS:
        _part(tmp_path, shard, 2)
    assert commit_dump(str(tmp_path), 2).committed
    (tmp_path / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"")  # a real save, damaged
    _part(tmp_path, "mp_rank_00", 5)
    with pytest.raises(NoIntactCheckpoint, match="none is intact"):
        _resume().choose(str(tmp_path))


@pytest.mark.parametrize("given, refusal", [
    ({}, ""),
    ({"ckpt_format": "torch_dist"}, ""),
    ({"ckpt_format": "torch_dcp", "auto_detect_ckpt_format": True}, ""),
    ({"ckpt_format": "torch_dcp"}, "--ckpt-format torch_dcp: the dump is written in the torch format, which a job "
                                   "loads with --ckpt-format torch or torch_dist, or with --auto-detect-ckpt-format"),
    ({"data_parallel_random_init": True}, "--data-parallel-random-init: a save gathers every data-parallel rank's "
                                          "RNG state"),
], ids=["torch", "torch-dist", "auto-detect", "torch-dcp", "random-init"])
def test_the_megatron_dump_serves_the_formats_whose_load_reads_a_torch_format_directory(given: dict,
                                                                                         refusal: str) -> None:
    from types import SimpleNamespace

    from ft_plugins.torch.megatron.dump import unsupported

    assert unsupported(SimpleNamespace(**{"ckpt_format": "torch", **given})) == refusal


def test_a_survivor_whose_groups_are_being_built_again_writes_nothing_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fault met while ``recover`` rebuilds this rank's groups (Megatron's parallel state torn down, in part or
    whole): the rank cannot name its shard, and a survivor whose groups stand writes them. Seen in a 4-rank run
    as "dump failed: AssertionError: expert model parallel group is not initialized"."""
    from types import SimpleNamespace

    from ft_plugins.steps import FORWARD, Frozen
    from ft_plugins.torch.megatron import dump
    from ft_plugins.torch.megatron.regroup import Regroup

    def torn_down(*_: object) -> None:
        raise AssertionError("expert model parallel group is not initialized")

    monkeypatch.setattr(dump, "megatron", lambda name: SimpleNamespace())
    monkeypatch.setattr(dump, "megatron_args", lambda: SimpleNamespace(save=str(tmp_path),
                                                                      use_distributed_optimizer=False))
    monkeypatch.setattr(dump, "_shards", torn_down)
    writer = dump.MegatronDump(SimpleNamespace(settings={"save_dir": None, "device_wait": 30.0}))
    step = dump.MegatronStep(None, None, None, 8, 4, 2, None)
    frozen = Frozen(FORWARD, 2, False, step, False)
    monkeypatch.setattr(Regroup, "_unbuilt", True)
    with caplog.at_level("WARNING", logger="ft_plugins.ttp"):
        writer.save("lost peer", frozen)
    assert [r.getMessage() for r in caplog.records] == [
        "ttp: lost peer: rank 0 writes nothing: its process groups are being built again (recover); a survivor "
        "whose groups stand writes the shards"]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(Regroup, "_unbuilt", False)  # the negative control: the groups stand, the same fault fails
    caplog.clear()
    writer.save("lost peer", frozen)
    assert [r.getMessage() for r in caplog.records] == [
        "ttp: dump failed: AssertionError: expert model parallel group is not initialized"]
