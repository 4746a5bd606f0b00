"""Torchrun agents as the nodes of one elastic job (``--nnodes 1:N``, c10d rendezvous), each under ``ft-plugins run``,
on any training script; nodes lost for good at steps the test chooses: the rank named hangs in that step
(``kind=stuck``), and once it says so the test stops and kills its agent with every process under it, as a node that
loses power. The first agent hosts the rendezvous store (``is_host``): the survivors' store. A lost node can come
back: a new agent for it, started once the first node's output says a given line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from support import TORCHRUN, abort_descendants, free_port, kill_tree

NODE_LOST = "firing injected fault"  # what the stuck rank says once it stands still in the chosen step
# one thread per worker, as torchrun sets it for 2 processes or more per node (not for 1): the reference runs' own,
# without which a matrix product sums in another order
THREADS = {"OMP_NUM_THREADS": "1"}
STARTED = 2.0  # seconds the first agent gets to bind the store before the second starts
STACKS = 3.0  # seconds a hung job's processes get to write their stacks once aborted


@dataclass
class Agents:
    """The exit codes and output of the agents (the first node's, the second's, the second's again when it came
    back)."""

    codes: tuple[int | None, ...]
    outputs: tuple[str, ...]

    @property
    def output(self) -> str:
        return "\n".join(self.outputs)


def run_agents(workdir: Path, script: Sequence[str], nodes: int = 2, per_node: int = 2, lose: tuple[int, ...] = (),
               rejoin: str = "", restarts: int = 0, last_call: int = 30, timeout: float = 420,
               **env: str) -> Agents:
    """``script`` (the training script and its arguments) on ``nodes`` x ``per_node`` ranks as that many agents
    (``--nnodes 1:NODES``), the first hosting the store, each with an address of its own in 127/8 that sorts after
    the one before (c10d numbers the agents in the order of their address, then pid: pids wrap around on a busy
    machine), so the ranks go up with the nodes; ``lose``: global ranks, each of whose node is lost once that rank
    fired its injected ``stuck`` fault (never the first node's); ``rejoin``: the line of the first node's output after
    which the (first) lost node comes back; ``restarts``: torchrun's ``--max-restarts``; ``last_call``: the seconds
    c10d's rendezvous waits for more nodes once it has the fewest (its default 30)."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
    agents: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(node: int) -> None:
        command = [sys.executable, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nnodes", f"1:{nodes}",
                   "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", "elastic", "--local-addr", f"127.0.0.{node + 1}", "--rdzv-conf",
                   f"is_host={int(node == 0)},last_call_timeout={last_call}", "--max-restarts", str(restarts), *script]
        logs.append(workdir / f"node{node}{'b' if len(logs) >= nodes else ''}.log")
        with logs[-1].open("w") as out:
            agents.append(subprocess.Popen(command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                           env={"PYTHONFAULTHANDLER": "1", **clean, **THREADS, **env}))

    for node in range(nodes):
        start(node)
        time.sleep(STARTED if node == 0 else 0.5)
    pending = {rank // per_node for rank in lose}
    if 0 in pending:
        raise ValueError("the first node hosts the store: lose ranks of the others")
    deadline, back = time.monotonic() + timeout, not rejoin
    try:
        while any(agent.poll() is None for agent in agents):
            if time.monotonic() > deadline:  # every process's stacks first (faulthandler), then the logs
                for agent in agents:
                    abort_descendants(agent.pid)
                time.sleep(STACKS)
                raise AssertionError(f"still running after {timeout:.0f} s:\n"
                                     + "\n".join(log.read_text()[-12000:] for log in logs))
            for node in sorted(pending):
                if NODE_LOST in logs[node].read_text():
                    power_off(agents[node].pid)
                    pending.discard(node)
            if lose and not pending and not back and rejoin in logs[0].read_text():
                start(lose[0] // per_node)
                back = True
            time.sleep(0.2)
    finally:
        for agent in agents:
            if agent.poll() is None:
                abort_descendants(agent.pid)
                kill_tree(agent.pid)
    return Agents(tuple(agent.returncode for agent in agents), tuple(log.read_text() for log in logs))


def power_off(pid: int) -> None:
    """A node losing power: the agent and every process under it stopped first, the agent before its workers (so
    none of them acts on another's end: the agent would start a replacement for a worker killed before it), then
    killed."""
    import psutil

    try:
        root = psutil.Process(pid)
        root.suspend()
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.suspend()
        except psutil.NoSuchProcess:
            pass
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
