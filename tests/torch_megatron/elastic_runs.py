"""The Megatron example as the nodes of one elastic job (:mod:`agents`): DP = nodes x ranks per node, micro-batch 1,
global batch 4, saves into the work directory's ``ckpt``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agents import run_agents
from support import MEGATRON_EXAMPLE
from ttp_runs import Job


@dataclass
class Nodes:
    """The exit codes and output of the agents, and the job as its save folder and whole output show it."""

    job: Job
    codes: tuple[int | None, ...]
    outputs: tuple[str, ...]


def elastic_job(workdir: Path, *args: str, **options: object) -> Nodes:
    """The example with ``args`` under :func:`agents.run_agents` (``options``: its own)."""
    save = workdir / "ckpt"
    script = (str(MEGATRON_EXAMPLE), "--micro-batch-size", "1", "--global-batch-size", "4", "--save-interval", "100",
              "--save", str(save), *args)
    agents = run_agents(workdir, script, **options)  # type: ignore[arg-type]
    return Nodes(Job(agents.codes[0], agents.output, save), agents.codes, agents.outputs)
