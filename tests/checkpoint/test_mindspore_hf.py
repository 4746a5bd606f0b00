"""Real MindSpore ``ModelCheckpoint``, MindFormers ``CheckpointMonitor`` / iteration-layout and Hugging Face
Trainer saves, broken one way each; resumes that continue byte-identically to the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import pytest

from ft_plugins.checkpoint import commit, find_latest
from support import PYTHON

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}


def _script(name: str, *args: str, cwd: Path, damage) -> str:
    return damage.run_ok([PYTHON, str(FIXTURES / name), *args], cwd=cwd, env=_env(), timeout=300).stdout


@pytest.fixture(scope="module")
def ms_save(tmp_path_factory: pytest.TempPathFactory, damage) -> Path:
    workdir = tmp_path_factory.mktemp("ms")
    _script("mindspore_train.py", "save", str(workdir / "ckpt"), cwd=workdir, damage=damage)
    return workdir / "ckpt"


@pytest.fixture(scope="module")
def mf_save(tmp_path_factory: pytest.TempPathFactory, damage) -> Path:
    workdir = tmp_path_factory.mktemp("mf")  # mindformers writes ./output here
    _script("mindspore_train.py", "mindformers", str(workdir), cwd=workdir, damage=damage)
    _script("mindspore_train.py", "iterations", str(workdir / "iterations"), cwd=workdir, damage=damage)
    return workdir


@pytest.fixture(scope="module")
def hf_save(tmp_path_factory: pytest.TempPathFactory, damage) -> Path:
    workdir = tmp_path_factory.mktemp("hf")
    _script("hf_train.py", str(workdir / "out"), cwd=workdir, damage=damage)
    return workdir / "out"


def _names(selection) -> tuple[str | None, list[str]]:
    path = os.path.relpath(selection.path, selection.path.rsplit("/rank_", 1)[0]) if selection.path else None
    return path, [f"{Path(s.path).name}: {s.reason}" for s in selection.skipped]


def test_mindspore_pristine_picks_the_newest_step_for_the_asked_rank(ms_save: Path) -> None:
    for rank in (0, 1):
        selection = find_latest(ms_save, rank=rank)
        assert selection.format == "mindspore" and (selection.epoch, selection.step) == (2, 4)
        assert selection.path == str(ms_save / f"rank_{rank}" / "net-2_4.ckpt") and not selection.skipped
    assert find_latest(ms_save / "rank_0", deep=True).path == str(ms_save / "rank_0" / "net-2_4.ckpt")


def _commit(save: Path, epoch: int, step: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    """What each rank's ResumeCallback does once its save returned."""
    for rank in ranks:
        commit(save / f"rank_{rank}" / f"net-{epoch}_{step}.ckpt")


MS_CORRUPTIONS = {
    "truncated": (lambda s, d: d.truncate(s / "rank_1/net-2_4.ckpt"), (2, 2), "field runs past the end"),
    "zero bytes": (lambda s, d: d.zero(s / "rank_0/net-2_4.ckpt"), (2, 2), "empty (0 bytes)"),
    "one rank's file missing": (lambda s, d: (s / "rank_1/net-2_4.ckpt").unlink(), (2, 2),
                                "no 2_4 file for rank_1"),
    "breakpoint newer than everything": (
        lambda s, d: [shutil.copy(s / f"rank_{r}/net-2_4.ckpt", s / f"rank_{r}/net-3_2_breakpoint.ckpt")
                      for r in (0, 1)], (2, 4), "breakpoint checkpoint"),
    "manifest mismatch": (
        lambda s, d: (_commit(s, 2, 4), d.flip(s / "rank_1/net-2_4.ckpt", -3)), (2, 2),
        "rank_1/net-2_4.ckpt: content differs from the manifest"),
    "uncommitted": (lambda s, d: _commit(s, 2, 2), (2, 2), "uncommitted: no manifest"),
    "one rank died before committing": (
        lambda s, d: (_commit(s, 2, 2), _commit(s, 2, 4, ranks=(0,))), (2, 2),
        "uncommitted: no rank_1/ft_manifest-net-2_4.json (the other ranks committed)"),
    "files of two runs mixed": (
        lambda s, d: (_commit(s, 2, 4), shutil.copy(s / "rank_1/net-1_2.ckpt", s / "rank_1/net-2_4.ckpt")), (2, 2),
        "the manifest"),
}


@pytest.mark.parametrize("case", sorted(MS_CORRUPTIONS))
def test_mindspore_each_corruption_falls_back_for_every_rank(case: str, ms_save: Path, tmp_path: Path,
                                                             damage) -> None:
    corrupt, expected, reason = MS_CORRUPTIONS[case]
    save = damage.copy(ms_save, tmp_path / "ckpt")
    corrupt(save, damage)
    for rank in (0, 1):
        selection = find_latest(save, "mindspore", rank=rank)
        assert (selection.epoch, selection.step) == expected, selection.skipped
        assert selection.path == str(save / f"rank_{rank}" / f"net-{expected[0]}_{expected[1]}.ckpt")
        assert any(reason in s.reason for s in selection.skipped), selection.skipped


