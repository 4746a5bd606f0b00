"""``hangs`` on real 2-rank torchrun runs of Megatron's ``pretrain()`` (CPU, gloo), launched as ``ft-plugins run --
torchrun ...``, each against the uninterrupted run.

Rank 1 gets stuck for good (deaf to SIGTERM, as a process in a driver call) after 3 completed steps; rank 0 then
waits for it in the step's gradient all-reduce. The launcher finds it within the step bound (3 s here), logs its
stacks, ends it, and the job goes the way a death goes: with ``recover`` rank 1 is replaced in place, with
``ttp,resume`` and ``--max-restarts 2`` (rank 1 stuck inside its optimizer update of step 4: rank 0 had finished
its own) rank 0 dumps step 4 and the restarted job resumes from it; in that restarted job rank 1 then waits in a
receive rank 0 never sends (a collective a peer never enters) while rank 0 waits for it in the all-reduce: both
wait, but rank 1 is missing from rank 0's collective (the counts), so it is ended, met by a second dump (of step 5)
and restart. Either way the
job ends by itself, exit 0, its final save bit for bit the uninterrupted run's. In the ``recover`` run, rank 1's
first step and its save of step 2 pause 8 s each first (rank 0 waits for it): past the step bound, within the
warm-up's and the save's, no hang, and the slow first step does not raise the step bound. Without ft_plugins, the
same hang is still waiting well past the time ft_plugins took.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from report_check import check_faults
from step_bounds import step_bound
from ttp_runs import ITERS, Job, Launch, run_supervised, same_as_reference
from support import MEGATRON_EXAMPLE, TORCHRUN, free_port, kill_tree

STEP = 3  # rank 1 gets stuck in the step after 3 completed steps
BOUNDS = {"FT_PLUGINS_HANGS_FLOOR": "3", "FT_PLUGINS_HANGS_WARMUP": "120", "FT_PLUGINS_HANGS_WARMUP_STEPS": "1",
          "FT_PLUGINS_HANGS_SAVE": "60", "FT_PLUGINS_HANGS_GRACE": "1"}
TWO = Launch(2)  # the shape of the shared 2-rank reference
STUCK = f"rank=1,step={STEP},kind=stuck"
STACK = "ft_plugins/faults.py"  # where the drill's stuck rank stands
COLLECTIVE = f"rank=1,step={ITERS - 1},kind=stuck,at=collective,attempt=1"  # the restarted job's second step
SLOW_FIRST = "rank=1,step=0,kind=slow,seconds=8"  # a first step of 8 s: compilation, say


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """recover in place; rank 1's first step and its save of step 2 slow (8 s each), then rank 1 stuck in forward
    after 3 steps."""
    return run_supervised(tmp_path_factory.mktemp("hang_recover"), TWO, "--save-interval", "2",
                          FT_PLUGINS="ttp,recover,hangs", **BOUNDS,
                          FT_PLUGINS_INJECT_FAULT=f"{SLOW_FIRST};rank=1,step=2,kind=slow,at=save,seconds=8;{STUCK}")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """ttp's dump and torchrun's restart; rank 1 stuck inside its optimizer update after 3 steps, then, in the
    restarted job, stuck in a collective rank 0 never enters after 5 steps."""
    workdir = tmp_path_factory.mktemp("hang_restart")
    save = workdir / "ckpt"
    return run_supervised(workdir, TWO, "--load", str(save), "--save-interval", "100",
                          launcher=("--standalone", "--max-restarts", "2"), FT_PLUGINS="ttp,resume,hangs", **BOUNDS,
                          TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                          FT_PLUGINS_INJECT_FAULT=f"{STUCK},at=update;{COLLECTIVE}")


def _hung_lines(job: Job) -> list[str]:
    return job.lines("hangs: rank 1 (pid")


def test_a_hang_with_recover_replaces_the_rank_in_place_and_ends_bit_identical(recovered: Job, reference: Job) -> None:
    assert recovered.returncode == 0, recovered.output[-4000:]
    hung = _hung_lines(recovered)
    assert len(hung) == 1 and f"in step of step {STEP + 1} (bound " in hung[0], recovered.output[-4000:]
    step_bound(recovered, hung[0])  # the rule's, for the steps this machine ran
    assert recovered.lines("hangs: rank 0 waits for it in a collective")
    assert recovered.lines("recover: rank 1 exited with code -9; replacement pid")
    assert recovered.lines(f"every rank stands at step {STEP}, training continues at step {STEP + 1}")
    assert not recovered.lines("loading checkpoint") and not recovered.lines("dumped")
    assert same_as_reference(recovered, reference, ITERS) == []  # model, optimizer, RNG


def test_the_hung_rank_s_stacks_are_in_the_log(recovered: Job) -> None:
    after = recovered.output.split(_hung_lines(recovered)[0], 1)[1]
    assert "Its stacks:" in _hung_lines(recovered)[0]
    stacks, victim = after.split("hangs: rank 0 waits", 1)
    assert STACK in stacks and "ft_plugins/torch/megatron/drill.py" in stacks and "in train_step" in stacks
    # rank 1 stood still before its step's gradient reduction, which rank 0 entered: Megatron's collectives counted
    assert victim.splitlines()[0] == " for it in a collective (ahead of a peer in a process group's collectives: 0)"


def test_a_save_slower_than_the_step_bound_is_no_hang(recovered: Job) -> None:
    assert recovered.lines("firing injected fault rank=1,step=2,kind=slow,at=save")
    ended = recovered.lines("made no progress")
    assert len(ended) == 1 and f"in step of step {STEP + 1}" in ended[0], f"only the real hang was ended: {ended}"
    took = [float(ms) for ms in re.findall(r"save-checkpoint \.+: \(([\d.]+), ([\d.]+)\)", recovered.output)[0]]
    assert min(took) > 8000, "the save of step 2 took 8 s on both ranks, past the 3 s step bound"


def test_a_slow_first_step_is_no_hang_and_teaches_no_bound(recovered: Job) -> None:
    assert recovered.lines("firing injected fault rank=1,step=0,kind=slow,at=forward,attempt=0,seconds=8")
    bound, factor = step_bound(recovered, _hung_lines(recovered)[0])
    assert bound < factor * 8, "the 8 s warm-up step taught the step bound nothing"


def test_a_hang_with_ttp_and_torchrun_restarts_dumps_restarts_and_resumes_bit_identical(
        restarted: Job, reference: Job) -> None:
    assert restarted.returncode == 0, restarted.output[-4000:]
    hung = _hung_lines(restarted)  # the second: the hang in a collective (below)
    assert len(hung) == 2 and f"in step of step {STEP + 1}" in hung[0], restarted.output[-4000:]
    assert STACK in restarted.output.split(hung[0], 1)[1] and "step_with_ready_grads" in restarted.output
    # rank 0 had finished its own update of step 4 (no collective after it): it dumps step 4
    assert restarted.lines(f"rank 0 dumped mp_rank_00 of iteration {STEP + 1} in"), restarted.output[-4000:]
    assert restarted.lines(f"loading checkpoint from {restarted.save} at iteration {STEP + 1}")
    assert same_as_reference(restarted, reference, STEP + 1) == []
    assert same_as_reference(restarted, reference, ITERS, rng=False) == []  # after a resume: see differences()


def test_a_hang_in_a_collective_no_peer_enters_is_the_rank_missing_from_its_peer_s_met_by_dump_and_restart(
        restarted: Job, reference: Job) -> None:
    """Rank 1 waits in a receive rank 0 never sends, rank 0 for rank 1 in the gradient all-reduce: both wait in a
    collective, but rank 0 entered one more on their group than rank 1 did (Megatron's collectives counted), so rank 1
    is the one missing from its peer's: it is ended, and (no ``recover``) torchrun's SIGTERM releases rank 0 (ttp
    dumps step 5) and the job restarts."""
    assert restarted.returncode == 0, restarted.output[-4000:]
    assert restarted.lines(f"firing injected fault {COLLECTIVE}")
    hung = _hung_lines(restarted)
    assert len(hung) == 2 and f"in step of step {ITERS}" in hung[1], restarted.output[-4000:]
    stacks = restarted.output.split(hung[1], 1)[1]
    assert STACK in stacks and "_receive_from_nobody" in stacks, "the hung rank's stacks, where it waits"
    assert not restarted.lines("hangs: every rank stalled")
    assert restarted.lines(f"rank 0 dumped mp_rank_00 of iteration {ITERS - 1} in")
    assert restarted.lines(f"loading checkpoint from {restarted.save} at iteration {ITERS - 1}")
    assert same_as_reference(restarted, reference, ITERS - 1, rng=False) == []
    assert restarted.tracker() == str(ITERS)


def test_the_report_names_each_hang_killed_and_how_it_was_met(recovered: Job, restarted: Job) -> None:
    check_faults(recovered, [(1, "hang", "hang kill, in place", STEP)])
    check_faults(restarted, [(1, "hang", "hang kill, dump + restart", STEP),
                             (1, "hang", "hang kill, dump + restart", ITERS - 1)])


def test_negative_control_without_ft_plugins_the_same_hang_is_still_waiting(tmp_path: Path) -> None:
    """The drill alone (``FT_PLUGINS=none``): 10 s after rank 1 got stuck, past the 3 s bound and 1 s grace the
    watched runs took, the job still waits (for gloo's timeout: Megatron's 10 minutes)."""
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(MEGATRON_EXAMPLE),
               "--train-iters", str(ITERS), "--save", str(tmp_path / "ckpt"), "--save-interval", "100"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    process = subprocess.Popen(command, cwd=tmp_path, env={**clean, "FT_PLUGINS": "none", "FT_PLUGINS_INJECT_FAULT":
                                                           STUCK}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        fired = next((line for line in process.stdout if "firing injected fault" in line), "")
        assert f"rank=1,step={STEP},kind=stuck" in fired
        time.sleep(10)
        assert process.poll() is None, "the job ended by itself"
    finally:
        kill_tree(process.pid)  # torchrun's workers too: each runs in a session of its own
        process.wait()
