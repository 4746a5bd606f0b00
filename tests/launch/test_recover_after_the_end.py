"""``recover`` under ``ft-plugins run -- torchrun`` with two plain Python workers: a worker failing once its peer
finished training is not replaced (its replacement would wait for a peer that is gone), nor one failing after its own
training loop returned (it told the launcher so, as Megatron's ``train`` wrapped by ``recover`` does: a crash on its
way out); the same failure while the peer still runs is (the control). Both seen with MindIO's recovery: rank 0,
slower at the end, exited with an error after ranks 1 to 3 had ended; a replacement's process aborted at exit after
its last step (``terminate called without an active exception``). Each time a replacement waited for peers that would
never come back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch_support import Vendors, ft_run, launch_env
from support import TORCHRUN, free_port

WORKER = """import os, sys, time
rank = os.environ["RANK"]
with open(os.environ["STARTS"], "a+") as starts:
    starts.write(rank + "\\n")
    starts.seek(0)
    first = starts.read().split().count(rank) == 1
if rank == "0" and first:  # the process torchrun started fails, a replacement does not
    time.sleep(float(os.environ["FAILS_AFTER"]))
    if os.environ["TRAINED"] == "1":
        from datetime import timedelta
        from torch.distributed import PrefixStore, TCPStore
        from ft_plugins.recovery import mark_trained, worker_namespace
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))
        mark_trained(lambda: PrefixStore(worker_namespace(os.environ), store), 0)
    sys.exit(3)
time.sleep(float(os.environ["PEER_ENDS_AFTER"]))
"""


def _job(vendors: Vendors, workdir: Path, fails_after: float, peer_ends_after: float, trained: bool = False
         ) -> tuple[subprocess.CompletedProcess, list[str]]:
    (workdir / "worker.py").write_text(WORKER)
    env = launch_env(vendors, workdir, STARTS=str(workdir / "starts"), FAILS_AFTER=str(fails_after),
                     PEER_ENDS_AFTER=str(peer_ends_after), TRAINED=str(int(trained)))
    result = ft_run(["--features", "recover,ttp", "--", TORCHRUN, "--nproc-per-node", "2", "--master-port",
                     str(free_port()), str(workdir / "worker.py")], env, workdir, timeout=120)
    return result, (workdir / "starts").read_text().split()


@pytest.mark.parametrize("peer", ["finished", "running"])
def test_a_failure_after_a_peer_finished_is_left_to_torchrun(vendors: Vendors, tmp_path: Path, peer: str) -> None:
    finished = peer == "finished"
    result, starts = _job(vendors, tmp_path, fails_after=3 if finished else 0, peer_ends_after=0 if finished else 3)
    if finished:
        assert result.returncode != 0 and sorted(starts) == ["0", "1"], result.stderr[-3000:]
        assert ("recover: rank 0 exited with code 3 and is not replaced: rank 1 finished already (exit code 0), no "
                "peer is left to repair it from") in result.stderr
    else:
        assert result.returncode == 0 and sorted(starts) == ["0", "0", "1"], result.stderr[-3000:]
        assert "recover: rank 0 exited with code 3; replacement pid" in result.stderr


def test_a_failure_after_the_workers_own_training_ended_is_left_to_torchrun(vendors: Vendors, tmp_path: Path) -> None:
    result, starts = _job(vendors, tmp_path, fails_after=0, peer_ends_after=15, trained=True)  # torch's import
    assert result.returncode != 0 and sorted(starts) == ["0", "1"], result.stderr[-3000:]
    assert ("recover: rank 0 exited with code 3 and is not replaced: rank 0 had finished training, nothing is left "
            "to repair") in result.stderr
