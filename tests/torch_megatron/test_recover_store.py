"""``recover``'s waits on torchrun's store, on a real TCPStore: a bounded number of requests from each rank whatever
the world's size (no poll, no read per peer), and no waiter sleeping through an abandoned generation. The repair's
exchange between ranks runs in every real recovery of tests/torch_megatron (test_recover.py and the others)."""

from __future__ import annotations

import threading
from typing import Any
from unittest.mock import Mock

import pytest
from torch.distributed import PrefixStore, TCPStore

from support import agent_store_client

from ft_plugins.recovery import STANDINGS, Late, Standing, abandon, arrive, key
from ft_plugins.torch.megatron.recover import Fallback, MegatronRecovery

WORLD = 1024


@pytest.fixture
def store(store_server: TCPStore) -> PrefixStore:
    return agent_store_client(store_server.port)


def _rank(store: Any, timeout: float = 60.0) -> MegatronRecovery:
    """The recovery glue of one rank, as far as its store waits go (its waits through ``store``)."""
    recovery = MegatronRecovery.__new__(MegatronRecovery)
    recovery.store, recovery.waits, recovery.timeout = None, store, timeout
    return recovery


def test_the_replacement_reads_every_survivor_s_standing_in_a_few_requests_whatever_the_world(store: Any) -> None:
    lost = 5
    for rank in range(WORLD):
        if rank != lost:
            store.set(key(1, f"state/{rank}"), Standing(7, 8, rank, 1.0).encode())
    store.set(key(1, "lost"), str(lost))
    store.set(key(1, STANDINGS), "ready")
    counting = Mock(wraps=store)  # every request recorded, each passed on
    standings = _rank(counting)._standings(1, WORLD)
    assert sorted(standings) == [rank for rank in range(WORLD) if rank != lost]
    assert standings[WORLD - 1] == Standing(7, 8, WORLD - 1, 1.0)
    requests = [call[0] for call in counting.mock_calls]
    assert len(requests) <= 9, requests  # three waits, each: wait, a look for abandonment, one read


def test_a_waiter_wakes_when_its_generation_is_abandoned_and_reads_why(store_server: TCPStore, store: Any) -> None:
    """A survivor waits for the replacement; the launcher (another process: another connection) gives it up."""
    outcome: list[str] = []

    def survivor() -> None:
        try:
            _rank(agent_store_client(store_server.port))._await(2, ["joined"], "the replacement")
        except Fallback as exc:
            outcome.append(str(exc))

    waiting = threading.Thread(target=survivor)
    waiting.start()
    abandon(store, 2, "rank 3 lost too (the replacement exited)")
    waiting.join(120)
    assert outcome == ["rank 3 lost too (the replacement exited)"]  # not the 60 s bound's "did not come"
    assert store.get(key(2, "lost")) == b"abandoned"  # every key waited on, where not set


def test_an_abandonment_leaves_a_key_already_set_as_it_was(store: Any) -> None:
    store.set(key(3, "lost"), "1")
    abandon(store, 3, "an exception in rank 0")
    assert store.get(key(3, "lost")) == b"1"
    with pytest.raises(Fallback, match="an exception in rank 0"):
        _rank(store)._await(3, ["lost"], "the launcher's announcement")


def test_a_key_that_never_comes_ends_the_wait_at_the_bound_saying_what_was_awaited(store: Any) -> None:
    with pytest.raises(Fallback, match="the replacement did not come within 1 s"):
        _rank(store, timeout=1.0)._await(4, ["joined"], "the replacement")


def test_every_rank_of_a_rebuilt_job_arrives_in_a_few_requests_and_one_missing_is_late(store: Any) -> None:
    """Before the groups are built again: the last to arrive says all are there; a rank lost meanwhile (a second
    fault) leaves the others waiting the bound, not the groups' rendezvous's 10 minutes."""
    for rank in range(WORLD - 1):
        store.add(key(4, "arrivals"), 1)
    counting = Mock(wraps=store)
    arrive(counting, 4, WORLD, 60.0)  # the last one
    requests = [call[0] for call in counting.mock_calls]
    assert len(requests) <= 5, requests  # its count, its word, then a wait, a look for abandonment, one read
    with pytest.raises(Late, match="every rank of the rebuilt job did not come within 1 s"):
        arrive(store, 5, WORLD, 1.0)  # the first of a generation whose other ranks never come


def test_a_scale_in_brings_the_launchers_count_to_its_generation_once(store_server: TCPStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers announce a node lost on a backend that blocks at their count + 1 (``launch/node_loss.py``), and
    the survivors of a scale-in at generation g wait at g + 1 for the next loss: the first rank going on counts g on
    the store, once for all. Without it a second loss after a scale-in is announced at g again, where no one waits."""
    from types import SimpleNamespace

    from ft_plugins.recovery import NODES, Member
    from ft_plugins.torch.megatron import elastic

    megatron_args = SimpleNamespace(global_batch_size=6, micro_batch_size=1, data_parallel_size=4,
                                    use_distributed_optimizer=False)
    monkeypatch.setattr(elastic, "megatron", lambda name: SimpleNamespace(get_args=lambda: megatron_args))
    world, generation, places = 4, 1, {}  # rank 3's node lost for good

    def survivor(rank: int) -> None:
        worker = elastic.MegatronElastic.__new__(elastic.MegatronElastic)
        worker.store = worker.waits = agent_store_client(store_server.port)
        worker.timeout, worker.member = 30.0, Member(rank, rank, (rank,))
        worker.elastic, worker.resize = SimpleNamespace(settings={"wait": 1.0}, changes=[]), elastic.Resize()
        places[rank] = worker._scale_in(generation, rank, world)

    client = agent_store_client(store_server.port)
    for rank in range(world - 1):  # each says who it is as it catches the loss, before its wait
        client.set(key(generation, f"member/{rank}"), Member(rank, rank, (rank,)).encode())
    threads = [threading.Thread(target=survivor, args=(rank,)) for rank in range(world - 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert places == {0: (0, 3), 1: (1, 3), 2: (2, 3)}
    assert client.add("generation", 0) == generation, "the next loss is announced at the generation they wait at"
    assert client.get(NODES) == b"[0, 1, 2]", "torchrun's exit barrier waits for the nodes left"
