"""Real megatron ``pretrain()`` saves (torch and torch_dist formats), broken one way each, and real resumes.

Pristine saves are made once per module; every test breaks its own copy. The resume tests run
``pretrain()`` again on the broken copy and check it continues exactly like the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from ft_plugins.checkpoint import find_latest, verify
from support import MEGATRON_EXAMPLE, assert_bit_identical, fake_env, run_megatron

HERE = Path(__file__).resolve().parent
KILL_MID_SAVE = HERE / "fixtures" / "kill_mid_save.py"
TRACKER = "latest_checkpointed_iteration.txt"
MODEL = "mp_rank_00/model_optim_rng.pt"


def _save(tmp_path_factory: pytest.TempPathFactory, name: str, nproc: int, *args: str,
          entry: Path = MEGATRON_EXAMPLE, expect_ok: bool = True, **env: str) -> Path:
    workdir = tmp_path_factory.mktemp(name)
    save = workdir / "ckpt"
    result = run_megatron(workdir, nproc, fake_env(workdir / "calls.jsonl", **env), "--save", str(save),
                          "--save-interval", "2", *args, entry=entry)
    (workdir / "output.txt").write_text(result.stdout + result.stderr)
    if expect_ok:
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return save


def _resume(workdir: Path, save: Path, nproc: int, *args: str, **env: str):
    return run_megatron(workdir, nproc, fake_env(workdir / "calls.jsonl", **env), "--save", str(save),
                        "--load", str(save), "--save-interval", "2", *args)


@pytest.fixture(scope="module")
def torch_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iterations 2, 4, 6 in the legacy torch format, committed by ft_plugins (default FT_PLUGINS=auto)."""
    return _save(tmp_path_factory, "torch", 1, "--train-iters", "6")


