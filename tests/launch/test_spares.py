"""When the launcher starts a new warm spare: never while a recovery is under way (its imports would take the
CPU from the replacement's set-up), at once when none is."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ft_plugins.launch.recover import Supervisor
from ft_plugins.recovery import key


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
