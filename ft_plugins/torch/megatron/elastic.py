"""Megatron glue for ``elastic``: a scale-in in place when a lost rank is not replaced (the launcher's side: its
exit barrier, :class:`ft_plugins.launch.recover.Supervisor`).

Built on ``recover`` (:class:`~.recover.MegatronRecovery`). A survivor that caught a lost peer holds its groups,
says who it is (:class:`ft_plugins.recovery.Member`) and waits ``wait`` seconds, not ``recover``'s timeout, for
the launcher's replacement. None came (a node lost for good): the survivors agree on who goes on
(:func:`ft_plugins.recovery.members`, :func:`ft_plugins.recovery.going_on`): every rank of a model replica that
lost one is dropped, the others are numbered again in their order, so that the i-th smallest old rank becomes rank
i, which is Megatron's own layout at the smaller data-parallel size. Megatron's groups are built for the new world
(:mod:`.regroup`); what Megatron computes from the data-parallel size when it builds a job is set again (the
gradient buffers' scaling before the reduction, the micro-batch calculator, the arguments; with Megatron's
distributed optimizer its buffers and shards, :mod:`.reshard`); the state of the newest completed step K goes to
every rank that lacks it (:mod:`.handover`); the data iterators, training's and
validation's, are built again by Megatron at the samples each consumed; and training goes on at K + 1 with the
global batch kept (more micro-batches per rank). That is what Megatron's own resume at the smaller size from a save
of K does, without a process restarted or a file read.

A healthy rank of a dropped replica (with pipeline parallelism a node holds one stage of several replicas) leaves
the job, exit code 0. Not yet, each refused at the start in one line (a lost node with no replacement within
``wait`` then takes ``recover``'s fallback at once: ttp's dump, and torchrun's restart at the size left): context or
expert parallelism, virtual pipeline stages, a batch-size ramp-up, one replica, and the distributed optimizer's
forms :func:`.reshard.unreshardable` names (a size its instances do not divide falls back at the fault). A
global batch (or megatron-core 0.19's evaluation batch) the smaller size does not divide follows Megatron's
``--decrease-batch-size-if-needed``: rounded down with it, refused at the fault without it; the sizes that keep it
are said at the start. After a scale-in a node lost again is scaled in again; a worker lost on a node that stays is
left to torchrun (the dump, and its restart): the ranks are numbered anew, torchrun's are not. Growing back is
torchrun's restart when the lost node returns (the workers dump on SIGTERM and the job resumes at the full size:
:class:`.regroup.Regroup` keeps the new workers' keys apart from the old ones'); not in place yet.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.features.elastic import Elastic
from ft_plugins.features.recover import Recover
from ft_plugins.patching import Patch
from ft_plugins.rank import global_rank, on_rank_zero
from ft_plugins.recovery import NODES, REFUSED, Fallback, Late, Member, Standing, going_on, key, members
from ft_plugins.torch.megatron import loop
from ft_plugins.torch.megatron.recover import MegatronRecovery
from ft_plugins.torch.megatron.reshard import (Unmovable, move, pieces, rebuild_buffers, rebuild_optimizer,
                                               unreshardable)
from ft_plugins.torch.megatron.state import TRAINING, megatron
from ft_plugins.torch.megatron.ttp import MegatronTtp

log = logging.getLogger("ft_plugins.elastic")


def unscalable(megatron_args: Any) -> str:
    """Why this run cannot go on at a smaller data-parallel size in place ("" when it can)."""
    if getattr(megatron_args, "use_distributed_optimizer", False) and (why := unreshardable(megatron_args)):
        return why
    if (getattr(megatron_args, "context_parallel_size", 1) or 1) > 1:
        return "context parallelism (--context-parallel-size): its groups are not resized yet"
    if (getattr(megatron_args, "num_experts", None) or 0) > 1:
        return "mixture of experts: the expert data-parallel groups are not resized yet"
    if getattr(megatron_args, "virtual_pipeline_model_parallel_size", None):
        return "virtual pipeline stages: their data iterators are not built again yet"
    if getattr(megatron_args, "rampup_batch_size", None):
        return "a batch-size ramp-up (--rampup-batch-size): its calculator is not resized yet"
    if megatron_args.data_parallel_size < 2:
        return "one data-parallel replica: a lost rank leaves no replica to go on with"
    return ""


def global_batch(megatron_args: Any, size: int) -> int:
    """The global batch at data-parallel size ``size``: the run's where it is whole micro-batches there, else the
    largest multiple of micro-batch x size below it (Megatron's own rounding, ``--decrease-batch-size-if-needed``)."""
    whole = megatron_args.micro_batch_size * size
    return megatron_args.global_batch_size // whole * whole


def evaluation_batch(megatron_args: Any, size: int) -> int | None:
    """The evaluation batch at data-parallel size ``size`` (``--eval-global-batch-size``, from megatron-core 0.19, the
    global batch by default; None before, where evaluations take the global batch): rounded down as
    :func:`global_batch` is, to whole evaluation micro-batches."""
    batch = getattr(megatron_args, "eval_global_batch_size", None)
    if batch is None:
        return None
    whole = (getattr(megatron_args, "eval_micro_batch_size", None) or megatron_args.micro_batch_size) * size
    return batch // whole * whole


def smaller_sizes(megatron_args: Any) -> list[int]:
    """The data-parallel sizes below this run's at which its global batch, and its evaluation batch, are kept exactly
    (whole micro-batches)."""
    return [size for size in range(megatron_args.data_parallel_size - 1, 0, -1)
            if global_batch(megatron_args, size) == megatron_args.global_batch_size
            and evaluation_batch(megatron_args, size) == getattr(megatron_args, "eval_global_batch_size", None)]


def relayout(model: list[Any], size: int) -> None:
    """Megatron's DDP as it builds it at data-parallel size ``size`` (without the distributed optimizer its buffers'
    layout does not depend on the size): the scaling of the gradients before their reduction, ``1/size`` unless it
    is 1 (averaged in the collective, or a per-token loss)."""
    for chunk in model:
        for buffer in (*chunk.buffers, *getattr(chunk, "expert_parallel_buffers", ())):
            buffer.data_parallel_world_size = buffer.data_parallel_group.size()
            if buffer.gradient_scaling_factor != 1.0:
                buffer.gradient_scaling_factor = 1.0 / size
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = buffer.gradient_scaling_factor


def _reconfigure_micro_batches(rank: int, megatron_args: Any, size: int) -> None:
    """Megatron's micro-batch calculator built again for data-parallel size ``size``, as each release names it
    (``reconfigure_microbatch_calculator`` in megatron-core 0.8, without ``decrease_batch_size_if_needed``)."""
    calculator = megatron("core.num_microbatches_calculator")
    batches = (megatron_args.rampup_batch_size, megatron_args.global_batch_size, megatron_args.micro_batch_size, size)
    newer = getattr(calculator, "reconfigure_num_microbatches_calculator", None)
    if newer is not None:
        newer(rank, *batches, getattr(megatron_args, "decrease_batch_size_if_needed", False))
    else:
        getattr(calculator, "reconfigure_microbatch_calculator")(rank, *batches)


def model_replica() -> tuple[int, ...]:
    """The global ranks of this rank's model replica: its model-parallel group (every rank at its data-parallel
    index)."""
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(megatron("core.parallel_state").get_model_parallel_group()))


