"""A worker that dies between the launcher's own look at the workers and torch's, in one monitoring round: torch's
process context would stop every worker for it (the whole job then dumps and restarts). The failure torch finds is
handed to the in-place replacement instead, and left to torchrun only when recovery refuses. Seen on a loaded
machine: an 8-rank job's killed rank was found by torch 70 ms after the launcher's look."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ft_plugins.launch.recover import Supervisor


def _round(refuse: bool = False) -> tuple[Supervisor, Any, Any, list[tuple]]:
    supervisor = Supervisor()
    group, context = SimpleNamespace(name="group"), SimpleNamespace(_failures={})
    replaced: list[tuple] = []

    def failed(worker_group: Any, failed_context: Any, local_rank: int, code: int) -> None:
        replaced.append((worker_group, failed_context, local_rank, code))
        if refuse:
            supervisor.refusal = "a second fault during recovery"

    supervisor._failed = failed  # type: ignore[method-assign]
    supervisor._round = (group, context)
    return supervisor, group, context, replaced


def _torch_finds(context: Any, *dead: int) -> Any:
    """What torch's ``_capture_process_failures(done_local_ranks)`` does for workers that exited with -9."""
    def capture(done: set[int]) -> None:
        for local_rank in dead:
            done.add(local_rank)
            context._failures[local_rank] = SimpleNamespace(exitcode=-9)
    return capture


def test_a_death_torch_finds_inside_the_round_is_replaced_in_place_not_stopped() -> None:
    supervisor, group, context, replaced = _round()
    done: set[int] = set()
    supervisor.capture(_torch_finds(context, 3), context, (done,), {})
    assert replaced == [(group, context, 3, -9)]
    assert context._failures == {} and done == set()  # torch sees a running worker: nothing is stopped


def test_a_refused_recovery_leaves_the_failure_to_torchrun() -> None:
    supervisor, _, context, replaced = _round(refuse=True)
    done: set[int] = set()
    supervisor.capture(_torch_finds(context, 2, 5), context, (done,), {})
    assert [call[2] for call in replaced] == [2]  # refused at the first: the rest is torchrun's
    assert set(context._failures) == {2, 5} and done == {2, 5}


@pytest.mark.parametrize("outside", ["no round", "another context"])
def test_outside_the_agents_round_torch_looks_alone(outside: str) -> None:
    supervisor, _, context, replaced = _round()
    if outside == "no round":
        supervisor._round = None
    else:
        supervisor._round = (supervisor._round[0], SimpleNamespace(_failures={}))  # type: ignore[index]
    done: set[int] = set()
    supervisor.capture(_torch_finds(context, 1), context, (done,), {})
    assert replaced == [] and set(context._failures) == {1} and done == {1}


def test_the_wrapper_is_on_torchs_process_context() -> None:
    """Installed on the class torchrun's agent polls: the name must still be there in the torch installed."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    assert callable(getattr(SubprocessContext, "_capture_process_failures", None))
