"""``ttp``'s dump on megatron-core 0.19 (installed beside the suite's 0.17.1): a rank killed after 3 steps, the
survivor's dump of step 3 committed and bit for bit the same run's own save of step 3, and a plain ``--load``
relaunch goes on from it to the end. On 0.19 the dump failed before ``unwrap_model`` was looked up where that
release keeps it (``megatron.core.utils``): nothing was saved. ``recover`` with replicas on 0.19: 4 ranks, the
distributed optimizer in the 2 instances ft_plugins sets, rank 1 lost and replaced in place from rank 3 (the same
place of the other instance), the final save (``distrib_optim.pt`` included) the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support import NEWER_MEGATRON, PYTHON, TRAINED_ON_0_19, assert_bit_identical
from ttp_runs import ITERS, Job, Launch, committed_dump, run_supervised

NEWER = Launch(2, env=(("PYTHONPATH", str(NEWER_MEGATRON)),))
STEP = 3
HERE = Path(__file__).resolve().parent
COMPARE = "import json, sys; from ttp_runs import differences; print(json.dumps(differences(sys.argv[1], sys.argv[2])))"


def _differences_under_0_19(left: Path, right: Path) -> list[str]:
    """``differences`` run where 0.19's classes unpickle: the saves hold its argument namespace and enums."""
    path = os.pathsep.join([str(NEWER_MEGATRON), str(HERE), str(HERE.parent)])
    child = subprocess.run([PYTHON, "-c", COMPARE, str(left), str(right)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def newer_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return NEWER.reference(tmp_path_factory.mktemp("newer_reference"))


@pytest.fixture(scope="module")
def newer_dumped(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return NEWER.run(tmp_path_factory.mktemp("newer_dumped"), "--save-interval", "100", FT_PLUGINS="ttp,resume",
                     FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")


def test_the_dump_on_megatron_core_0_19_is_committed_and_is_its_own_save(newer_dumped: Job,
                                                                         newer_reference: Job) -> None:
    assert TRAINED_ON_0_19 in newer_dumped.output, "the run used 0.19"
    committed_dump(newer_dumped, STEP)
    assert not newer_dumped.lines("dump failed"), newer_dumped.output[-3000:]
    shard = "mp_rank_00/model_optim_rng.pt"
    assert _differences_under_0_19(newer_dumped.iteration(STEP) / shard, newer_reference.iteration(STEP) / shard) == []


def test_a_plain_load_relaunch_goes_on_from_the_dump_to_the_end(newer_dumped: Job) -> None:
    resumed = NEWER.resume(newer_dumped, "--save-interval", "100", FT_PLUGINS="resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"loading checkpoint from {resumed.save} at iteration {STEP}")
    assert resumed.lines(f"iteration        {STEP + 1}/       {ITERS}")
    assert resumed.tracker() == str(ITERS)


# recover with replicas on 0.19: DP=4, the distributed optimizer, ft_plugins' replicas (auto: 2 instances)
REPLICATED = Launch(4, ("--micro-batch-size", "1", "--global-batch-size", "4", "--use-distributed-optimizer"),
                    NEWER.env)


@pytest.fixture(scope="module")
def newer_recovered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Job]:
    """The uninterrupted run (Megatron asked for the 2 instances ft_plugins sets) and the run with rank 1 lost."""
    reference = REPLICATED.reference(tmp_path_factory.mktemp("newer_replicated_reference"), "--save-interval", "100",
                                     "--num-distributed-optimizer-instances", "2")
    recovered = run_supervised(tmp_path_factory.mktemp("newer_recovered"), REPLICATED, "--save-interval", "100",
                               FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT="rank=1,step=2,kind=kill")
    return reference, recovered


def test_recover_with_replicas_on_megatron_core_0_19_ends_bit_identical(newer_recovered: tuple[Job, Job]) -> None:
    reference, recovered = newer_recovered
    assert recovered.returncode == 0, recovered.output[-5000:]
    assert TRAINED_ON_0_19 in recovered.output, "the run used 0.19"
    assert recovered.lines("with 2 replicas over data-parallel size 4")
    sent = recovered.lines("sent the state of step 2 (")
    assert len(sent) == 1 and sent[0].endswith("to rank 1") and "rank 3 sent" in sent[0], sent  # the same place
    final = f"iter_{ITERS:07d}/mp_rank_00"
    assert _differences_under_0_19(recovered.save / final / "model_optim_rng.pt",
                                   reference.save / final / "model_optim_rng.pt") == []
    assert_bit_identical(reference.save / final / "distrib_optim.pt", recovered.save / final / "distrib_optim.pt",
                         parts=None)