class Reader:
    """A data iterator whose source a scale-in replaces, as Megatron's ``RerunDataIterator`` reads ``iterable``."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> "Reader":
        return self

    def __next__(self) -> Any:
        return next(self.iterable)


def readable(iterator: Any) -> Any:
    """``iterator`` (one, a list of them, or None) with a source a scale-in can replace."""
    if isinstance(iterator, list):
        return [readable(member) for member in iterator]
    return iterator if iterator is None or hasattr(iterator, "iterable") else Reader(iterator)


def read_from(iterator: Any, built: Any) -> None:
    """``iterator`` (:func:`readable`'s) reads on from what Megatron ``built`` again."""
    if isinstance(iterator, list):
        for member, new in zip(iterator, built):
            read_from(member, new)
    elif iterator is not None and built is not None:
        iterator.iterable = getattr(built, "iterable", built)


class Resize:
    """What Megatron computed from the data-parallel size when it built the job, set again for a smaller size: the
    built-in scale-in's (:class:`MegatronElastic`) and MindIO's downgrade's (:mod:`.mindio_elastic`)."""

    def __init__(self) -> None:
        self.data: tuple[tuple, dict] | None = None  # build_train_valid_test_data_iterators' arguments
        self.optimizer_built: tuple[tuple, dict] | None = None  # get_megatron_optimizer's arguments
        self.cannot = ""  # why this run cannot scale in
        self.size = 0  # the data-parallel size a scale-in under way goes to
        self.evaluation: int | None = None  # and its evaluation batch (megatron-core 0.19 on)
        self.given: Any = None  # train()'s validation iterator(s), as given (MindIO gives them again at each retry)
        self.validation: Any = None  # and as :func:`readable` made them
        self.said = False  # whether rank 0 said at train if this run can scale in

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(TRAINING, "build_train_valid_test_data_iterators", self.data_iterators),
                Patch(TRAINING, "get_megatron_optimizer", self.optimizer, required=False))

    def optimizer(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Megatron's optimizer, as setup_model_and_optimizer builds it: built again at a scale-in."""
        self.optimizer_built = (args, kwargs)
        return wrapped(*args, **kwargs)

    def data_iterators(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Megatron's iterators, built as pretrain builds them: built again at a scale-in."""
        self.data = (args, kwargs)
        return wrapped(*args, **kwargs)

    def begin(self, args: tuple, kwargs: dict, when: str, otherwise: str) -> tuple[tuple, dict]:
        """At train: whether this run can scale in, said on rank 0 (``when``: what scales it in; ``otherwise``: what
        a lost rank takes where it cannot); train's arguments with its validation iterator(s) made replaceable."""
        megatron_args = megatron("training.global_vars").get_args()
        self.cannot = unscalable(megatron_args) or ("" if self.data else "Megatron's data iterators were built "
                                                    "outside pretrain's build_train_valid_test_data_iterators") or (
            "Megatron's distributed optimizer was built outside setup_model_and_optimizer's get_megatron_optimizer"
            if megatron_args.use_distributed_optimizer and self.optimizer_built is None else "")
        first, self.said = not self.said, True  # MindIO calls train again after a repair
        if self.cannot and first:
            on_rank_zero(log.warning, "elastic: this run cannot go on at a smaller data-parallel size: %s; a lost "
                         "rank with no replacement takes %s", self.cannot, otherwise)
        elif first:
            sizes = smaller_sizes(megatron_args)
            others = ("Megatron's --decrease-batch-size-if-needed rounds it down at the others"
                      if getattr(megatron_args, "decrease_batch_size_if_needed", False) else
                      f"the others take {otherwise}, or with --decrease-batch-size-if-needed round it down")
            on_rank_zero(log.info, "elastic: %s: its model replica is dropped and training goes on in place; the "
                         "global batch %d is kept at data-parallel size%s %s (%s)", when,
                         megatron_args.global_batch_size, "s" if len(sizes) > 1 else "", ", ".join(map(str, sizes))
                         or "none", others)
        validation = kwargs["valid_data_iterator"] if "valid_data_iterator" in kwargs else (args[5:6] or [None])[0]
        if self.validation is None or validation is not self.given:
            self.given, self.validation = validation, readable(validation)
        if self.validation is not validation:
            args, kwargs = loop.replaced(args, kwargs, 5, "valid_data_iterator", self.validation)
        return args, kwargs

    def to(self, size: int, refuse: type[Exception]) -> int:
        """Go to data-parallel size ``size`` (laid out at :meth:`rebuilt`): its global batch, or ``refuse`` raised
        with why the batches cannot be kept there."""
        megatron_args = megatron("training.global_vars").get_args()
        batch, evaluation = global_batch(megatron_args, size), evaluation_batch(megatron_args, size)
        evaluated = getattr(megatron_args, "eval_global_batch_size", None)
        shrinks = getattr(megatron_args, "decrease_batch_size_if_needed", False)  # Megatron's own rounding down
        if batch != megatron_args.global_batch_size and not shrinks:
            raise refuse(f"the global batch {megatron_args.global_batch_size} is not a whole number of micro-batches "
                         f"of {megatron_args.micro_batch_size} at data-parallel size {size} (Megatron's "
                         "--decrease-batch-size-if-needed rounds it down instead)")
        if evaluation != evaluated and not shrinks:
            raise refuse(f"the evaluation batch {evaluated} (--eval-global-batch-size) is not a whole number of "
                         f"evaluation micro-batches at data-parallel size {size} (Megatron's "
                         "--decrease-batch-size-if-needed rounds it down instead)")
        if not batch or evaluation == 0:
            raise refuse(f"data-parallel size {size} leaves less than one micro-batch per rank in a batch")
        instances = getattr(megatron_args, "num_distributed_optimizer_instances", 1) or 1
        if megatron_args.use_distributed_optimizer and size % instances:
            raise refuse(f"data-parallel size {size} cannot hold the distributed optimizer's {instances} instances")
        self.size, self.evaluation = size, evaluation
        return batch

    def announce(self, why: str, lost: list[int], going: int, batch: int, generation: int, speaker: bool) -> str:
        """The scale-in to :meth:`to`'s size, as an event, and in one line where ``speaker`` (the change, returned)."""
        megatron_args = megatron("training.global_vars").get_args()
        evaluated = getattr(megatron_args, "eval_global_batch_size", None)
        if speaker:
            kept = (f"{batch} kept" if batch == megatron_args.global_batch_size else
                    f"now {batch} (was {megatron_args.global_batch_size}: Megatron's --decrease-batch-size-if-needed)")
            if self.evaluation != evaluated:
                kept += f", the evaluation batch now {self.evaluation} (was {evaluated}: rounded alike)"
            log.warning("elastic: %s for rank%s %s: %d ranks go on at data-parallel size %d (was %d), the global batch "
                        "%s", why, "s" if len(lost) > 1 else "", ", ".join(map(str, lost)), going, self.size,
                        megatron_args.data_parallel_size, kept)
        events.emit("scale_in", generation=generation, lost=lost, world=going, data_parallel=self.size,
                    before=megatron_args.data_parallel_size, global_batch=batch)
        return f"generation {generation}: data-parallel {megatron_args.data_parallel_size} -> {self.size}"

    def rebuilt(self, objects: tuple[Any, Any, Any], tracker: Any, completed: int, refuse: type[Exception]) -> None:
        """Megatron's groups stand at the new size: set what Megatron computed from the old one; this rank holds
        step ``completed`` (-1: torn); ``refuse``: raised where the distributed optimizer cannot be laid out."""
        if not self.size:
            return
        import torch.distributed as dist

        megatron_args = megatron("training.global_vars").get_args()
        megatron_args.rank, megatron_args.world_size = dist.get_rank(), dist.get_world_size()
        megatron_args.data_parallel_size = self.size
        if megatron_args.use_distributed_optimizer:  # Megatron's DDP, built again, scales its new buffers itself
            self._reshard(objects, tracker, megatron_args, completed, refuse)
        else:
            relayout(objects[0], self.size)
        if self.evaluation is not None:  # evaluate() reads it at each call
            megatron_args.eval_global_batch_size = self.evaluation
        _reconfigure_micro_batches(dist.get_rank(), megatron_args, self.size)

    def _reshard(self, objects: tuple[Any, Any, Any], tracker: Any, megatron_args: Any, completed: int,
                 refuse: type[Exception]) -> None:
        """The distributed optimizer's shards laid out for the new size (:mod:`.reshard`); nothing here is worth a
        dump meanwhile (a fault now ends in the last save)."""
        model, optimizer, _ = objects
        started = time.monotonic()
        with tracker.holding():
            tracker.mark_torn()
        try:
            held = pieces(model, optimizer)
            rebuild_buffers(model, megatron_args)
            rebuilt = rebuild_optimizer(optimizer, self.optimizer_built)
            group = megatron("core.parallel_state").get_data_parallel_group(with_context_parallel=True)
            move(held, pieces(model, rebuilt), completed, group)
        except Unmovable as exc:
            raise refuse(f"the distributed optimizer cannot be laid out again: {exc}") from None
        vars(optimizer).clear()
        vars(optimizer).update(vars(rebuilt))
        with tracker.holding():
            tracker.align(tracker.phase)
        log.info("elastic: rank %d laid the distributed optimizer out for data-parallel size %d (%.2f s)",
                 megatron_args.rank, self.size, time.monotonic() - started)

    def resumed(self, batches: Any, consumed: int) -> bool:
        """Every rank stands at K: Megatron builds the data iterators again at K's samples, at the new size; whether
        a scale-in was under way."""
        if not self.size:
            return False
        started = time.monotonic()
        megatron_args = megatron("training.global_vars").get_args()
        counted, megatron_args.consumed_train_samples = megatron_args.consumed_train_samples, consumed
        try:
            args, kwargs = self.data
            built = megatron("training.training").build_train_valid_test_data_iterators(*args, **kwargs)
            iterator, validation = built[0], built[1]
        finally:
            megatron_args.consumed_train_samples = counted  # the loop counts a step a peer completed itself
        batches.source, batches.fetched, batches.replay = iterator, [], []
        read_from(self.validation, validation)  # at the validation samples consumed, Megatron's own count
        self.size = 0
        log.info("elastic: rank %d reads on from sample %d at data-parallel size %d (%.2f s)", megatron_args.rank,
                 consumed, megatron_args.data_parallel_size, time.monotonic() - started)
        return True


class MegatronElastic(MegatronRecovery):
    """``recover``'s worker side, going on at a smaller data-parallel size when no replacement comes."""

    def __init__(self, feature: Recover, ttp: MegatronTtp, elastic: Elastic) -> None:
        super().__init__(feature, ttp)
        self.elastic = elastic
        self.resize = Resize()
        self.member: Member | None = None  # this rank, as the survivors of a loss must know it

    def patches(self) -> tuple[Patch, ...]:
        return (*super().patches(), *self.resize.patches())

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        import torch.distributed as dist

        args, kwargs = self.resize.begin(args, kwargs, f"a lost rank not replaced within "
                                         f"{self.elastic.settings['wait']:.0f} s", "recover's fallback")
        if not self.resize.cannot:
            self.member = Member(dist.get_rank(), int(os.environ.get("GROUP_RANK", "0")), model_replica())
        return super().train(wrapped, instance, args, kwargs)

    # -- the scale-in ------------------------------------------------------------------------------
    def _replaced(self, generation: int, standing: Standing, rank: int, world: int) -> tuple[int, int]:
        """Wait ``wait`` seconds for the launcher's replacement, then scale in; a run that cannot scale in place
        takes the dump then, not after ``recover``'s timeout (torchrun restarts it at the size left)."""
        wait = self.elastic.settings["wait"]
        if self.member is not None:
            self._store().set(key(generation, f"member/{rank}"), self.member.encode())
        try:
            self._await(generation, ["lost"], "the launcher's announcement of a replacement", wait)
        except Late:
            if self.member is None:
                raise Fallback(f"no replacement within {wait:.0f} s, and this run cannot go on at a smaller size in "
                               f"place ({self.resize.cannot}): the dump, then torchrun's restart at the size left"
                               ) from None
            return self._scale_in(generation, rank, world)
        return super()._replaced(generation, standing, rank, world)

    def _scale_in(self, generation: int, rank: int, world: int) -> tuple[int, int]:
        """Who goes on, and this rank's place among them; Fallback where the job cannot go on so."""
        found = members(self._waiting_store(), generation, world, self.timeout)
        if rank not in found:
            raise Fallback(f"rank {rank} came after the survivors had agreed to go on without a replacement")
        stay, leaving, why = going_on(found, world)
        if why:
            raise Fallback(why)
        if rank in (stay[0], *leaving):  # the nodes that reach torchrun's exit barrier: said before any leaves
            self._store().set(NODES, json.dumps(sorted({member.node for member in found.values()})))
        if rank == stay[0]:  # the launchers number what they announce next after this generation (a node lost later)
            self._store().add("generation", 1)
        if rank in leaving:
            self._leave(generation, sorted(set(range(world)) - set(found)))
        batch = self.resize.to(len(stay) // len(self.member.replica), Fallback)
        change = self.resize.announce(f"no replacement within {self.elastic.settings['wait']:.0f} s",
                                      sorted(set(range(world)) - set(found)), len(stay), batch, generation,
                                      rank == stay[0])
        if rank == stay[0]:  # speaks for the job
            self.elastic.changes.append(change)
        return stay.index(rank), len(stay)

    def _leave(self, generation: int, lost: list[int]) -> None:
        """A healthy rank of a model replica that lost a rank: the others go on without it, and it ends, exit code 0
        (its node's agent counts it done; kept as a warm spare for a scale-out is not implemented)."""
        log.warning("elastic: rank %d leaves the job: its model replica lost rank%s %s and the others go on without "
                    "it", global_rank(), "s" if len(lost) > 1 else "", ", ".join(map(str, lost)))
        events.emit("left", generation=generation, lost=lost)
        events.end(0)
        logging.shutdown()
        os._exit(0)

    def _rebuilt(self, completed: int) -> None:
        self.resize.rebuilt(self.objects, self.tracker, completed, Fallback)

    def _resumed(self, consumed: int) -> None:
        if not self.resize.resumed(self.batches, consumed):
            return
        megatron_args = megatron("training.global_vars").get_args()
        self.member = self.member._replace(rank=megatron_args.rank, replica=model_replica())  # the next loss's
        # the ranks are numbered anew, torchrun's are not: a worker of this node lost now is left to torchrun (the
        # dump, and its restart); a node lost is scaled in again
        self._store().set(REFUSED, "the job scaled in: its ranks are no longer torchrun's")
