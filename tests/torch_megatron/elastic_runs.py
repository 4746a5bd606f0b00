"""Two torchrun agents as two nodes of one elastic job (``--nnodes 1:2``, c10d rendezvous), each under
``ft-plugins run``, on the Megatron example; one node lost for good at a step the test chooses: the rank named
hangs in that step (``kind=stuck``), and once it says so the test SIGKILLs its agent with every process under it,
as a node that loses power. The first agent hosts the rendezvous store (``is_host``): the survivors' store. The lost
node can come back: a new agent for it, started once the first node's output says a given line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from support import MEGATRON_EXAMPLE, TORCHRUN, abort_descendants, free_port, kill_tree
from ttp_runs import Job

NODE_LOST = "firing injected fault"  # what the stuck rank says once it stands still in the chosen step
STARTED = 2.0  # seconds the first agent gets to bind the store before the second starts (and to have the lower pid)


@dataclass
class Nodes:
    """The exit codes and output of the agents (the first node's, the second's, the second's again when it came
    back), and the job as its save folder and whole output show it."""

    job: Job
    codes: tuple[int | None, ...]
    outputs: tuple[str, ...]


def two_nodes(workdir: Path, *args: str, lose: int | None = None, rejoin: str = "", restarts: int = 0,
              last_call: int = 30, timeout: float = 420, **env: str) -> Nodes:
    """DP=4 as two nodes of 2 ranks each; ``lose``: the global rank whose node is lost (it must be on the second
    agent: the first hosts the store), once it fired its injected ``stuck`` fault; ``rejoin``: the line of the first
    node's output after which the lost node comes back; ``restarts``: torchrun's ``--max-restarts``; ``last_call``:
    the seconds c10d's rendezvous waits for more nodes once it has the fewest (its default 30)."""
    save, port = workdir / "ckpt", free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    agents: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(node: int) -> None:
        command = [sys.executable, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nnodes", "1:2",
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "elastic", "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout={last_call}",
                   "--max-restarts", str(restarts),
                   str(MEGATRON_EXAMPLE), "--micro-batch-size", "1", "--global-batch-size", "4",
                   "--save-interval", "100", "--save", str(save), *args]
        logs.append(workdir / f"node{node}{'b' if len(logs) > 1 else ''}.log")
        with logs[-1].open("w") as out:
            agents.append(subprocess.Popen(command, cwd=workdir, env={"PYTHONFAULTHANDLER": "1", **clean, **env},
                                           stdout=out, stderr=subprocess.STDOUT))

    start(0)
    time.sleep(STARTED)
    start(1)
    deadline, lost, back = time.monotonic() + timeout, lose is None, not rejoin
    try:
        while any(agent.poll() is None for agent in agents):
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout:.0f} s:\n"
                                     + "\n".join(log.read_text()[-6000:] for log in logs))
            if not lost and NODE_LOST in logs[1].read_text():
                kill_tree(agents[1].pid)
                lost = True
            elif not lost and NODE_LOST in logs[0].read_text():
                raise AssertionError(f"rank {lose} ran on the first node, the store's host: lose one of the second's")
            elif lost and not back and rejoin in logs[0].read_text():
                start(1)
                back = True
            time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                abort_descendants(agent.pid)
                kill_tree(agent.pid)
    outputs = tuple(log.read_text() for log in logs)
    return Nodes(Job(agents[0].returncode, "\n".join(outputs), save), tuple(agent.returncode for agent in agents),
                 outputs)
