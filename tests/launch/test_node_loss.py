"""The launcher's word that a node was lost with its launcher (``ft_plugins.launch.node_loss``): the rendezvous state
as torchrun's c10d agent holds it after a keep-alive (a node without keep-alives dropped from its participants), the
workers' store a real ``HashStore``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ft_plugins.launch import node_loss
from ft_plugins.launch.node_loss import FINISHED, NodeLoss
from ft_plugins.recovery import ABORT, NODES, key

NODES_OF_THE_ROUND = {"10.0.0.1_100_0": 0, "10.0.0.2_200_0": 1, "10.0.0.3_300_0": 2}


class _Handler:
    """torchrun's DynamicRendezvousHandler as far as it is read: its state holder's state, its own node."""

    def __init__(self) -> None:
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=4, participants=dict(NODES_OF_THE_ROUND),
                                                                   closed=False))
        self._this_node = "10.0.0.1_100_0"

    @property
    def state(self) -> SimpleNamespace:
        return self._state_holder.state


@pytest.fixture()
def store():
    import torch.distributed as dist

    return dist.HashStore()


@pytest.fixture()
def watch(monkeypatch: pytest.MonkeyPatch) -> tuple[NodeLoss, _Handler]:
    monkeypatch.setattr(node_loss, "CHECK_EVERY", 0.0)
    handler = _Handler()
    nodes = NodeLoss()
    nodes.begin(handler)
    return nodes, handler


def test_a_node_gone_from_the_rendezvous_is_announced_once_for_the_workers_next_generation(watch, store) -> None:
    nodes, handler = watch
    assert nodes.check(handler, lambda: store) == []  # every node still there: no request made
    store.add("generation", 2)  # two repairs so far
    del handler.state.participants["10.0.0.3_300_0"]
    assert nodes.check(handler, lambda: store) == ["10.0.0.3_300_0"]
    assert store.get(key(3, ABORT)) == b"node 10.0.0.3_300_0 lost"
    assert store.add("generation", 0) == 2, "the launcher that replaces numbers the generations"
    assert nodes.check(handler, lambda: store) == [], "said once"


def test_a_node_that_finished_or_that_the_workers_scaled_in_without_is_no_loss(watch, store) -> None:
    nodes, handler = watch
    NodeLoss.finished(SimpleNamespace(_this_node="10.0.0.2_200_0"), store)
    store.set(NODES, json.dumps([0, 1]))  # gloo's survivors scaled in without node 2 already
    del handler.state.participants["10.0.0.2_200_0"], handler.state.participants["10.0.0.3_300_0"]
    assert nodes.check(handler, lambda: store) == []
    assert not store.check([key(1, ABORT)])
    assert store.check([FINISHED + "10.0.0.2_200_0"])


def test_a_node_lost_after_a_scale_in_is_announced_if_it_went_on(watch, store) -> None:
    nodes, handler = watch
    store.set(NODES, json.dumps([0, 1]))
    del handler.state.participants["10.0.0.2_200_0"]
    assert nodes.check(handler, lambda: store) == ["10.0.0.2_200_0"]
    assert store.check([key(1, ABORT)])


@pytest.mark.parametrize("change", ["closed", "next round"])
def test_a_closed_rendezvous_or_another_round_says_nothing(watch, store, change: str) -> None:
    nodes, handler = watch
    if change == "closed":  # the job ended: the agents shut the rendezvous down
        handler.state.closed = True
    else:  # a node joined or left between rounds: torchrun starts the workers again (begin() follows)
        handler.state.round += 1
    handler.state.participants.clear()
    assert nodes.check(handler, lambda: store) == []
    assert not store.check([key(1, ABORT)])


def test_another_rendezvous_than_c10d_s_is_not_watched(store) -> None:
    nodes = NodeLoss()
    static = SimpleNamespace()  # no state holder
    nodes.begin(static)
    assert nodes.check(static, lambda: store) == []
