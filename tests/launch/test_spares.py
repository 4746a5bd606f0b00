"""When the launcher starts a new warm spare: never while a recovery is under way (its imports would take the
CPU from the replacement's set-up), at once when none is; and a real spare's CPU priority: the lowest while
it imports and waits, the workers' own once it took over."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ft_plugins.launch import spare
from ft_plugins.launch.recover import Supervisor
from ft_plugins.recovery import key
from support import PYTHON, REPO


class Store:
    """torchrun's store as the supervisor uses it: ``add(key, 0)`` reads a counter."""

    def __init__(self, **counters: int) -> None:
        self.counters = counters
        self.fails = False
        self.calls = 0

    def add(self, name: str, amount: int) -> int:
        self.calls += 1
        if self.fails:
            raise ConnectionError("store host gone")
        self.counters[name] = self.counters.get(name, 0) + amount
        return self.counters[name]


class Spares:
    def __init__(self) -> None:
        self.refills = 0

    def refill(self, context: Any) -> None:
        self.refills += 1

    def stop(self) -> None:
        pass


def _round(supervisor: Supervisor) -> int:
    """One monitoring round of a healthy 4-worker group; the refills it made."""
    worker = SimpleNamespace(world_size=4, id=None)
    group = SimpleNamespace(workers=[worker] * 4)
    context = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))},
                              _running_local_ranks={0}, pids=lambda: {0: 1})
    before = supervisor.spares.refills
    supervisor.monitor(lambda *a, **k: SimpleNamespace(state=SimpleNamespace(name="HEALTHY")),
                       SimpleNamespace(_pcontext=context), (group,), {})
    return supervisor.spares.refills - before


def test_a_spare_is_started_only_once_the_recovery_is_done() -> None:
    supervisor = Supervisor()
    supervisor.spares = Spares()  # type: ignore[assignment]
    assert _round(supervisor) == 1  # no recovery yet
    supervisor.generation, supervisor.store = 1, Store(**{key(1, "done"): 3})
    assert _round(supervisor) == 0  # 3 of 4 ranks repaired: the replacement is still setting up
    supervisor.store.counters[key(1, "done")] = 4
    assert _round(supervisor) == 1
    calls = supervisor.store.calls
    assert _round(supervisor) == 1 and supervisor.store.calls == calls  # a settled generation is not asked again
    supervisor.generation = 2
    supervisor.store.fails = True  # the store host gone: the next failure says so; the spare costs nothing
    assert _round(supervisor) == 1


def _nice_values(pid: int | str) -> set[int]:
    """The nice value of every thread of ``pid`` (field 19 of each task's stat)."""
    values = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            values.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return values


def test_a_spare_waits_at_the_lowest_priority_and_takes_over_at_the_workers(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys\n"
                      "sys.path.insert(0, os.environ['TESTS'])\n"
                      "from launch.test_spares import _nice_values\n"
                      "print(json.dumps({'nice': sorted(_nice_values('self')), 'rank': os.environ['RANK']}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FT_PLUGINS": "none"}
    process = subprocess.Popen([PYTHON, "-u", "-m", "ft_plugins.launch.spare", str(script)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == spare.READY
        waiting = _nice_values(process.pid)  # torch's threads included: started after the priority was lowered
        out, err = process.communicate(json.dumps({"RANK": "3", "TESTS": str(REPO / "tests")}) + "\n", timeout=120)
    finally:
        process.kill()
    assert waiting == {spare.LOWEST}
    told = [line for line in err.splitlines() if line.startswith("{")]  # after its readiness, output is stderr
    assert [json.loads(line) for line in told] == [{"nice": [os.getpriority(os.PRIO_PROCESS, 0)], "rank": "3"}], err


def test_a_process_that_could_not_raise_its_priority_back_does_not_lower_it(monkeypatch: pytest.MonkeyPatch) -> None:
    lowered: list[int] = []
    monkeypatch.setattr(spare, "may_raise_priority", lambda nice: False)
    monkeypatch.setattr(os, "setpriority", lambda which, who, nice: lowered.append(nice))
    spare.lower_priority()()
    assert lowered == []
    monkeypatch.setattr(spare, "may_raise_priority", lambda nice: True)
    spare.lower_priority()()
    assert lowered[0] == spare.LOWEST and set(lowered[1:]) == {os.getpriority(os.PRIO_PROCESS, 0)}
