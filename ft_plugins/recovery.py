"""In-place recovery's protocol on torchrun's store, shared by the launcher and the workers; framework-neutral.

The launcher (:mod:`ft_plugins.launch.recover`) replaces a lost worker and announces a new recovery
generation; the workers (:mod:`ft_plugins.torch.megatron.recover`) meet in it. Every key lives under
``ft_plugins/recover/<run id>/`` on the store torchrun's agent hosts (it outlives every worker):

| key | written by | meaning |
| --- | --- | --- |
| ``generation`` | launcher (``add``) | the newest generation started |
| ``g<G>/lost`` | launcher | the global rank replaced in generation G |
| ``g<G>/abandoned`` | launcher or a worker | why generation G cannot recover (the dump follows) |
| ``g<G>/state/<rank>`` | each survivor | where it stands: steps completed, consumed samples, floating point ops |
| ``g<G>/published`` | each survivor (``add``) | survivors whose standing is there |
| ``g<G>/standings`` | the last survivor to publish | every survivor's standing is there (the replacement reads them) |
| ``g<G>/joined`` | the replacement | it is ready to rebuild the groups with the survivors |
| ``g<G>/arrivals`` | every rank of the rebuilt job (``add``) | ranks there to build the groups again |
| ``g<G>/arrived`` | the last of them | every rank is there: the groups are built |
| ``g<G>/done`` | every rank (``add``) | ranks that finished generation G's repair |
| ``g<G>/member/<rank>`` | each survivor, with ``elastic`` | its node and the ranks of its model replica |
| ``g<G>/proposer`` | each survivor left without a replacement (``add``) | the first of them proposes the members |
| ``g<G>/members`` | that proposer | the survivors that go on without the lost ranks (a scale-in) |
| ``nodes`` | the first rank going on, each leaving one | the nodes left after a scale-in (torchrun's exit barrier waits for these) |
| ``trained/<rank>`` | each worker | its training loop returned: a failure after it (at exit) is not repaired |

A rank waits for a key in one request the store holds until the key is set (never a poll): whoever abandons a
generation (:func:`abandon`) also sets every key a rank may be waiting on that is not set yet, so no waiter sleeps
through it; each checks ``abandoned`` once woken. Survivors exchange their standings in one collective of the
rebuilt groups, not through the store.

``FT_PLUGINS_RECOVERY`` tells a worker that a launcher replaces lost workers (``0,0``), or, in a
replacement, its generation and which life of its rank it is (``<generation>,<life>``).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, NamedTuple

from ft_plugins.config import RECOVERY_VAR, RESTART_VAR, ROUND_VAR

PREFIX = "ft_plugins/recover"
REFUSED = "refused"  # a worker's reason, set at the start, why no lost rank of this run can be replaced


class Replacement(NamedTuple):
    generation: int
    life: int  # 1 for a rank's first replacement


def replacement(env: Mapping[str, str]) -> Replacement | None:
    """This process's place when the launcher started it as a replacement, else None (also when malformed)."""
    generation, _, life = env.get(RECOVERY_VAR, "").partition(",")
    if not (generation.isdigit() and life.isdigit()) or int(generation) == 0:
        return None
    return Replacement(int(generation), int(life))


def defer_collection(env: Mapping[str, str]) -> None:
    """In a replacement, Python's cyclic collector is off from its first instruction to its join
    (:func:`resume_collection`): every rank waits for it all that time, and the collector traversing the
    ever larger heap of torch's and megatron's imports again and again took 0.8 s of their 4.2 s."""
    global _deferred
    if replacement(env) is not None and gc.isenabled():
        gc.disable()
        _deferred = True


def resume_collection(keep_disabled: bool = False) -> None:
    """After a replacement's join: what it made until then is frozen (as a warm spare's imports are; with them
    the ~10,000 unreachable objects the imports leave), then the collector runs again unless the framework
    turned it off meanwhile (``keep_disabled``: Megatron's ``--manual-gc``)."""
    global _deferred
    if not _deferred:
        return
    _deferred = False
    gc.freeze()
    if not keep_disabled:
        gc.enable()


_deferred = False  # defer_collection turned the collector off


def supervised(env: Mapping[str, str]) -> bool:
    """Whether this worker's launcher replaces lost workers (``recover``'s agent in torchrun)."""
    return bool(env.get(RECOVERY_VAR))


def replacement_value(generation: int, life: int) -> str:
    return f"{generation},{life}"


def namespace(run_id: str, attempt: int, round_: int = 0) -> str:
    """The protocol's keys on torchrun's store, per job and per set of workers torchrun started (its restart
    ``attempt`` and rendezvous round ``round_``): after a whole-job restart (``--max-restarts``) or a change of nodes
    (``--nnodes MIN:MAX``) the protocol starts afresh, its generations counted from 0 again."""
    return f"{PREFIX}/{run_id or 'none'}/{attempt}/" + (f"r{round_}/" if round_ else "")


