"""Megatron glue for ``recover``: the worker side of in-place recovery (launcher side:
:mod:`ft_plugins.launch.recover`).

A survivor catches the failure in ``train_step`` (a collective with the lost rank raises within milliseconds on gloo; on
NCCL and HCCL the launcher's word of the loss aborts it first: :class:`ft_plugins.torch.abort.LossWatch`), lets go of
the exception at once (a kept traceback keeps the dead group's pending collective and sockets open: the survivor beyond
it would wait for the full timeout), holds (:mod:`.regroup`: groups destroyed with a time bound, the layout on the fake
backend), publishes where it stands on the agent's store and waits, bounded, for the replacement the launcher announces.
Then every rank rebuilds the groups exactly as Megatron built them, the newest completed step K is agreed (survivors can
be one step apart), a holder of K sends each rank that lacks it the state a save at K holds (:mod:`.handover`), every
rank stands at exactly K (gradients are zeroed as each step begins, the step's batches read again, RNG as at K) and
training continues at K + 1.

A replacement starts with ``--load`` ignored and its collectives held (the fake backend); once its model and optimizer
are set up it learns K and the counters at K from the survivors' standings, as a load would set them (so Megatron builds
its data iterators at K + 1's first sample), and at its first step joins the repair. No checkpoint is written or read.

Every rank resumes at the one point of Megatron's loop where the survivors stand
(:func:`ft_plugins.recovery.resumption`): step K + 1 from its start; the logging of K (a survivor caught after its
update of K, e.g. a rank lost inside its own update, or in that logging: the replacement starts a step earlier and
counts it as done by its peers); or the periodic save of K, which every rank runs again from its top (:mod:`.loop`). An
exception raised by a rank's own code is not a lost process: see :meth:`MegatronRecovery._raised`.

With Megatron's distributed optimizer a rank's shard of the parameter state is held again only by the rank at the same
place of another optimizer instance (``FT_PLUGINS_TTP_REPLICAS``): that rank sends it with the rest; with one instance
nothing can replace a lost rank, and recover says so at the start.

When recovery cannot work (no replacement within the bound, a second fault during the repair, no surviving holder of a
shard, a group only some object holds) the survivors fall back to ``ttp``'s dump, as without this feature, and say why
in one line; with ``elastic``, survivors no replacement comes for go on with fewer data-parallel replicas instead
(:mod:`.elastic`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ft_plugins import events, faults, progress
from ft_plugins.features.recover import Recover
from ft_plugins.patching import Patch
from ft_plugins.rank import global_rank, on_rank_zero
from ft_plugins.recovery import (LOG, REFUSED, SAVE as SAVING, STANDINGS, STEP, Fallback, Standing, abandon, arrive,
                                 await_keys, connect, key, mark_trained, plan, replacement, resume_collection,
                                 resumption, standings, supervised)
from ft_plugins.steps import FORWARD, IDLE, UPDATED
from ft_plugins.torch.abort import LossWatch
from ft_plugins.torch.megatron import loop
from ft_plugins.torch.megatron.handover import (Batches, Chunks, apply, kept, receive, send, set_rng, state_at,
                                                step_samples, unsupported, what_this_rank_holds, without_load)
from ft_plugins.torch.megatron.regroup import Regroup, megatron_roots, require_successors
from ft_plugins.torch.megatron.state import TRAINING, argument, current_iteration, megatron, train_step_items
from ft_plugins.torch.megatron.ttp import MegatronTtp
from ft_plugins.triggers import EXIT_ON_ERROR

log = logging.getLogger("ft_plugins.recover")

# after a repair: run the step again, count it as done by a peer (then log it), or run the save of K again
REPEAT, BEHIND, SAVE = "repeat", "behind", "save"
OUTCOME = {STEP: REPEAT, LOG: BEHIND, SAVING: SAVE}


class MegatronRecovery:
    """The wrappers (wrapt signature) and the recovery protocol of one worker."""

    def __init__(self, feature: Recover, ttp: MegatronTtp) -> None:
        self.feature = feature
        self.tracker, self.writer, self.gasp = ttp.tracker, ttp.writer, ttp.gasp  # ttp's, shared
        self.timeout = feature.settings["timeout"]
        self.regroup = Regroup()
        place = replacement(os.environ)
        self.generation = place.generation if place else 0
        self.joined = place is None
        self.regroup.fake = place is not None  # a replacement holds its collectives until it joined
        self.store: Any = None
        self.waits: Any = None  # the connection the waits hold (:meth:`_waiting_store`)
        self.objects: tuple[Any, Any, Any] | None = None  # model, optimizer, scheduler
        self.batches: Batches | Chunks | None = None
        self.loop: tuple[Any, Any] = (None, None)  # train()'s checkpointing context and data iterator
        self.refusal = ""
        self.result_size = 0  # the items of train_step's tuple, once a step returned here
        self.watch = LossWatch(self._connect, lambda: self.generation)  # NCCL, HCCL: the launcher's word aborts

    def patches(self) -> tuple[Patch, ...]:
        return (*self.regroup.patches(),
                Patch(TRAINING, "setup_model_and_optimizer", self.setup_model_and_optimizer),
                Patch(TRAINING, "train", self.train),
                Patch(TRAINING, "train_step", self.train_step),
                Patch(TRAINING, "training_log", self.training_log),
                Patch(TRAINING, "save_checkpoint_and_time", self.save_checkpoint_and_time))

    # -- hooks -------------------------------------------------------------------------------------
    def setup_model_and_optimizer(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """A replacement reads no checkpoint: its state comes from a peer; its counters are set where the
        survivors stand, as a load would set them, so that the data iterators Megatron builds next start at the
        survivors' next sample (nothing read to skip)."""
        if self.joined:
            return wrapped(*args, **kwargs)
        with without_load(f"replacement of rank {os.environ.get('RANK')}"):
            result = wrapped(*args, **kwargs)
        if supervised(os.environ):
            self._enter()
        return result

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if not supervised(os.environ):  # ttp alone handles a failure, as without this feature
            on_rank_zero(log.warning, "recover: no launcher replaces a lost worker here (launch with `ft-plugins run -- torchrun "
                       "...`, recover in FT_PLUGINS); a failure is ttp's alone")
            return wrapped(*args, **kwargs)
        names = ("forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator",
                 "valid_data_iterator", "process_non_loss_data_func", "config", "checkpointing_context")
        given = {**dict(zip(names, args)), **kwargs}
        self.refusal = unsupported(megatron("training.global_vars").get_args())
        if self.refusal:
            if not self.joined:
                log.error("recover: replacement of rank %s cannot join: %s", os.environ.get("RANK"), self.refusal)
                raise SystemExit(EXIT_ON_ERROR)
            on_rank_zero(log.warning, "recover: a lost rank cannot be replaced in this run: %s", self.refusal)
            self._publish_refusal()
            return wrapped(*args, **kwargs)
        self.objects = (given["model"], given["optimizer"], given["opt_param_scheduler"])
        iterator = given["train_data_iterator"]
        self.loop = (given.get("checkpointing_context"), iterator)
        self.batches, given_iterator = kept(iterator)
        self.watch.start()
        if given_iterator is not iterator:
            args, kwargs = loop.replaced(args, kwargs, 4, "train_data_iterator", given_iterator)
        result = wrapped(*args, **kwargs)
        if not self.joined:  # no step was left to run: the survivors stand in the loop's save of the last one
            self._join(megatron("training.global_vars").get_args().iteration)
        mark_trained(self._store, global_rank() or 0)
        return result

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = current_iteration(args, kwargs)
        if self.batches is None and not self.refusal:  # train() was not seen: not a run this handles
            return wrapped(*args, **kwargs)
        if not self.joined and self._join(iteration) == BEHIND:
            return self._done_by_peer()
        if self.batches is not None:
            self.batches.begin_step()
        while True:
            result, reason, own = loop.attempt(wrapped, args, kwargs, self.regroup.interrupt)
            if reason is None:
                self.result_size = len(result) if isinstance(result, tuple) else self.result_size
                return result
            if own:
                self._raised(reason, f"step {iteration + 1}")
            if self._recover(iteration, reason, f"step {iteration + 1}") == BEHIND:
                return self._done_by_peer()

    def training_log(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The loop's logging of step K has collectives (a barrier, a maximum, the timers' gather): a rank lost
        meanwhile is repaired as for a rank caught after its update of K, and the logging runs again."""
        if self.batches is None or not self.joined:
            return wrapped(*args, **kwargs)
        iteration = argument(wrapped, args, kwargs, "iteration")
        return self._again(wrapped, args, kwargs, iteration - 1, f"the log of step {iteration}")

    def save_checkpoint_and_time(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """A periodic save a lost rank interrupted is repaired like a step, then run again (:mod:`.loop`)."""
        if self.batches is None or not self.joined:
            return wrapped(*args, **kwargs)
        iteration = loop.iteration_of(args, kwargs)
        if kwargs.get("non_persistent_ckpt"):  # not run again: the replacement cannot tell it from a persistent one
            return self._again(wrapped, args, kwargs, iteration, f"the non-persistent save of step {iteration}", None)
        return self._again(wrapped, args, kwargs, iteration, f"the save of step {iteration}", True)

    def _again(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict, position: int, where: str,
               saving: bool | None = False) -> Any:
        """Run a part of the loop after the step (its logging, its save); a rank lost in it is repaired, then
        the part runs again from its top on every rank (``saving`` None: the dump instead)."""
        while True:
            result, reason, own = loop.attempt(wrapped, args, kwargs, self.regroup.interrupt)
            if reason is None:
                return result
            if own:
                self._raised(reason, where)
            if saving is None:
                self._fall_back(self.generation + 1, f"{reason} in {where}")
            self._recover(position, reason, where, saving=bool(saving))
            loop.timers_as_before()

    def _done_by_peer(self) -> tuple:
        return loop.done_by_peer(self.result_size or train_step_items())

    # -- the protocol ------------------------------------------------------------------------------
    def _join(self, iteration: int) -> str:
        """The replacement joins where the loop stands after ``iteration`` steps; if the survivors were in
        the save of that step, it runs that save with them."""
        self.tracker.mark_torn()  # nothing here is worth a dump until the state came
        outcome = self._repair(None)
        if outcome == SAVE:
            loop.save_as_the_loop(iteration, self.objects, *self.loop)
        return outcome

    def _recover(self, iteration: int, reason: str, where: str, saving: bool = False) -> str:
        """A survivor's side: hold, wait for the replacement, repair. Falls back to the dump (no return)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        started = time.monotonic()
        progress.report(progress.RECOVERY)
        standing, snapshot = self._standing(iteration)
        standing = standing._replace(saving=saving)
        generation = self.generation + 1
        held = (f"{standing.completed} steps completed here" if standing.completed >= 0 else
                "its state torn by an update left half done: a peer sends it the step")
        log.warning("recover: rank %d (pid %d) caught %s in %s (%s); waiting for a replacement", rank, os.getpid(),
                    reason, where, held)
        events.emit("caught", generation=generation, reason=reason, section=where, completed=standing.completed)
        loop.forget_pending_communication(self.objects[0])
        try:
            with self._quiet():
                if self.refusal:
                    raise Fallback(self.refusal)
                require_successors(self.regroup.hold(rank, world, self._holding_store(), megatron_roots(self.objects)),
                                   Fallback)
                place = self._replaced(generation, standing, rank, world)
            self.generation = generation
            return self._repair((standing, snapshot), started, place)
        except Exception as exc:  # Fallback, or a second fault while repairing
            self._fall_back(generation, f"{type(exc).__name__}: {exc}" if not isinstance(exc, Fallback) else str(exc))
            raise  # not reached: the dump exits

    def _replaced(self, generation: int, standing: Standing, rank: int, world: int) -> tuple[int, int]:
        """A survivor's wait for the replacement the launcher announces; this rank's place in the repaired job."""
        store = self._store()
        self._await(generation, ["lost"], "the launcher's announcement of a replacement")
        store.set(key(generation, f"state/{rank}"), standing.encode())
        if store.add(key(generation, "published"), 1) == world - 1:  # the last survivor's word
            store.set(key(generation, STANDINGS), "ready")
        self._await(generation, ["joined"], "the replacement")
        return rank, world

    def _repair(self, mine: tuple[Standing, Any] | None, started: float | None = None,
                place: tuple[int, int] | None = None) -> str:
        """Every rank of the generation: rebuild the groups, agree on K, hand over, stand at K; ``place``: this
        rank's (rank, world) in the rebuilt job, where not torchrun's."""
        import torch.distributed as dist

        generation, store = self.generation, self._store()
        rank, world = place or (global_rank(), int(os.environ["WORLD_SIZE"]))
        started = started or time.monotonic()
        try:
            with self._quiet():
                if mine is None:
                    faults.Drill().reached("join")
                    store.set(key(generation, "joined"), str(rank))
                faults.Drill().reached("regroup")
                arrive(self._waiting_store(), generation, world, self.timeout)
                from torch.distributed import PrefixStore

                require_successors(self.regroup.join(rank, world, PrefixStore(key(generation, "world/"), store),
                                                       megatron_roots(self.objects)), Fallback)
                self._rebuilt(-2 if mine is None else mine[0].completed)
                self.watch.start()  # a replacement's groups are real from here
                self.joined = True
                # each rank's standing and holding in one collective of the rebuilt groups, not N reads of the
                # store by each of N ranks (the replacement has no standing: it is behind every survivor)
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, (None if mine is None else mine[0].encode(),
                                                  what_this_rank_holds(self.objects[1])))
                standings = {peer: Standing.decode(raw) for peer, (raw, _) in enumerate(gathered) if raw is not None}
                holds = [held for _, held in gathered]
                kinds = sorted(set(holds))
                groups = [[r for r in range(world) if holds[r] == held] for held in kinds]
                decided = plan(standings, groups)
                if decided.refusal:
                    raise Fallback(decided.refusal)
                outcome = self._hand_over(rank, decided, kinds.index(holds[rank]), mine)
                self._resumed(next(s.consumed for s in standings.values() if s.completed == decided.step))
                store.add(key(generation, "done"), 1)
        except Exception as exc:
            self._fall_back(generation, str(exc) if isinstance(exc, Fallback) else f"{type(exc).__name__}: {exc}")
            raise  # not reached
        if mine is None:
            resume_collection(keep_disabled=bool(getattr(megatron("training.global_vars").get_args(), "manual_gc",
                                                         False)))
        if rank == min(groups[0]) or mine is None:
            self.feature.recoveries.append(f"generation {generation}: step {decided.step}")
            log.warning("recover: rank %d %s generation %d in %.2f s: every rank stands at step %d, training "
                        "continues at step %d", rank, "joined" if mine is None else "repaired", generation,
                        time.monotonic() - started, decided.step, decided.step + 1)
        events.emit("recovered", generation=generation, step=decided.step, seconds=time.monotonic() - started)
        progress.report(progress.STEP)  # the step goes on (or starts again) under the step's bound
        return outcome

    def _hand_over(self, rank: int, decided: Any, index: int, mine: tuple[Standing, Any] | None) -> str:
        """Send or receive the state at K inside this data-parallel group; leave this rank at exactly K."""
        mpu = megatron("core.parallel_state")
        group = mpu.get_data_parallel_group_gloo(with_context_parallel=True) or mpu.get_data_parallel_group(
            with_context_parallel=True)
        model, optimizer, scheduler = self.objects
        source, receivers = decided.sources[index], decided.receivers[index]
        per_step = megatron("core.num_microbatches_calculator").get_num_microbatches()
        if rank == source and receivers:
            step, completed, rng, consumed = mine[1]
            sent = send(state_at(model, optimizer, scheduler, completed, rng, consumed, mine[0].flops), receivers, group)
            log.warning("recover: rank %d sent the state of step %d (%.1f MB) to rank%s %s", rank, completed,
                        sent / 1e6, "" if len(receivers) == 1 else "s", ", ".join(map(str, receivers)))
            events.emit("state_sent", step=completed, bytes=sent, to=list(receivers))
        outcome = OUTCOME[decided.resume]
        if mine is None:  # the replacement: its counters were set at train to where every rank resumes
            state = receive(source, group)
            with self.tracker.holding():
                apply(state, model, optimizer, scheduler)
                self._align(UPDATED if outcome == BEHIND else FORWARD, state["rng_state"])
            if outcome == BEHIND:
                self.batches.finish(per_step)
            return outcome
        if outcome == SAVE:  # every survivor stands in the save of K, holding K whole: nothing else moves
            return SAVE
        # received outside ttp's lock, which a SIGTERM's dump takes: a receive blocked on a silent source would
        # otherwise hold the dump back until the launcher's SIGKILL
        state = receive(source, group) if rank in receivers else None
        with self.tracker.holding():
            if state is not None:
                apply(state, model, optimizer, scheduler)
                rng = state["rng_state"]
            else:
                rng = mine[1][2]
                if outcome == REPEAT:
                    set_rng(rng)
            if self.tracker.phase != IDLE:  # idle: caught in the logging of a step it completed, nothing moved
                self._align(FORWARD if outcome == REPEAT else UPDATED, rng)
        if outcome == REPEAT:
            self.batches.rewind()
            loop.rerun_anew()
        else:
            self.batches.finish(per_step)
        return outcome

    def _rebuilt(self, completed: int) -> None:
        """The groups were built again (:mod:`.elastic` lays out what their size decides); this rank holds step
        ``completed`` (-1: torn, -2: a replacement)."""

    def _resumed(self, consumed: int) -> None:
        """Every rank stands at K, ``consumed`` samples read (:mod:`.elastic` reads on from there)."""

    def _enter(self) -> None:
        """The replacement, before ``train`` starts: K and the counters at K from the survivors' standings."""
        megatron_args = megatron("training.global_vars").get_args()
        world = int(os.environ["WORLD_SIZE"])
        try:
            standings = self._standings(self.generation, world)
        except Fallback as exc:
            log.error("recover: replacement of rank %s cannot join: %s", os.environ.get("RANK"), exc)
            raise SystemExit(EXIT_ON_ERROR) from None
        step, resume = resumption(standings)
        if not resume:  # the survivors refuse it too, and fall back
            log.error("recover: replacement of rank %s cannot join: the survivors stand where no single point of "
                      "the loop serves them all", os.environ.get("RANK"))
            raise SystemExit(EXIT_ON_ERROR)
        newest = next(standing for standing in standings.values() if standing.completed == step)
        behind = 1 if resume == LOG else 0  # it runs the end of step K with the survivors: it starts as at K - 1
        samples = behind and step_samples(newest.consumed)
        flops = megatron("training.training").num_floating_point_operations(megatron_args, samples) if samples else 0
        megatron_args.iteration = step - behind
        megatron_args.consumed_train_samples = newest.consumed - samples
        megatron_args.num_floating_point_operations_so_far = newest.flops - flops
        megatron("core.num_microbatches_calculator").update_num_microbatches(megatron_args.consumed_train_samples,
                                                                             consistency_check=False)
        self.writer.started_from(megatron_args.consumed_train_samples,
                                 megatron_args.num_floating_point_operations_so_far)
        log.warning("recover: replacement of rank %s (generation %d) starts at step %d, as the survivors",
                    os.environ.get("RANK"), self.generation, step + 1 - behind)
        events.emit("joined", generation=self.generation, step=step - behind)

    def _raised(self, reason: str, where: str) -> None:
        """This rank's own code raised, in no collective: no process is lost, so there is nothing to replace,
        and running the step again in place would meet the same exception whenever it comes from the data or
        the code. So what ``ttp`` does for an exception (the dump of K, then torchrun's handling), at once:
        the generation is abandoned on the store and this rank's groups shut down before it dumps, so the
        peers blocked in a collective with it fail within milliseconds and fall back too, instead of each
        waiting for a replacement until the timeout."""
        self._fall_back(self.generation + 1, f"rank {global_rank()} raised {reason} in {where}: an exception, "
                        "not a lost process, so there is nothing to replace")

    def _fall_back(self, generation: int, reason: str) -> None:
        """``ttp``'s dump of the last completed step, then exit (whole-job restart)."""
        import torch.distributed as dist

        log.error("recover: generation %d cannot recover: %s; falling back to ttp's dump", generation, reason)
        try:
            abandon(self._store(), generation, reason)
            if not self.regroup.holding():
                self.regroup.hold(dist.get_rank(), dist.get_world_size(), self._holding_store(),
                                  megatron_roots(self.objects))
        except Exception as exc:
            log.info("recover: groups not held before the dump: %s: %s", type(exc).__name__, exc)
        self.gasp.fire(f"recover fell back ({reason})", EXIT_ON_ERROR)

    # -- helpers -----------------------------------------------------------------------------------
    def _standing(self, iteration: int) -> tuple[Standing, Any]:
        """Where this survivor stands, from ttp's step tracker (the snapshot a dump at this moment would take)."""
        with self.tracker.holding():
            frozen = self.tracker.peek()
            snapshot = None if frozen is None or frozen.torn else self.writer.snapshot(frozen)
        megatron_args = megatron("training.global_vars").get_args()
        if snapshot is None:
            return Standing(-1, iteration, 0, 0.0), None
        completed, consumed = snapshot[1], snapshot[3]
        return Standing(completed, iteration, consumed, self.writer.flops(consumed, megatron_args)), snapshot

    def _align(self, phase: str, rng: Any) -> None:
        """Called holding ttp's lock: its step tracker says what this rank now holds."""
        scheduler, step = self.objects[2], self.tracker.payload
        self.tracker.align(phase)
        if step is not None:
            step.rng, step.scheduler_steps = rng, getattr(scheduler, "num_steps", 0)

    def _quiet(self) -> Any:
        """The main thread changes no training state meanwhile (state is applied under ttp's lock), so a
        dump (SIGTERM) may run; once one started, the main thread never goes on."""
        return self.tracker.standing_still()

    def _store(self) -> Any:
        if self.store is None:
            self.store = self._connect()
        return self.store

    def _holding_store(self) -> Any:
        from torch.distributed import PrefixStore

        return PrefixStore("hold/", self._store())

    def _waiting_store(self) -> Any:
        """A connection for the store's waits alone: one holds it, and the holding groups (and a dump) use :meth:`_store`'s."""
        if self.waits is None:
            self.waits = self._connect()
        return self.waits

    def _connect(self) -> Any:  # a connection of its own each time
        return connect(os.environ, self.timeout)
    def _publish_refusal(self) -> None:
        """Tell the launcher before any failure, so that it leaves a lost rank to torchrun's own handling instead
        of starting a replacement that could not join (a second failure)."""
        try:
            self._store().set(REFUSED, self.refusal)
        except Exception as exc:  # no agent store: the launcher refuses by itself then
            log.debug("recover: refusal not published: %s: %s", type(exc).__name__, exc)

    def _await(self, generation: int, names: list[str], what: str, timeout: float | None = None) -> list[bytes]:
        return await_keys(self._waiting_store(), generation, names, what, timeout or self.timeout)

    def _standings(self, generation: int, world: int) -> dict[int, Standing]:
        return standings(self._waiting_store(), generation, world, self.timeout)
