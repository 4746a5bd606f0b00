"""The launcher side of ``recover``, inside the torchrun process: only the failed worker is restarted.

torch 2.13's ``LocalElasticAgent`` answers any worker failure by stopping every local worker and starting them all
again. With ``recover`` on, :class:`Supervisor` looks at the workers first on each monitoring round, and again
inside torch's own look (a worker dying between the two): a worker that exited with an error is replaced by a new
process with the same ``RANK`` / ``LOCAL_RANK`` (and ``FT_PLUGINS_RECOVERY`` naming its generation), the generation
is announced on the agent's store (:mod:`ft_plugins.recovery`), and the other workers are never signalled.
torchrun's own handling runs instead, which ends in ``ttp``'s dump and a whole-job restart, when recovery cannot
work: the store is not the agent's, another worker already finished, a second worker fails before the current
repair is done, or a generation was abandoned. Each of these is said in one line. With warm spares
(:mod:`.spares`) the new process is one the spare template forked ahead, torch and megatron imported.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.config import RECOVERY_VAR, ROUND_VAR
from ft_plugins.launch.environment import launcher_options, torchrun_option
from ft_plugins.launch.leftovers import PROCESSES, end_group
from ft_plugins.launch.node_loss import NodeLoss, rendezvous_state
from ft_plugins.launch.spares import Spares
from ft_plugins.recovery import ABORT, NODES, REFUSED, abandon, key, namespace, replacement_value, trained
from ft_plugins.vendors.versions import TORCH_RECOVER

log = logging.getLogger("ft_plugins.recover")

AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler"  # how a replacement is started and held
RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
STORE_TIMEOUT = timedelta(seconds=30)


class Supervisor:
    """Replaces failed local workers in place, one generation at a time."""

    def __init__(self, spares: int = 0) -> None:
        self.spares = Spares(spares)
        self.nodes = NodeLoss()  # a node lost with its launcher, said to the workers by this one
        self.rendezvous = 0  # torchrun's rendezvous round of the workers running (FT_PLUGINS_ROUND)
        self._begin_attempt(0)

    def _begin_attempt(self, attempt: int) -> None:
        """The protocol's state for one torchrun restart attempt: a whole-job restart (``--max-restarts``, what
        follows a failure this cannot repair) starts the workers, and in-place recovery, afresh."""
        self.attempt = attempt  # torchrun's restart count: the workers' TORCHELASTIC_RESTART_COUNT
        self.store: Any = None
        self.generation = 0
        self.lives: dict[int, int] = {}  # local rank -> replacements so far
        self.settled = 0  # the newest generation every rank finished repairing
        self.refusal = ""  # once set, torchrun's own handling runs for every failure of this attempt
        self._round: tuple[Any, Any] | None = None  # the agent's round under way: its worker group and context

    def _follow_restarts(self, agent: Any, spec: Any) -> None:
        """Notice a whole-job restart by torchrun (its restart count moved): start the protocol afresh."""
        attempt = spec.max_restarts - agent._remaining_restarts
        if attempt != self.attempt:
            self._begin_attempt(attempt)
            events.emit("restart", attempt=attempt)
            log.warning("recover: torchrun restarted the whole job (attempt %d of %d): lost ranks are replaced in "
                        "place again", attempt + 1, spec.max_restarts + 1)

    def install(self) -> None:
        """Wrap the agent's monitoring round and the process context's own look at its workers (imported here:
        this runs in the torchrun process only)."""
        import wrapt

        agent = importlib.import_module(AGENT).LocalElasticAgent
        agent._monitor_workers = wrapt.FunctionWrapper(agent._monitor_workers, self.monitor)
        agent._exit_barrier = wrapt.FunctionWrapper(agent._exit_barrier, self.exit_barrier)
        agent._start_workers = wrapt.FunctionWrapper(agent._start_workers, self.start_workers)
        handler = importlib.import_module(RENDEZVOUS).DynamicRendezvousHandler
        handler.next_rendezvous = wrapt.FunctionWrapper(handler.next_rendezvous, publish_bootstrap)
        context = importlib.import_module(PROCESSES).SubprocessContext
        if hasattr(context, "_capture_process_failures"):
            context._capture_process_failures = wrapt.FunctionWrapper(context._capture_process_failures,
                                                                       self.capture)

    def monitor(self, wrapped: Callable[..., Any], agent: Any, args: tuple, kwargs: dict) -> Any:
        worker_group = kwargs.get("worker_group", args[0] if args else None)
        context = getattr(agent, "_pcontext", None)
        handlers = getattr(context, "subprocess_handlers", None)
        if worker_group is not None:
            self._follow_restarts(agent, worker_group.spec)
        if worker_group is not None and handlers and not self.refusal:
            if self._settled(worker_group):
                self.spares.refill(context)
            for local_rank in sorted(context._running_local_ranks):
                code = handlers[local_rank].proc.poll()
                if code not in (None, 0):
                    self._failed(worker_group, context, local_rank, code)
            for local_rank, pid in context.pids().items():  # the agent checks its workers' pids first
                worker_group.workers[local_rank].id = pid
            self._check_nodes(worker_group)
        self.spares.reap()
        self._round = (worker_group, context)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self._round = None
        if result.state.name != "HEALTHY" or self.refusal:
            self.spares.stop()  # the job ends or restarts as a whole: nothing left to take over
        return result

    def capture(self, wrapped: Callable[..., Any], context: Any, args: tuple, kwargs: dict) -> Any:
        """torch's own look at the workers, inside the agent's round: a worker that died after this round's look
        above is replaced here, before the process context would stop every worker for it (under load the two
        looks are tens of milliseconds apart)."""
        result = wrapped(*args, **kwargs)
        worker_group, current = self._round or (None, None)
        done = kwargs.get("done_local_ranks", args[0] if args else None)
        if current is not context or worker_group is None or done is None:
            return result
        for local_rank in sorted(context._failures):
            if self.refusal:
                break  # torchrun's own handling for what is left
            self._failed(worker_group, context, local_rank, context._failures[local_rank].exitcode)
            if not self.refusal:
                del context._failures[local_rank]
                done.discard(local_rank)
        return result

    def start_workers(self, wrapped: Callable[..., Any], agent: Any, args: tuple, kwargs: dict) -> Any:
        """Each set of workers torchrun starts (the first, a whole-job restart, a change of nodes under ``--nnodes
        MIN:MAX``, which keeps torchrun's restart count) gets the protocol afresh, in the namespace of the rendezvous
        round every node's agent shares."""
        worker_group = kwargs.get("worker_group", args[0] if args else None)
        state = rendezvous_state(worker_group.spec.rdzv_handler)
        rendezvous = int(getattr(state, "round", 0))  # c10d's; a static rendezvous has one
        if rendezvous != self.rendezvous:
            self.rendezvous = rendezvous
            self._begin_attempt(self.attempt)
        os.environ[ROUND_VAR] = str(rendezvous)
        self.nodes.begin(worker_group.spec.rdzv_handler)
        return wrapped(*args, **kwargs)

    def exit_barrier(self, wrapped: Callable[..., Any], agent: Any, args: tuple, kwargs: dict) -> Any:
        """torchrun's barrier at the end, where every node's agent waits for all the others (5 minutes at most):
        after a scale-in (``elastic``) it waits for the nodes still in the job, not for those lost in it."""
        group = agent._worker_group
        try:
            store = self._connect(group)
            nodes = json.loads(store.get(NODES)) if store.check([NODES]) else None
            self.nodes.finished(getattr(getattr(group, "spec", None), "rdzv_handler", None), store)
        except Exception:  # no store, or its host gone: torch's own barrier says what it finds
            nodes = None
        if nodes is None or len(nodes) >= group.group_world_size:
            return wrapped(*args, **kwargs)
        log.info("elastic: torchrun's exit barrier waits for the %d node%s left after the scale-in", len(nodes),
                 "s" if len(nodes) > 1 else "")
        counted, group.group_world_size = group.group_world_size, len(nodes)
        try:
            return wrapped(*args, **kwargs)
        finally:
            group.group_world_size = counted

    def _failed(self, worker_group: Any, context: Any, local_rank: int, code: int) -> None:
        rank = worker_group.workers[local_rank].global_rank
        events.emit("fault", rank=rank, kind=events.exit_kind(code), code=code, noticed="launcher")
        end_group(context.subprocess_handlers[local_rank])  # what the lost worker left, replaced or not
        why = self._why_not(worker_group, context, rank)
        if why:
            self.refusal = why
            log.warning("recover: rank %d exited with code %d and is not replaced: %s; torchrun's own handling "
                        "follows (ttp's dump, whole-job restart)", rank, code, why)
            if self.store is not None and self.generation:
                abandon(self.store, self.generation, f"rank {rank} lost too ({why})")
            return
        self.generation = self.store.add("generation", 1)
        life = self.lives[local_rank] = self.lives.get(local_rank, 0) + 1
        env = {**context.envs[local_rank], RECOVERY_VAR: replacement_value(self.generation, life),
               ROUND_VAR: str(self.rendezvous)}
        handler = self.spares.take(env, local_rank, context.stdouts[local_rank], context.stderrs[local_rank])
        how = "warm spare pid %d took over" if handler is not None else "replacement pid %d started"
        handler = handler or self._start(context, local_rank, env)
        context.subprocess_handlers[local_rank] = handler
        self.store.set(key(self.generation, "lost"), str(rank))
        self.store.set(key(self.generation, ABORT), f"rank {rank} lost")
        events.emit("replacement", rank=rank, generation=self.generation, pid=handler.proc.pid, spare=how[0] == "w")
        log.warning("recover: rank %d exited with code %d; " + how + " as generation %d, the other workers keep "
                    "running", rank, code, handler.proc.pid, self.generation)

    def _settled(self, worker_group: Any) -> bool:
        """No recovery under way: a spare template started during one (the first, or one after its predecessor
        died) would take the CPU from the replacement's set-up (on a 2-core machine it delayed the repair by
        seconds); its forks after a take-over cost nothing comparable."""
        if self.settled == self.generation:
            return True
        try:
            done, world = self._repaired(worker_group)
            if done < world:
                return False
        except Exception:  # the store host is gone: the next failure says so; a spare costs nothing then
            pass
        self.settled = self.generation  # asked no more until the next generation
        return True

    def _why_not(self, worker_group: Any, context: Any, rank: int) -> str:
        """Why the failure of ``rank`` cannot be recovered in place ("" when it can)."""
        finished = sorted(worker_group.workers[local_rank].global_rank
                          for local_rank, handler in context.subprocess_handlers.items() if handler.proc.poll() == 0)
        if finished:  # a replacement would wait for peers that are gone: the job's end is torchrun's to judge
            return (f"rank{'s' if len(finished) > 1 else ''} {', '.join(map(str, finished))} finished already "
                    "(exit code 0), no peer is left to repair it from")
        if not getattr(worker_group.spec.rdzv_handler, "use_agent_store", False):
            return ("the workers' store is not the agent's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so it dies "
                    "with rank 0; launch without it")
        try:
            self._connect(worker_group)
            if self.store.check([trained(rank)]):  # it failed on its way out (a crash at exit)
                return f"rank {rank} had finished training, nothing is left to repair"
            if self.store.check([REFUSED]):  # said at the start by the workers (pipeline parallelism, ...)
                return f"the workers refused in-place recovery at the start ({self.store.get(REFUSED).decode()})"
            upcoming = key(self.generation + 1, "abandoned")
            if self.store.check([upcoming]):  # a worker gave the next generation up (an exception, not a loss)
                return f"generation {self.generation + 1} was given up: {self.store.get(upcoming).decode()}"
            if self.generation:
                done, world = self._repaired(worker_group)
                if done < world:
                    return (f"a second fault during recovery (generation {self.generation}: {done}/{world} ranks "
                            "repaired)")
        except Exception as exc:  # the store host is gone
            return f"torchrun's store is unreachable ({type(exc).__name__}: {exc})"
        return ""

    def _repaired(self, worker_group: Any) -> tuple[int, int]:
        """(ranks that finished repairing the current generation, ranks in the job), from the store."""
        return self.store.add(key(self.generation, "done"), 0), worker_group.workers[0].world_size

    def _connect(self, worker_group: Any) -> Any:
        """The workers' store, in their namespace (one connection, made at its first use)."""
        if self.store is not None:
            return self.store
        from torch.distributed import PrefixStore, TCPStore

        client = TCPStore(worker_group.master_addr, worker_group.master_port, is_master=False,
                          timeout=STORE_TIMEOUT)
        self.store = PrefixStore(namespace(worker_group.spec.rdzv_handler.get_run_id(), self.attempt, self.rendezvous),
                                 client)
        return self.store

    def _check_nodes(self, worker_group: Any) -> None:
        """A node lost with its launcher, said to the workers (:mod:`.node_loss`); never into torch's loop."""
        try:
            self.nodes.check(worker_group.spec.rdzv_handler, lambda: self._connect(worker_group))
        except Exception as exc:  # the store host is gone: the job's end is torchrun's to judge
            log.debug("recover: nodes not checked: %s: %s", type(exc).__name__, exc)

    @staticmethod
    def _start(context: Any, local_rank: int, env: dict[str, str]) -> Any:
        """A new worker process exactly as torchrun started the lost one, plus its place in the recovery; its
        output follows the lost one's in the rank's log files."""
        from ft_plugins.launch.replacement import Replacement

        return Replacement(entrypoint=context.entrypoint, args=context.args[local_rank], env=env,
                           stdout=context.stdouts[local_rank], stderr=context.stderrs[local_rank],
                           local_rank_id=local_rank, numa_options=getattr(context, "_numa_options", None))


def publish_bootstrap(wrapped: Callable[..., Any], handler: Any, args: tuple, kwargs: dict) -> Any:
    """torch 2.13's c10d rendezvous, sharing its store with the workers, has rank 0 publish where that store is
    (``MASTER_ADDR``, ``MASTER_PORT``) in its first round only: a node that joins a later round (a node back under
    ``--nnodes MIN:MAX``) waits for them in vain, and the round fails after 60 s. Rank 0 publishes them in each."""
    info = wrapped(*args, **kwargs)
    bootstrap = getattr(info, "bootstrap_store_info", None)
    if info.rank == 0 and bootstrap is not None:
        info.store.set(type(bootstrap).MASTER_ADDR_KEY, bootstrap.master_addr.encode())
        info.store.set(type(bootstrap).MASTER_PORT_KEY, str(bootstrap.master_port).encode())
    return info


def install(spares: int) -> bool:
    """Called in the torchrun launcher when ``recover`` is on; never raises (torchrun then runs as usual)."""
    try:  # needed at the first failure, inside torch's monitoring loop: an ImportError there ends the agent
        importlib.import_module(HANDLER)
    except ImportError:
        torch = getattr(sys.modules.get("torch"), "__version__", "this torch")
        log.warning("recover: off in this torchrun: torch %s has no %s (torch %s and later have it), which starts and "
                    "holds a replacement worker; upgrade torch to %s or later, or run without recover (ttp's dump and "
                    "torchrun's restart still work)", torch, HANDLER, TORCH_RECOVER, TORCH_RECOVER)
        return False
    try:
        Supervisor(spares).install()
        os.environ[RECOVERY_VAR] = replacement_value(0, 0)  # every worker started knows a launcher replaces it
    except Exception as exc:
        log.warning("recover: torchrun's agent not adapted (%s: %s); a lost rank restarts the whole job",
                    type(exc).__name__, exc)
        return False
    restarts = torchrun_option(launcher_options(getattr(sys, "orig_argv", sys.argv)[1:]), os.environ,
                               "--max-restarts", "0")
    log.info("recover: torchrun's agent restarts only a failed worker%s; %s", f", {spares} warm spare"
             f"{'s' if spares > 1 else ''} kept started" if spares else "",
             f"a failure it cannot repair in place restarts the whole job (--max-restarts {restarts})"
             if restarts.isdigit() and int(restarts) else "a failure it cannot repair in place ends the job after "
             "ttp's dump (--max-restarts 0)")
    return True