def worker_namespace(env: Mapping[str, str]) -> str:
    """:func:`namespace` as a worker knows it, from torchrun's variables and the launcher's round."""
    return namespace(env.get("TORCHELASTIC_RUN_ID", ""), int(env.get(RESTART_VAR, "0") or 0),
                     int(env.get(ROUND_VAR, "0") or 0))


def connect(env: Mapping[str, str], timeout: float) -> Any:
    """A connection of its own to torchrun's agent store, in this worker's namespace; Fallback where the workers'
    store is not the agent's (it would die with rank 0)."""
    from torch.distributed import PrefixStore, TCPStore

    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise Fallback("the workers' store is not torchrun's agent store (it would die with rank 0)")
    client = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout))
    return PrefixStore(worker_namespace(env), client)


def key(generation: int, name: str) -> str:
    return f"g{generation}/{name}"


STANDINGS = "standings"
MEMBERS = "members"
ARRIVED = "arrived"
NODES = "nodes"
ABORT = "abort"  # the launcher's word that a worker or a node was lost: on NCCL and HCCL the survivors abort then
WAITED = ("lost", "joined", STANDINGS, MEMBERS, ARRIVED, ABORT)  # the keys of a generation that a rank waits on


class Fallback(RuntimeError):
    """Recovery cannot work; the message says why."""


class Late(Fallback):
    """What a rank waited for did not come within the bound (not abandoned, no store failure)."""


def abandon(store: Any, generation: int, reason: str) -> None:
    """Give ``generation`` up: ``abandoned`` (the reason every waiter reads), then every key a rank may be waiting
    on, where not set yet, so that each waiter wakes and reads it."""
    store.set(key(generation, "abandoned"), reason)
    for name in WAITED:
        store.compare_set(key(generation, name), "", "abandoned")


def await_keys(store: Any, generation: int, names: list[str], what: str, timeout: float) -> list[bytes]:
    """The values of the generation's keys ``names`` once every one is set, within ``timeout`` seconds, or Fallback
    with why. One wait the store holds until they are there (an abandonment sets every key waited on), then one
    read: a few requests from each rank, never a poll. ``store``: a connection no other thread uses meanwhile."""
    abandoned, wanted = key(generation, "abandoned"), [key(generation, name) for name in names]
    began = time.monotonic()
    try:
        store.wait(wanted, timedelta(seconds=timeout))
    except Exception as exc:  # the bound ran out, or the store failed
        if store.check([abandoned]):
            raise Fallback(store.get(abandoned).decode()) from None
        if time.monotonic() - began < 0.9 * timeout:  # failed well before the bound: not a timeout
            raise Fallback(f"waiting for {what}, the store failed: {type(exc).__name__}: {exc}") from None
        raise Late(f"{what} did not come within {timeout:.0f} s") from None
    if store.check([abandoned]):
        raise Fallback(store.get(abandoned).decode())
    multi_get = getattr(store, "multi_get", None)  # one request for them all (torch 2.4 on)
    return list(multi_get(wanted)) if multi_get is not None else [store.get(name) for name in wanted]


def arrive(store: Any, generation: int, world: int, timeout: float) -> None:
    """Every rank of the rebuilt job is there before any builds a group with it: one lost meanwhile (a second fault)
    is a Late after ``timeout``, where the groups' rendezvous would wait for it the job's distributed timeout
    (Megatron's 10 minutes). The last to arrive says so: three requests per rank."""
    if store.add(key(generation, "arrivals"), 1) == world:
        store.set(key(generation, ARRIVED), "1")
    await_keys(store, generation, [ARRIVED], "every rank of the rebuilt job", timeout)


def standings(store: Any, generation: int, world: int, timeout: float) -> dict[int, Standing]:
    """Every survivor's standing (all ranks but the one replaced), for the replacement before it trains: one wait for
    the last survivor's word that all are there, and one read."""
    lost = int(await_keys(store, generation, ["lost"], "the launcher's announcement", timeout)[0])
    await_keys(store, generation, [STANDINGS], "the survivors' standings", timeout)
    survivors = [rank for rank in range(world) if rank != lost]
    raw = await_keys(store, generation, [f"state/{rank}" for rank in survivors], "the survivors' standings", timeout)
    return {rank: Standing.decode(value) for rank, value in zip(survivors, raw)}


class Member(NamedTuple):
    """A survivor no replacement came for, as the others must know it to agree on who goes on: its node (torchrun's
    ``GROUP_RANK``) and the global ranks of its model replica (every rank at its data-parallel index)."""

    rank: int
    node: int
    replica: tuple[int, ...]

    def encode(self) -> bytes:
        return json.dumps(self._asdict()).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Member":
        fields = json.loads(raw.decode())
        return cls(fields["rank"], fields["node"], tuple(fields["replica"]))


