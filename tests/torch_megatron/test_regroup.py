"""What a survivor collects when it leaves its dead groups: the young generations, and every generation only
when a connection of those groups is still held open by an older object."""

from __future__ import annotations

import gc
import socket
from typing import Any

import pytest

from ft_plugins.torch.megatron import regroup


COLLECT = gc.collect  # the collector itself, not the recording stand-in the tests put in its place


class Cycle:
    """A connection kept only by a reference cycle, as a group held by the failed step's frames is."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.me = self


def _link(connection: socket.socket) -> str:
    import os

    return os.readlink(f"/proc/self/fd/{connection.fileno()}")


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    asked: list[Any] = []

    def recording(*generation: int) -> int:
        asked.append(generation[0] if generation else 2)
        return COLLECT(*generation)

    monkeypatch.setattr(regroup.gc, "collect", recording)
    return asked


def _dropped_cycle(old: bool) -> str:
    """A connection left in an unreachable cycle, made before a collection of the young generations (so in the
    oldest generation) when ``old``, after it when not."""
    connection, peer = socket.socketpair()
    peer.close()
    link = _link(connection)
    if old:
        cycle = Cycle(connection)
        COLLECT(1)  # what survives a collection of generation 1 moves to the oldest
    else:
        COLLECT(1)
        cycle = Cycle(connection)
    del connection, cycle
    return link


@pytest.mark.parametrize("old", [False, True], ids=["young", "old"])
def test_the_dead_groups_connections_are_closed(old: bool, collections: list[Any]) -> None:
    gc.disable()  # no collection of the interpreter's own between the cycle's making and the release
    try:
        link = _dropped_cycle(old)
        assert link in regroup._sockets()
        regroup._release({link})
    finally:
        gc.enable()
    assert link not in regroup._sockets()
    assert collections == ([1, 2] if old else [1])  # the full collection only when the young one did not do


def test_other_connections_do_not_ask_for_a_full_collection(collections: list[Any]) -> None:
    kept, peer = socket.socketpair()
    with kept, peer:
        regroup._release({"socket:[1]"})  # a connection of the dead groups, closed already
        assert collections == [1]
