"""ReplicatedZeroOptimizer on real 4-rank gloo runs (torchrun) of a plain loop: DP=4, R=2 unless said.

Each run is made once per module; fixtures/zero_loop.py says what every rank writes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, TORCHRUN, assert_bit_identical, free_port, saved_tensors

LOOP = Path(__file__).resolve().parent / "fixtures" / "zero_loop.py"
STEPS = "6"
NO_INSTANCE = ("no complete optimizer instance among ranks [0, 3] (instance 0 [0, 1] lacks rank 1; instance 1 [2, 3] "
               "lacks rank 2): some optimizer shard has no surviving holder")


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, expect_ok: bool = True) -> Path:
    out = tmp_path_factory.mktemp(name)
    env = {**_clean_env(), "FT_PLUGINS": "none"}
    result = subprocess.run([TORCHRUN, "--nproc-per-node", "4", "--master-port", str(free_port()), str(LOOP),
                             "--out", str(out), "--steps", STEPS, *args],
                            env=env, capture_output=True, text=True, timeout=180)
    (out / "output.txt").write_text(result.stdout + result.stderr)
    assert (result.returncode == 0) == expect_ok, (result.stdout + result.stderr)[-4000:]
    return out


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}


def _reports(out: Path) -> dict[int, dict]:
    return {int(path.stem.split("_")[1]): json.loads(path.read_text()) for path in out.glob("rank_*.json")}


def _leftovers(out: Path) -> list[str]:
    return sorted(path.name for path in out.iterdir() if ".tmp" in path.name)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "r2", "--replicas", "2")


@pytest.fixture(scope="module")
def unreplicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "r1", "--replicas", "1")


@pytest.fixture(scope="module")
def one_lost(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "one_lost", "--replicas", "2", "--kill", "1", "--at", "4", expect_ok=False)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, one_lost: Path) -> Path:
    return _run(tmp_path_factory, "resumed", "--replicas", "2", "--resume", str(one_lost / "dump.pt"))


@pytest.fixture(scope="module")
def one_lost_per_instance(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, "two_lost", "--replicas", "2", "--kill", "1", "2", "--at", "4", expect_ok=False)


@pytest.fixture(scope="module")
def one_lost_unreplicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The negative control: the same fault as ``one_lost`` with plain ZeRO (one instance)."""
    return _run(tmp_path_factory, "one_lost_r1", "--replicas", "1", "--kill", "1", "--at", "4", expect_ok=False)


def test_instances_are_megatrons_and_replication_never_changes_numerics(replicated: Path,
                                                                       unreplicated: Path) -> None:
    assert {r["completed"] for r in _reports(replicated).values()} == {6}
    assert _reports(replicated)[0]["instances"] == [[0, 1], [2, 3]]
    assert _reports(unreplicated)[0]["instances"] == [[0, 1, 2, 3]]
    assert_bit_identical(replicated / "final.pt", unreplicated / "final.pt")


def test_each_shard_is_held_by_one_rank_of_each_instance(replicated: Path, unreplicated: Path) -> None:
    assert_bit_identical(replicated / "shard_0.pt", replicated / "shard_2.pt", parts=None)
    assert_bit_identical(replicated / "shard_1.pt", replicated / "shard_3.pt", parts=None)

    def held(run: Path) -> list[int]:
        return [sum(t.numel() for t in saved_tensors(run / f"shard_{rank}.pt", parts=None).values())
                for rank in range(4)]

    full = sum(t.numel() for t in saved_tensors(replicated / "final.pt", parts=("optimizer",)).values())
    assert sum(held(replicated)[:2]) == full and sum(held(replicated)) == 2 * full
    assert sum(held(unreplicated)) == full


def test_one_rank_killed_a_survivor_of_the_complete_instance_saves_the_last_completed_step(one_lost: Path) -> None:
    reports = _reports(one_lost)
    assert sorted(reports) == [0, 2, 3]  # rank 1 was SIGKILLed before it could report
    for report in reports.values():
        # the survivors saw the all-reduce fail: the lost peer's connection, or (on a busy machine, a survivor
        # whose ring neighbour was itself stuck) gloo's send timeout
        assert "gloo/transport/tcp" in report["failure"], report["failure"]
        assert report["completed"] == 3 and report["instance"] == [2, 3] and report["reason"] is None
    dump = saved_tensors(one_lost / "dump.pt", parts=("optimizer",))
    assert {name.split("/")[3] for name in dump if name.startswith("/optimizer/state/")} == set(map(str, range(6)))
    assert _leftovers(one_lost) == []


def test_a_fresh_run_loads_the_dump_and_continues_bit_identically(replicated: Path, resumed: Path) -> None:
    assert_bit_identical(replicated / "final.pt", resumed / "final.pt")


def test_one_rank_killed_in_each_instance_saves_nothing_and_says_why(one_lost_per_instance: Path) -> None:
    reports = _reports(one_lost_per_instance)
    assert sorted(reports) == [0, 3]
    assert {(r["instance"], r["reason"]) for r in reports.values()} == {(None, NO_INSTANCE)}
    assert not (one_lost_per_instance / "dump.pt").exists() and _leftovers(one_lost_per_instance) == []
    assert "optimizer state not saved: no complete optimizer instance" in \
        (one_lost_per_instance / "output.txt").read_text()


def test_without_replicas_the_same_single_loss_leaves_nothing_to_save(one_lost_unreplicated: Path) -> None:
    reports = _reports(one_lost_unreplicated)
    assert sorted(reports) == [0, 2, 3]
    assert {r["reason"] for r in reports.values()} == {
        "no complete optimizer instance among ranks [0, 2, 3] (instance 0 [0, 1, 2, 3] lacks rank 1): "
        "some optimizer shard has no surviving holder"}
    assert not (one_lost_unreplicated / "dump.pt").exists()


def test_import_stays_light_and_bad_arguments_are_clear_errors(tmp_path: Path) -> None:
    script = """
import os, sys
import ft_plugins.torch
assert "torch" not in sys.modules, "import ft_plugins.torch must not import torch"
Optimizer = ft_plugins.torch.ReplicatedZeroOptimizer
assert "torch.distributed.optim" in sys.modules
import torch, torch.distributed as dist
from ft_plugins.replicas import ReplicaLayoutError
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
params = list(torch.nn.Linear(2, 2).parameters())
for kwargs, expected in (({"replicas": 2}, ReplicaLayoutError), ({"replicas": 0}, ReplicaLayoutError)):
    try:
        Optimizer(params, torch.optim.SGD, lr=0.1, **kwargs)
    except expected as error:
        print(type(error).__name__, error)
print(Optimizer(params, torch.optim.SGD, lr=0.1).layout)
try:
    ft_plugins.torch.NoSuchThing
except AttributeError as error:
    print(error)
"""
    result = subprocess.run([PYTHON, "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                            env={**_clean_env(), "FT_PLUGINS": "none"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == ("ReplicaLayoutError data-parallel size 1 cannot be split into 2 optimizer replicas; "
                        "use a divisor of 1 (1) or 'auto'")
    assert lines[1].startswith("ReplicaLayoutError replica count must be a positive integer or 'auto', got 0")
    assert lines[2] == "ReplicaLayout(dp_ranks=(0,), replicas=1)"
    assert lines[3] == "module 'ft_plugins.torch' has no attribute 'NoSuchThing'"
    assert "optimizer state is not replicated" not in result.stderr  # one rank: nothing to lose to a peer