def members(store: Any, generation: int, world: int, timeout: float) -> dict[int, Member]:
    """The survivors of ``generation`` that go on without a replacement, the same on every rank: the first to ask
    lists those whose ``member/<rank>`` is there (each set its own on catching the fault, long before), the others
    take its list; then one read of their records."""
    if store.add(key(generation, "proposer"), 1) == 1:
        present = [rank for rank in range(world) if store.check([key(generation, f"member/{rank}")])]
        store.compare_set(key(generation, MEMBERS), "", json.dumps(present))
    listed = json.loads(await_keys(store, generation, [MEMBERS], "the survivors' list", timeout)[0])
    raw = await_keys(store, generation, [f"member/{rank}" for rank in listed], "the survivors' records", timeout)
    return {member.rank: member for member in map(Member.decode, raw)}


def going_on(found: Mapping[int, Member], world: int) -> tuple[list[int], list[int], str]:
    """The ranks that go on after a scale-in, in their old order (the i-th becomes rank i): every survivor whose
    model replica lost no rank; the survivors that leave, healthy in a replica that lost a rank (a node holds one
    pipeline stage of several replicas); and why the job cannot go on so ("" when it can)."""
    lost = set(range(world)) - set(found)
    stay = sorted(rank for rank, member in found.items() if not lost & set(member.replica))
    leaving = sorted(set(found) - set(stay))
    return stay, leaving, "" if stay else f"every model replica lost a rank ({_ranks(lost)} lost)"


def _ranks(ranks: Any) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def trained(rank: int) -> str:
    """The key a worker sets when its training loop returned: a replacement for it would have nothing to join."""
    return f"trained/{rank}"


def mark_trained(store: Callable[[], Any], rank: int) -> None:
    """Tell the launcher (on ``store()``, the run's namespace of its store) that this worker's training loop
    returned, so that a crash on its way out is not taken for a loss to repair; without the store, nothing."""
    try:
        store().set(trained(rank), "1")
    except Exception as exc:
        logging.getLogger("ft_plugins.recover").debug("recover: end of training not told: %s: %s",
                                                      type(exc).__name__, exc)


class Standing(NamedTuple):
    """Where a survivor stands when it caught the fault: ``completed`` steps (-1: its state is torn),
    ``position`` the iteration its training loop counts, consumed samples and floating point ops at
    ``completed``; ``saving``: it was inside the save of ``completed`` (a periodic checkpoint)."""

    completed: int
    position: int
    consumed: int
    flops: float
    saving: bool = False

    def encode(self) -> bytes:
        return json.dumps(self._asdict()).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Standing":
        return cls(**json.loads(raw.decode()))


# Where every rank resumes after a repair, around the newest completed step K (Megatron's loop: step K's
# update, then its logging, then its periodic save, then step K + 1)
STEP, LOG, SAVE = "step", "log", "save"


class Plan(NamedTuple):
    """What every rank decides alike from the survivors' standings: the step K to continue from, where
    every rank resumes (``resume``: step K + 1 from its start, step K's logging, or step K's save), and per
    data-parallel group its source (a holder of K) and the ranks it sends to; ``refusal`` says why not."""

    step: int
    sources: dict[int, int]  # group index -> source rank
    receivers: dict[int, tuple[int, ...]]
    refusal: str = ""
    resume: str = STEP


def resumption(standings: Mapping[int, Standing]) -> tuple[int, str]:
    """The newest completed step K among the survivors and the one point where every rank resumes: ``log``
    when each was caught before K's logging ended (after its update of K, in that logging, or before its
    update of K, then receiving K), ``step`` when each stood at step K + 1, ``save`` when each was in the
    save of K; "" when no single point serves them all (one rank's collectives would meet another's)."""
    held = [standing.completed for standing in standings.values()]
    step = max(held) if held else -1

    def place(standing: Standing) -> str:
        if standing.saving:
            return SAVE if standing.completed == step else ""
        return {step - 1: LOG, step: STEP}.get(standing.position, "")

    places = {place(standing) for standing in standings.values()}
    return step, places.pop() if len(places) == 1 else ""


def plan(standings: Mapping[int, Standing], groups: list[list[int]]) -> Plan:
    """The newest completed step among the survivors, where to resume, and a holder of it in every group
    (lowest rank)."""
    step, resume = resumption(standings)
    if step < 0:
        return Plan(step, {}, {}, "no survivor holds a completed step")
    if not resume:
        where = ", ".join(f"rank {rank}: {standing.completed} completed{', saving' if standing.saving else ''} "
                          f"at iteration {standing.position}" for rank, standing in sorted(standings.items()))
        return Plan(step, {}, {}, f"the survivors stand where no single point of the loop serves them all ({where})")
    sources: dict[int, int] = {}
    receivers: dict[int, tuple[int, ...]] = {}
    for index, ranks in enumerate(groups):
        holders = [rank for rank in ranks if rank in standings and standings[rank].completed == step]
        if not holders:
            return Plan(step, {}, {}, f"no surviving holder of step {step} for ranks {ranks}")
        sources[index] = min(holders)
        receivers[index] = tuple(rank for rank in ranks if rank not in holders)
    return Plan(step, sources, receivers, resume=resume)