@pytest.fixture(scope="module")
def other_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another run (other seed), without ft_plugins: no manifests."""
    return _save(tmp_path_factory, "other", 1, "--train-iters", "6", "--seed", "99", "--no-ft-plugins-import")


@pytest.fixture(scope="module")
def dist_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory, "dist", 1, "--train-iters", "4", "--ckpt-format", "torch_dist")


def _iter(save: Path, iteration: int) -> Path:
    return save / f"iter_{iteration:07d}"


def _choose(save: Path, deep: bool = False) -> tuple[int | None, list[str]]:
    selection = find_latest(save, "auto", deep=deep)
    assert selection.format == ("megatron" if selection.path else selection.format)
    return selection.iteration, [f"{Path(s.path).name}: {s.reason}" for s in selection.skipped]


def test_pristine_saves_are_committed_and_the_newest_is_chosen(torch_save: Path, dist_save: Path) -> None:
    for save, newest in ((torch_save, 6), (dist_save, 4)):
        assert (_iter(save, newest) / "ft_manifest.json").is_file()
        assert _choose(save) == (newest, [])
        assert _choose(save, deep=True) == (newest, [])


CORRUPTIONS = {
    "truncated file": (lambda s, d: d.truncate(_iter(s, 6) / MODEL), 4, "not a readable torch zip archive"),
    "zero bytes": (lambda s, d: d.zero(_iter(s, 6) / MODEL), 4, "empty (0 bytes)"),
    "missing rank directory": (lambda s, d: shutil.rmtree(_iter(s, 6) / "mp_rank_00"), 4,
                               "listed in the manifest but missing"),
    "tracker names a missing iteration": (lambda s, d: (s / TRACKER).write_text("8"), 6, "named by"),
    "tracker names a broken iteration": (lambda s, d: (d.truncate(_iter(s, 4) / MODEL, 0.9),
                                                       (s / TRACKER).write_text("4"),
                                                       shutil.rmtree(_iter(s, 6))), 2,
                                         "not a readable torch zip archive"),
    "garbage tracker": (lambda s, d: (s / TRACKER).write_bytes(b"\x00\x17garbage"), 6, "neither an iteration"),
    "_tmp newer than everything": (lambda s, d: shutil.copytree(_iter(s, 6), s / "iter_0000008_tmp"),
                                   6, "dying-gasp dump never committed: mp_rank_00: no part record"),
    "manifest mismatch": (lambda s, d: d.flip(_iter(s, 6) / MODEL, -30), 4, "content differs from the manifest"),
    "uncommitted save": (lambda s, d: (_iter(s, 6) / "ft_manifest.json").unlink(), 4, "uncommitted"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_corruption_of_a_real_torch_save_falls_back(case: str, torch_save: Path, tmp_path: Path,
                                                        damage) -> None:
    corrupt, expected, reason = CORRUPTIONS[case]
    save = damage.copy(torch_save, tmp_path / "ckpt")
    corrupt(save, damage)
    iteration, skipped = _choose(save)
    assert iteration == expected, skipped
    assert any(reason in entry for entry in skipped), skipped


def test_files_from_another_run_mixed_in(torch_save: Path, other_run: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    foreign = other_run / "iter_0000006" / MODEL
    (_iter(save, 6) / MODEL).write_bytes(foreign.read_bytes())  # structurally sound, wrong run
    assert verify(_iter(other_run, 6)).intact
    iteration, skipped = _choose(save)
    assert iteration == 4
    assert len(skipped) == 1 and skipped[0].startswith(f"iter_0000006: {MODEL}: ") and "the manifest" in skipped[0]


def test_deep_verification_finds_what_the_fast_one_cannot(torch_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    damage.flip(_iter(save, 6) / MODEL, 200_000)  # inside tensor data: size, head, tail unchanged
    assert _choose(save) == (6, [])
    iteration, skipped = _choose(save, deep=True)
    assert iteration == 4 and "fails its CRC check" in skipped[0]


def test_without_manifests_the_structure_and_the_neighbours_decide(other_run: Path, tmp_path: Path,
                                                                   damage) -> None:
    save = damage.copy(other_run, tmp_path / "ckpt")
    assert _choose(save) == (6, [])
    (_iter(save, 6) / MODEL).unlink()
    damage.zero(_iter(save, 4) / MODEL)
    iteration, skipped = _choose(save)
    assert iteration == 2
    assert skipped == [f"iter_0000006: {MODEL}: missing", f"iter_0000004: {MODEL}: empty (0 bytes)"]


DIST_CORRUPTIONS = {
    "missing .metadata": (lambda s, d: (_iter(s, 4) / ".metadata").unlink(), ".metadata: missing"),
    "truncated .metadata": (lambda s, d: d.truncate(_iter(s, 4) / ".metadata"), "pickle framing broken"),
    "truncated distcp": (lambda s, d: d.truncate(next(_iter(s, 4).glob("*.distcp"))), "the manifest says"),
    "truncated common.pt": (lambda s, d: d.truncate(_iter(s, 4) / "common.pt"), "not a readable torch zip"),
    "missing common.pt": (lambda s, d: (_iter(s, 4) / "common.pt").unlink(), "common.pt: missing"),
}


@pytest.mark.parametrize("case", sorted(DIST_CORRUPTIONS))
@pytest.mark.parametrize("manifests", [True, False], ids=["committed", "no-manifest"])
def test_each_corruption_of_a_real_torch_dist_save_falls_back(case: str, manifests: bool, dist_save: Path,
                                                             tmp_path: Path, damage) -> None:
    corrupt, reason = DIST_CORRUPTIONS[case]
    save = damage.copy(dist_save, tmp_path / "ckpt")
    if not manifests:
        damage.strip_manifests(save)
        if reason == "the manifest says":
            reason = "its shards need"  # the extents .metadata records, read without unpickling it
    corrupt(save, damage)
    iteration, skipped = _choose(save)
    assert iteration == 2 and reason in skipped[0], skipped


def test_cli_reports_choice_and_skips_as_json_and_exit_codes(torch_save: Path, tmp_path: Path, damage,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    damage.truncate(_iter(save, 6) / MODEL)
    code, out = damage.cli_json(capsys, "ckpt", "latest", str(save))
    assert code == 0
    assert out["path"] == str(_iter(save, 4)) and out["iteration"] == 4 and out["format"] == "megatron"
    assert [entry["path"] for entry in out["skipped"]] == [str(_iter(save, 6))]
    code, out = damage.cli_json(capsys, "ckpt", "verify", str(_iter(save, 6)))
    assert code == 3 and out["intact"] is False and "truncated" in " ".join(out["reasons"])
    assert damage.cli_json(capsys, "ckpt", "verify", str(_iter(save, 4)))[0] == 0
    for iteration in (2, 4):
        damage.zero(_iter(save, iteration) / MODEL)
    code, out = damage.cli_json(capsys, "ckpt", "latest", str(save), "--format", "megatron")
    assert code == 3 and out["path"] is None and len(out["skipped"]) == 3
    assert verify(_iter(save, 2)).reasons[-1].endswith("empty (0 bytes)")


def test_resume_skips_broken_and_garbage_tracker_and_continues_bit_identically(
        torch_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    damage.truncate(_iter(save, 6) / MODEL)
    (save / TRACKER).write_text("6?")
    alone = _resume(tmp_path, damage.copy(save, tmp_path / "alone" / "ckpt"), 1, "--train-iters", "6",
                    "--no-ft-plugins-import")
    alone_output = alone.stdout + alone.stderr  # the negative control: Megatron alone quits on this copy,
    assert "ERROR: Invalid metadata file" in alone_output, alone_output[-3000:]  # with exit status 0
    assert "successfully loaded checkpoint" not in alone_output and not _losses(alone_output)
    result = _resume(tmp_path, save, 1, "--train-iters", "6")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "resume: skipped" in output and "loading checkpoint from" in output
    assert re.search(r"successfully loaded checkpoint from .* at iteration 4\b", output), output[-3000:]
    assert_bit_identical(_iter(torch_save, 6) / MODEL, _iter(save, 6) / MODEL)
    assert find_latest(save).iteration == 6 and (save / TRACKER).read_text() == "6"


def _losses(output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"iteration\s+(\d+)/.*?lm loss: (\S+)", output)}


def test_torch_dist_resume_without_metadata_continues_like_megatron_resuming_from_that_checkpoint(
        dist_save: Path, tmp_path: Path, damage) -> None:
    """Megatron's own torch_dist resume on CPU does not restore the optimizer bit-exactly (iteration 4
    differs from the uninterrupted run with or without ft_plugins), so the reference is Megatron alone
    resuming from iteration 2 in a directory where iteration 4 never existed."""
    reference = damage.copy(dist_save, tmp_path / "reference" / "ckpt")
    shutil.rmtree(_iter(reference, 4))
    (reference / TRACKER).write_text("2")
    expected = _resume(reference.parent, reference, 1, "--train-iters", "4", "--ckpt-format", "torch_dist",
                       "--no-ft-plugins-import")
    save = damage.copy(dist_save, tmp_path / "ckpt")
    (_iter(save, 4) / ".metadata").unlink()
    result = _resume(tmp_path, save, 1, "--train-iters", "4", "--ckpt-format", "torch_dist")
    output = result.stdout + result.stderr
    assert result.returncode == 0 and expected.returncode == 0, output[-4000:]
    assert re.search(r"successfully loaded checkpoint from .* at iteration 2\b", output), output[-3000:]
    resumed, reference_losses = _losses(output), _losses(expected.stdout + expected.stderr)
    assert sorted(resumed) == [3, 4] and resumed == reference_losses
    assert resumed[3] == _losses((dist_save.parent / "output.txt").read_text())[3]


@pytest.mark.parametrize("pristine, damaged", [("torch_save", MODEL), ("dist_save", ".metadata")])
def test_a_periodic_save_cut_short_alone_starts_as_megatron_would_but_a_committed_damaged_one_is_refused(
        pristine: str, damaged: str, request: pytest.FixtureRequest, tmp_path: Path, damage,
        caplog: pytest.LogCaptureFixture) -> None:
    """The first periodic save killed midway: Megatron never moved its tracker, ft_plugins never wrote the
    manifest, so it is no checkpoint; Megatron alone would start from scratch, and so does the job."""
    from ft_plugins.checkpoint.errors import NoIntactCheckpoint
    from ft_plugins.features.resume import Resume

    source = request.getfixturevalue(pristine)
    save = damage.copy(source, tmp_path / "ckpt")
    for later in save.glob("iter_*"):
        if later.name != "iter_0000002":
            shutil.rmtree(later)
    (save / TRACKER).unlink()
    damage.strip_manifests(save)
    if damaged == MODEL:
        damage.truncate(_iter(save, 2) / MODEL)
    else:
        (_iter(save, 2) / damaged).unlink()
    resume = Resume("pt", {option.name: option.default for option in Resume.options})
    resume.start()
    with caplog.at_level("WARNING", logger="ft_plugins"):
        selection = resume.choose(str(save))
    assert selection.path is None and [skipped.unfinished for skipped in selection.skipped] == [True]
    assert selection.skipped[0].reason.endswith(f"never committed ({TRACKER} is absent, no manifest): a save cut "
                                                "short, not a checkpoint"), selection.skipped[0].reason
    said = [record.getMessage() for record in caplog.records]
    assert any(line.endswith("only saves that never finished (iter_0000002); starting as the job would without one")
               for line in said), said
    (save / TRACKER).write_text("2")  # Megatron committed it: damaged, it stops the start as before
    with pytest.raises(NoIntactCheckpoint, match="none is intact"):
        resume.choose(str(save))
    (save / TRACKER).unlink()
    shutil.copy(_iter(source, 2) / "ft_manifest.json", _iter(save, 2))  # committed by ft_plugins' manifest
    with pytest.raises(NoIntactCheckpoint, match="none is intact"):
        resume.choose(str(save))


def test_checkpoints_but_none_intact_is_an_error_unless_scratch_is_allowed(torch_save: Path, tmp_path: Path,
                                                                           damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    for iteration in (2, 4, 6):
        damage.zero(_iter(save, iteration) / MODEL)
    refused = _resume(tmp_path, save, 1, "--train-iters", "2")
    assert refused.returncode != 0
    assert "none is intact" in refused.stderr and "FT_PLUGINS_RESUME_ALLOW_SCRATCH=1" in refused.stderr
    allowed = _resume(tmp_path, save, 1, "--train-iters", "2", FT_PLUGINS_RESUME_ALLOW_SCRATCH="1")
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-4000:]
    assert "starting from scratch" in allowed.stderr


def test_rank_killed_mid_save_resumes_all_ranks_from_the_previous_intact_checkpoint(
        tmp_path_factory: pytest.TempPathFactory, damage) -> None:
    tp2 = ("--tensor-model-parallel-size", "2", "--train-iters", "4")
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    reference = _save(tmp_path_factory, "tp2_reference", 2, *tp2, **env)
    killed = _save(tmp_path_factory, "tp2_killed", 2, *tp2, entry=KILL_MID_SAVE, expect_ok=False,
                   FT_TEST_KILL_ITER="4", FT_TEST_KILL_RANK="1", **env)
    assert (killed / TRACKER).read_text() == "2"
    assert (_iter(killed, 4) / "mp_rank_01" / "model_optim_rng.pt").is_file()  # died while writing it
    iteration, skipped = _choose(killed)
    assert iteration == 2 and "mp_rank_01/model_optim_rng.pt: not a readable torch zip" in skipped[0]
    control = tmp_path_factory.mktemp("tp2_alone") / "ckpt"
    alone = _resume(control.parent, damage.copy(killed, control), 2, *tp2, "--no-ft-plugins-import", **env)
    alone_output = alone.stdout + alone.stderr
    # Megatron alone recovers here too: rank 0 writes its tracker only after every rank passed the
    # save's barrier, so the tracker still names 2. What ft_plugins adds is a choice proven from the files.
    assert alone.returncode == 0 and re.search(r"successfully loaded checkpoint from .* at iteration 2\b",
                                               alone_output), alone_output[-3000:]
    reports = killed.parent / "reports"
    result = _resume(killed.parent, killed, 2, *tp2, "--ft-report-dir", str(reports), **env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("resume: skipped") == 1  # decided once, on rank 0
    activity = [json.loads((reports / f"rank_{rank}.json").read_text())["resume"]["activity"] for rank in (0, 1)]
    assert activity[0].startswith(f"resumed from {_iter(killed, 2)} (1 newer skipped)")
    assert activity[1].startswith("resumed iteration 2, as rank 0 chose")
    assert re.search(r"successfully loaded checkpoint from .* at iteration 2\b", output), output[-3000:]
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        assert_bit_identical(_iter(reference, 4) / rank_dir / "model_optim_rng.pt",
                              _iter(killed, 4) / rank_dir / "model_optim_rng.pt")
    assert find_latest(killed).iteration == 4 and os.path.isfile(_iter(killed, 4) / "ft_manifest.json")


def test_hook_for_patched_sources_gives_the_same_choice(torch_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    damage.strip_manifests(save)  # as written by a run without ft_plugins
    damage.zero(_iter(save, 6) / MODEL)
    result = run_megatron(tmp_path, 1, fake_env(tmp_path / "calls.jsonl"), "--save", str(save), "--load", str(save),
                          "--train-iters", "6", "--save-interval", "2", entry=HERE / "fixtures" / "hooked_entry.py")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "iter_0000006: mp_rank_00/model_optim_rng.pt: empty (0 bytes)" in output
    assert re.search(r"successfully loaded checkpoint from .* at iteration 4\b", output), output[-3000:]
    assert_bit_identical(_iter(torch_save, 6) / MODEL, _iter(save, 6) / MODEL)


def test_release_named_by_the_tracker_comes_first(torch_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(torch_save, tmp_path / "ckpt")
    shutil.copytree(_iter(save, 2), save / "release")
    (save / TRACKER).write_text("release")
    selection = find_latest(save)
    assert (selection.path, selection.iteration) == (str(save / "release"), None)
    damage.truncate(save / "release" / MODEL)
    assert find_latest(save).iteration == 6


ASYNC = ("--ckpt-format", "torch_dist", "--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore")


def test_async_saves_are_committed_when_finalized_and_a_crash_before_leaves_them_uncommitted(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two ranks, ``--async-save``: iteration 2 is finalized (on every rank) and committed; the job dies
    after the write of iteration 4 finished on every rank and before its finalization. Its data files are
    whole, yet it is not committed, not chosen, and the restart resumes from 2 and commits 4 when that
    save finalizes."""
    killed = _save(tmp_path_factory, "async_killed", 2, "--train-iters", "4", *ASYNC,
                   entry=HERE / "fixtures" / "kill_before_finalize.py", expect_ok=False, FT_TEST_KILL_ITER="4")
    output = (killed.parent / "output.txt").read_text()
    assert "dies before finalizing save 4" in output, output[-4000:]  # torchrun ends a rank that is slower
    assert (_iter(killed, 2) / "ft_manifest.json").is_file() and (killed / TRACKER).read_text() == "2"
    assert len(list(_iter(killed, 4).glob("*.distcp"))) == 2  # both ranks' data written
    assert not (_iter(killed, 4) / "ft_manifest.json").exists()
    iteration, skipped = _choose(killed)
    assert iteration == 2 and skipped[0].startswith("iter_0000004: ") and "metadata.json: missing" in skipped[0]
    result = _resume(killed.parent, killed, 2, "--train-iters", "4", *ASYNC)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.search(r"successfully loaded checkpoint from .* at iteration 2\b", output), output[-3000:]
    assert (_iter(killed, 4) / "ft_manifest.json").is_file() and find_latest(killed).iteration == 4