def test_mindspore_rank_without_files_and_cli(ms_save: Path, tmp_path: Path, damage,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    save = damage.copy(ms_save, tmp_path / "ckpt")
    code, out = damage.cli_json(capsys, "ckpt", "latest", str(save), "--rank", "1")
    assert code == 0 and out["path"].endswith("rank_1/net-2_4.ckpt") and (out["epoch"], out["step"]) == (2, 4)
    code, out = damage.cli_json(capsys, "ckpt", "latest", str(save), "--rank", "2")
    assert code == 3 and out["path"] is None and "no 2_4 file for rank_2" in out["skipped"][0]["reason"]
    code, out = damage.cli_json(capsys, "ckpt", "verify", str(save / "rank_0" / "net-1_2.ckpt"))
    assert code == 0 and out["format"] == "mindspore"


def test_mindspore_resume_from_the_choice_is_byte_identical_to_the_uninterrupted_run(
        ms_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(ms_save, tmp_path / "ckpt")
    damage.truncate(save / "rank_0/net-2_4.ckpt")
    damage.zero(save / "rank_1/net-2_2.ckpt")
    output = _script("mindspore_train.py", "resume", str(save), str(tmp_path / "resumed"), cwd=tmp_path,
                     damage=damage)
    chosen = json.loads(output.strip().splitlines()[-1])
    assert chosen["path"] == str(save / "rank_0/net-1_4.ckpt") and (chosen["epoch"], chosen["step"]) == (1, 4)
    assert len(chosen["skipped"]) == 2
    assert (tmp_path / "resumed/net-2_4.ckpt").read_bytes() == (ms_save / "rank_0/net-2_4.ckpt").read_bytes()


def test_mindformers_checkpoint_monitor_layout(mf_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(mf_save / "checkpoint", tmp_path / "checkpoint")
    selection = find_latest(save)
    assert selection.format == "mindformers" and selection.path == str(save / "rank_0/mf_rank_0-2_4.ckpt")
    (tmp_path / "health_ckpts.json").write_text(json.dumps(
        [{"is_health": 0, "ckpt_name": "mf_rank_0-2_2.ckpt"}, {"is_health": 1, "ckpt_name": "mf_rank_0-2_4.ckpt"}]))
    selection = find_latest(save, "mindformers", rank=0)
    assert (selection.epoch, selection.step) == (2, 2) and "unhealthy" in selection.skipped[0].reason
    alone = find_latest(save / "rank_0")  # one rank's folder alone, as each rank examines its own under msrun
    assert alone.format == "mindformers" and (alone.epoch, alone.step) == (2, 2), alone
    damage.truncate(save / "rank_0/mf_rank_0-2_2.ckpt")
    selection = find_latest(save, rank=0)
    assert (selection.epoch, selection.step) == (1, 4) and len(selection.skipped) == 2


def test_mindformers_iteration_layout(mf_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(mf_save / "iterations", tmp_path / "iterations")
    selection = find_latest(save)
    assert (selection.format, selection.iteration, selection.step) == ("mindformers", 4, 4)
    assert not selection.skipped
    newest = save / "iteration_00000004"
    damage.truncate(newest / "opt-0000000-0000001.safetensors")
    (newest / "common.json").write_text('{"epoch_num": 1,')
    (save / "latest_checkpointed_iteration.txt").write_text("6")
    selection = find_latest(save)
    assert selection.iteration == 2 and selection.step == 2
    reasons = [s.reason for s in selection.skipped]
    assert reasons[0] == "named by latest_checkpointed_iteration.txt but missing"
    assert "common.json: not valid JSON" in reasons[1] and "opt-0000000: safetensors header length" in reasons[1]


def test_hf_trainer_checkpoints(hf_save: Path, tmp_path: Path, damage) -> None:
    assert (find_latest(hf_save).format, find_latest(hf_save).iteration) == ("hf", 6)
    save = damage.copy(hf_save, tmp_path / "out")
    shutil.copytree(save / "checkpoint-6", save / "tmp-checkpoint-8")
    (save / "checkpoint-6" / "trainer_state.json").write_text("{")
    selection = find_latest(save, "hf")
    assert selection.iteration == 4
    assert [Path(s.path).name for s in selection.skipped] == ["tmp-checkpoint-8", "checkpoint-6"]
    assert "trainer_state.json: not valid JSON" in selection.skipped[1].reason


def test_hf_resume_through_the_hook_is_byte_identical_to_the_uninterrupted_run(
        hf_save: Path, tmp_path: Path, damage) -> None:
    save = damage.copy(hf_save, tmp_path / "out")
    damage.truncate(save / "checkpoint-6" / "model.safetensors")
    (save / "checkpoint-4" / "optimizer.pt").unlink()
    output = _script("hf_train.py", str(save), "--resume", cwd=tmp_path, damage=damage)
    assert f"resuming from {save / 'checkpoint-2'}" in output
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        assert (save / "checkpoint-6" / name).read_bytes() == (hf_save / "checkpoint-6" / name).read_bytes(), name


class Exchange:
    """An all-gather among threads standing for ranks: each gives its values and gets every rank's, in rank order."""

    def __init__(self, ranks: int) -> None:
        self.barrier, self.values, self.rounds = threading.Barrier(ranks), [()] * ranks, 0

    def gather_for(self, rank: int) -> Callable[[tuple[int, ...]], list[tuple[int, ...]]]:
        def gather(values: tuple[int, ...]) -> list[tuple[int, ...]]:
            self.values[rank] = tuple(values)
            if self.barrier.wait() == 0:
                self.rounds += 1
            gathered = list(self.values)
            self.barrier.wait()
            return gathered

        return gather


def _agreed_on_own_disks(nodes: list[Path], allow_scratch: bool = False) -> list[object]:
    """Each rank's ``Resume.choose`` on its own disk (``nodes[rank]``: only its ``rank_N`` there), all at once, as
    ResumeCallback makes it under msrun; each answer a Selection, or the error it raised."""
    from ft_plugins.features.resume import Resume

    exchange, answers = Exchange(len(nodes)), [None] * len(nodes)

    def rank_does(rank: int) -> None:
        resume = Resume("ms", {**{option.name: option.default for option in Resume.options},
                               "allow_scratch": allow_scratch})
        resume.start()
        try:
            answers[rank] = resume.choose(str(nodes[rank]), rank=rank, gather=exchange.gather_for(rank))
        except Exception as exc:  # noqa: BLE001 - the answer under test
            answers[rank] = exc

    threads = [threading.Thread(target=rank_does, args=(rank,)) for rank in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


def _node_local(ms_save: Path, root: Path, damage) -> list[Path]:
    """The save as disks each rank alone sees: ``node0/rank_0``, ``node1/rank_1``."""
    save = damage.copy(ms_save, root / "shared")
    for rank in (0, 1):
        shutil.move(save / f"rank_{rank}", root / f"node{rank}" / f"rank_{rank}")
    return [root / "node0", root / "node1"]


def test_ranks_on_their_own_disks_agree_on_the_newest_checkpoint_intact_on_every_rank(
        ms_save: Path, tmp_path: Path, damage) -> None:
    """Rank 1's newest truncated on its own disk: alone, rank 0 would take step 2_4 and rank 1 step 2_2 (the
    negative control); agreeing, both take 2_2, each having read its own files only."""
    nodes = _node_local(ms_save, tmp_path, damage)
    damage.truncate(nodes[1] / "rank_1" / "net-2_4.ckpt")
    alone = [find_latest(nodes[rank], rank=rank) for rank in (0, 1)]
    assert [(s.epoch, s.step) for s in alone] == [(2, 4), (2, 2)]
    answers = _agreed_on_own_disks(nodes)
    assert [(s.epoch, s.step) for s in answers] == [(2, 2), (2, 2)], answers
    assert [s.path for s in answers] == [str(nodes[rank] / f"rank_{rank}" / "net-2_2.ckpt") for rank in (0, 1)]
    assert answers[0].skipped[0].reason == "intact here, but not on every rank (they agree on epoch 2, step 2 or older)"
    assert "field runs past the end" in answers[1].skipped[0].reason
    shared = damage.copy(ms_save, tmp_path / "one_disk")  # one disk for all: each rank still reads only its rank_N
    damage.truncate(shared / "rank_1" / "net-2_4.ckpt")
    on_shared = _agreed_on_own_disks([shared, shared])
    assert [s.path for s in on_shared] == [str(shared / f"rank_{rank}" / "net-2_2.ckpt") for rank in (0, 1)]
    assert on_shared[0].skipped[0].reason == answers[0].skipped[0].reason  # not rank 1's damage: never read
    os.unlink(nodes[0] / "rank_0" / "net-2_2.ckpt")  # a hole on rank 0 too: the next step down on both
    assert [(s.epoch, s.step) for s in _agreed_on_own_disks(nodes)] == [(1, 4), (1, 4)]


def test_a_rank_that_holds_nothing_makes_every_rank_refuse_or_start_afresh_alike(ms_save: Path, tmp_path: Path,
                                                                               damage) -> None:
    from ft_plugins.checkpoint.errors import NoIntactCheckpoint

    nodes = _node_local(ms_save, tmp_path, damage)
    shutil.rmtree(nodes[1])  # a new node, its disk empty
    refused = _agreed_on_own_disks(nodes)
    assert all(isinstance(answer, NoIntactCheckpoint) for answer in refused), refused
    assert "rank 1 holds no intact one the others hold" in str(refused[0].skipped[-1])
    assert [answer.path for answer in _agreed_on_own_disks(nodes, allow_scratch=True)] == [None, None]
    shutil.rmtree(nodes[0])  # nothing anywhere: a first start, on both
    assert [(answer.path, answer.skipped) for answer in _agreed_on_own_disks(nodes)] == [(None, []), (None, [])]
