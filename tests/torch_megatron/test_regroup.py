"""What a survivor collects when it leaves its dead groups: the young generations, and every generation only
when a connection of those groups is still held open by an older object."""

from __future__ import annotations

import gc
import os
import socket
import sys
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


def test_the_groups_count_as_being_rebuilt_from_their_destruction_until_a_build_succeeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump in another thread asks this (it names its shard from Megatron's parallel state); a build that failed
    leaves the groups unbuilt."""
    rebuilt = regroup.Regroup()
    seen: list[tuple[str, bool]] = []
    outcome = iter((None, RuntimeError("a peer never came")))

    def build(*_: Any) -> None:
        seen.append(("build", regroup.Regroup.rebuilding()))
        if error := next(outcome):
            raise error

    monkeypatch.setattr(regroup.Regroup, "_unbuilt", False)  # restored after the test
    monkeypatch.setattr(regroup, "named_groups", dict)
    monkeypatch.setattr(rebuilt, "_destroy", lambda: seen.append(("destroy", regroup.Regroup.rebuilding())))
    monkeypatch.setattr(rebuilt, "_build", build)
    assert not regroup.Regroup.rebuilding()
    assert rebuilt.join(0, 1, None, ()) == []
    assert seen == [("destroy", True), ("build", True)] and not regroup.Regroup.rebuilding()
    with pytest.raises(RuntimeError, match="a peer never came"):
        rebuilt.join(0, 1, None, ())
    assert regroup.Regroup.rebuilding()


MEMBER = r"""
import sys, threading, time
import torch, torch.distributed as dist
from ft_plugins.torch.megatron import regroup

rank, port = int(sys.argv[1]), int(sys.argv[2])
tended = regroup.Regroup()  # records the groups' connections as recover records Megatron's
tended._recording(lambda: dist.init_process_group("gloo", rank=rank, world_size=2,
                                                  init_method=f"tcp://127.0.0.1:{port}"), (), {}, default=True)
group = tended._recording(lambda: dist.new_group([0, 1], backend="gloo"), (), {})
dist.barrier(group=group)  # both ends connected before one shuts its connections down
if rank == 0:
    tended.interrupt()  # its main thread saw a peer lost first: its connections are shut down
events, asking = [], threading.Event()

def dump() -> None:
    with regroup.real_twins([group], "test/dump", bound=20) as (twin,):
        events.append("in use")
        asking.set()
        time.sleep(0.5)  # the main thread asks for a shutdown meanwhile
        found = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(found, torch.tensor([rank + 1.0]), group=twin)
        events.append(f"gathered {sorted(int(value) for value in found)}")
    events.append("released")

writer = threading.Thread(target=dump)
writer.start()
asking.wait()
tended.interrupt()
events.append("shut down")
writer.join()
print(events, flush=True)
"""


@pytest.fixture(scope="module")
def members() -> list[str]:
    """Two gloo ranks whose recorded group is tended as ``recover`` tends it; rank 0's connections shut down before
    its dump, rank 1's not; in each, the main thread asks for a shutdown while the dump's groups are in use."""
    import subprocess

    from support import finish, free_port

    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", MEMBER, str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "FT_PLUGINS": "none"})
             for rank in range(2)]
    try:
        outputs = [finish(rank, 120)[0] for rank in ranks]
    finally:  # the other rank, where one did not end
        for rank in ranks:
            rank.kill()
    assert all(rank.returncode == 0 for rank in ranks), outputs
    return [output.strip().splitlines()[-1] for output in outputs]


def test_a_dump_gathers_in_groups_of_its_own_whichever_member_was_shut_down_first(members: list[str]) -> None:
    """Rank 0's old group is shut down, rank 1's is not: both meet in new groups, so the gather is whole on
    both (in the old group rank 1's gather met a closed connection, and rank 0 waited for it in vain). They meet
    on the default group's store, whose connections the shutdown leaves alone (rank 0 hosts it)."""
    assert all("'gathered [1, 2]'" in events for events in members), members


def test_a_shutdown_waits_until_the_dumps_groups_are_released(members: list[str]) -> None:
    assert all(events == "['in use', 'gathered [1, 2]', 'released', 'shut down']" for events in members), members


def test_the_default_stores_connections_are_told_by_its_address_not_its_port_number_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The connections kept open at a shutdown are the store's own: to its address, and those its server accepted
    here; a connection to another address that shares the port number (another host's, a gloo peer's) is a group's,
    and is shut down with them."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    before = regroup._sockets()
    client = TCPStore("127.0.0.2", server.port, is_master=False)  # the server listens on every address
    theirs = regroup._sockets() - before
    with socket.create_connection(("127.0.0.1", server.port)) as other:  # another address, the same port number
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: client)
        found = regroup._store_connections()
        assert theirs and theirs <= found, (theirs, found)
        assert _link(other) not in found
    del client, server
