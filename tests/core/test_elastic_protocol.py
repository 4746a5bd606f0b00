"""``elastic``'s agreement on who goes on after a loss no replacement came for, on a real TCPStore, and what it
decides from Megatron's arguments; the real scale-ins run in tests/torch_megatron/test_elastic.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import TCPStore

from support import agent_store_client

from ft_plugins.launch.node_loss import FINISHED
from ft_plugins.recovery import NODES, Fallback, Member, abandon, going_on, key, members
from ft_plugins.torch.megatron.elastic import smaller_sizes, unscalable

WORLD = 8


def _replicas(tensor_parallel: int) -> dict[int, Member]:
    """Every rank of WORLD with TP = ``tensor_parallel`` (Megatron's order: a replica's ranks contiguous), two per
    node."""
    return {rank: Member(rank, rank // 2, tuple(range(rank - rank % tensor_parallel,
                                                      rank - rank % tensor_parallel + tensor_parallel)))
            for rank in range(WORLD)}


def test_every_survivor_agrees_on_the_same_members_whoever_asks_first(store_server: TCPStore) -> None:
    everyone = _replicas(2)
    survivors = [rank for rank in range(WORLD) if rank not in (4, 5)]  # node 2 lost
    for rank in survivors:
        agent_store_client(store_server.port).set(key(1, f"member/{rank}"), everyone[rank].encode())
    answers: dict[int, Any] = {}

    def ask(rank: int) -> None:
        answers[rank] = members(agent_store_client(store_server.port), 1, WORLD, 30)

    threads = [threading.Thread(target=ask, args=(rank,)) for rank in survivors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == len(survivors)
    assert all(found == {rank: everyone[rank] for rank in survivors} for found in answers.values())
    assert going_on(answers[0], WORLD) == ([0, 1, 2, 3, 6, 7], [], "")


def test_a_survivor_that_publishes_after_the_list_was_made_is_not_in_it(store_server: TCPStore) -> None:
    everyone, store = _replicas(1), agent_store_client(store_server.port)
    for rank in (0, 1, 2):
        store.set(key(1, f"member/{rank}"), everyone[rank].encode())
    assert sorted(members(store, 1, 4, 30)) == [0, 1, 2]
    store.set(key(1, "member/3"), everyone[3].encode())  # too late: the list stands
    assert sorted(members(agent_store_client(store_server.port), 1, 4, 30)) == [0, 1, 2]


def test_a_waiter_for_the_list_wakes_when_the_generation_is_abandoned(store_server: TCPStore) -> None:
    store = agent_store_client(store_server.port)
    store.add(key(1, "proposer"), 1)  # another rank proposes, and is lost before it lists anyone
    abandoning = threading.Timer(0.5, abandon, (agent_store_client(store_server.port), 1, "rank 3 lost too"))
    abandoning.start()
    with pytest.raises(Fallback, match="rank 3 lost too"):
        members(store, 1, 4, 30)
    abandoning.join(30)  # it marks every key: done before the store's server goes with the test


def test_whole_replicas_are_dropped_and_the_rest_keep_their_order() -> None:
    everyone = _replicas(2)
    assert going_on({rank: m for rank, m in everyone.items() if rank not in (2, 3)}, WORLD) == (
        [0, 1, 4, 5, 6, 7], [], "")
    assert going_on({rank: m for rank, m in everyone.items() if rank not in (2, 3, 6, 7)}, WORLD) == (
        [0, 1, 4, 5], [], "")


def test_healthy_ranks_of_a_replica_that_lost_one_leave_with_it() -> None:
    everyone = _replicas(2)
    assert going_on({rank: m for rank, m in everyone.items() if rank != 3}, WORLD) == ([0, 1, 4, 5, 6, 7], [2], "")


def test_a_loss_in_every_replica_leaves_nothing_to_go_on_with() -> None:
    everyone = _replicas(4)  # two replicas: ranks 0-3 and 4-7
    assert going_on({rank: m for rank, m in everyone.items() if rank not in (1, 6)}, WORLD) == (
        [], [0, 2, 3, 4, 5, 7], "every model replica lost a rank (ranks 1, 6 lost)")


def test_a_member_record_reads_back_as_written() -> None:
    member = Member(5, 2, (4, 5))
    assert Member.decode(member.encode()) == member
    assert NODES == "nodes"  # the launcher's exit barrier reads it: a rename would break the two apart


def _args(**given: Any) -> SimpleNamespace:
    defaults = dict(use_distributed_optimizer=False, context_parallel_size=1, num_experts=None,
                    virtual_pipeline_model_parallel_size=None, rampup_batch_size=None, data_parallel_size=4,
                    micro_batch_size=1, global_batch_size=12)
    return SimpleNamespace(**{**defaults, **given})


@pytest.mark.parametrize("given, why", [
    ({}, ""),
    ({"use_distributed_optimizer": True}, ""),  # its shards are laid out again
    ({"use_distributed_optimizer": True, "overlap_param_gather": True}, "--overlap-param-gather"),
    ({"use_distributed_optimizer": True, "use_precision_aware_optimizer": True}, "precision-aware optimizer"),
    ({"context_parallel_size": 2}, "context parallelism"),
    ({"num_experts": 8}, "mixture of experts"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual pipeline stages"),
    ({"rampup_batch_size": [4, 4, 100]}, "ramp-up"),
    ({"data_parallel_size": 1}, "one data-parallel replica"),
])
def test_what_cannot_scale_in_is_named_in_one_line(given: dict, why: str) -> None:
    found = unscalable(_args(**given))
    assert (why in found and "\n" not in found) if why else found == ""


def test_the_sizes_that_keep_the_global_batch_whole() -> None:
    assert smaller_sizes(_args()) == [3, 2, 1]  # 12 = 4 x 3 x 1 = 6 x 2 x 1 = 12 x 1 x 1
    assert smaller_sizes(_args(data_parallel_size=8, micro_batch_size=2, global_batch_size=16)) == [4, 2, 1]


class _Agent:
    """What torchrun's agent holds that its exit barrier reads: the worker group, its count of nodes."""

    def __init__(self, nodes: int) -> None:
        handler = SimpleNamespace(_this_node="10.0.0.9_900_0")  # torchrun's c10d rendezvous handler, as far as read
        self._worker_group = SimpleNamespace(group_world_size=nodes, spec=SimpleNamespace(rdzv_handler=handler))


def test_torchruns_exit_barrier_waits_only_for_the_nodes_left_after_a_scale_in(store_server: TCPStore) -> None:
    from ft_plugins.launch.recover import Supervisor

    supervisor, agent, seen = Supervisor(), _Agent(3), []
    supervisor.store = agent_store_client(store_server.port)

    def barrier() -> str:
        seen.append(agent._worker_group.group_world_size)
        return "done"

    assert supervisor.exit_barrier(barrier, agent, (), {}) == "done"  # no scale-in: every node
    supervisor.store.set(NODES, "[0, 2]")
    assert supervisor.exit_barrier(barrier, agent, (), {}) == "done"
    assert seen == [3, 2] and agent._worker_group.group_world_size == 3  # torch's count given back after
    assert supervisor.store.check([FINISHED + "10.0.0.9_900_0"]), "its end is no loss to the other launchers"
