"""``hangs`` across nodes on an asynchronous backend: two torchrun agents as two nodes of 2 ranks (``--nnodes 1:2``,
c10d rendezvous, each under ``ft-plugins run``, ``FT_PLUGINS=hangs``), real gloo. In step 5, rank 2 (node 1) stops
for good (SIGSTOP) outside any collective; rank 3 waits for it in a synchronous all-reduce; ranks 0 and 1 (node 0)
entered the same all-reduce asynchronously and wait on it from their own frames, as ranks of NCCL or HCCL wait at a
host sync.

- With the counts: node 1's launcher ends rank 2 alone; node 0's finds its ranks ahead of a rank of node 1 in the
  world group's collectives (node 1's entry in the rendezvous store) and leaves them waiting.
- Negative control, the same job with the counting taken off in the workers: node 0's launcher sees two ranks
  stopped outside collectives and stops the whole job (its local counts alone could not have told: ranks 0 and 1
  entered the same collectives).
- The counted job again with the default group on the test backend with NCCL's semantics
  (``tests/fakes/blocking_backend``: every wait is the backend's own, never a gloo frame): the same verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents import Agents, run_agents
from support import FAKES, path_first

WORKER = """\
import os, signal, sys, time
import torch
import torch.distributed as dist
import ft_plugins.torch
from ft_plugins import progress

if sys.argv[1] == "uncounted":
    ft_plugins.torch.disable()
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} on backend {dist.get_backend()}", flush=True)
for step in range(1, 5):
    progress.report(progress.STEP, step)
    dist.all_reduce(torch.ones(1))
    time.sleep(0.2)
progress.report(progress.STEP, 5)
if rank == 2:
    print("rank 2 stops for good", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
elif rank == 3:
    dist.all_reduce(torch.ones(1))
else:
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait()
"""
HANGS = {"FT_PLUGINS": "hangs", "FT_PLUGINS_HANGS_FLOOR": "6", "FT_PLUGINS_HANGS_WARMUP_STEPS": "1",
         "FT_PLUGINS_HANGS_STALL": "6", "FT_PLUGINS_HANGS_GRACE": "1"}
ELSEWHERE = "not ended: every local rank waits in a collective: for a rank elsewhere"
STOPPED = "every rank of this node stopped outside collectives"


def _job(workdir: Path, mode: str, **env: str) -> Agents:
    script = workdir / "worker.py"
    script.write_text(WORKER)
    return run_agents(workdir, (str(script), mode), last_call=15, timeout=240, **HANGS, **env)


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> Agents:
    return _job(tmp_path_factory.mktemp("counted"), "counted")


@pytest.fixture(scope="module")
def uncounted(tmp_path_factory: pytest.TempPathFactory) -> Agents:
    return _job(tmp_path_factory.mktemp("uncounted"), "uncounted")


@pytest.fixture(scope="module")
def blocking(tmp_path_factory: pytest.TempPathFactory) -> Agents:
    return _job(tmp_path_factory.mktemp("blocking"), "counted", PYTHONPATH=path_first(FAKES / "blocking_backend"),
                FT_FAKE_BLOCKING="1")


@pytest.mark.parametrize("backend", ["counted", "blocking"])
def test_the_hung_rank_alone_is_ended_and_the_other_node_s_waiters_are_left_waiting(
        backend: str, request: pytest.FixtureRequest) -> None:
    first, second = request.getfixturevalue(backend).outputs
    on = "blocking" if backend == "blocking" else "gloo"
    assert all(f"rank {rank} on backend {on}" in first + second for rank in range(4)), (first + second)[-6000:]
    assert "hangs: rank 2 (pid" in second and "it is ended" in second, second[-6000:]
    assert "hangs: rank 3 waits for it in a collective (ahead of a peer in a process group's collectives: 3)" \
        in second, second[-6000:]
    assert ELSEWHERE in first and STOPPED not in first, first[-6000:]
    assert "hangs: rank 0 (pid" not in first and "hangs: rank 1 (pid" not in first


def test_negative_control_uncounted_the_other_node_stops_the_whole_job(uncounted: Agents) -> None:
    first, _ = uncounted.outputs
    assert STOPPED in first and ELSEWHERE not in first, first[-6000:]
