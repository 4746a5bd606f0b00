"""The Megatron dump writer: what a save at the last completed step K would write, in Megatron's layout,
written by the survivors and committed (:mod:`ft_plugins.checkpoint.dump`). Driven by
:class:`ft_plugins.triggers.DyingGasp` (built-in engine) or by MindIO's handlers (:mod:`.mindio`).

The dump uses no collective with the non-distributed optimizer: one writer per shard is chosen by
``store.add`` on torchrun's store (which outlives every worker), and the state written is what
Megatron's ``save_checkpoint`` at K would write (``generate_state_dict``, its file naming, consumed
samples and scheduler as at K). With the distributed optimizer the members of each optimizer
instance first agree on K and gather the instance's state inside the instance's own gloo group
(Megatron's ``get_parameter_state_dp_zero``); an instance that lost a member fails there and writes
nothing, a complete one writes ``distrib_optim.pt`` beside the model file (replicas: see
``FT_PLUGINS_TTP_REPLICAS``). It also wraps ``save_checkpoint`` (a step saved already is not dumped
again) and ``load_checkpoint`` (dumps left complete but uncommitted are committed at start-up, before
anybody reads the tracker).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ft_plugins import events, grace
from ft_plugins.checkpoint.atomic import sync_file_system
from ft_plugins.checkpoint.dump import Part, clear_staging, commit_dump, complete_pending, withdraw, write_part
from ft_plugins.checkpoint.naming import iteration_dir, tracker_iteration
from ft_plugins.faults import RESTART_VAR
from ft_plugins.features.ttp import Ttp
from ft_plugins.rank import global_rank
from ft_plugins.steps import FORWARD, UPDATED, Frozen
from ft_plugins.torch import saving
from ft_plugins.torch.abort import abort_for_dump
from ft_plugins.torch.device import DeviceMarks
from ft_plugins.torch.megatron.regroup import Regroup, real_twins
from ft_plugins.torch.megatron.state import (RESUMES_TORCH_FORMAT, megatron, megatron_args, rng_state, saved_state,
                                             sharded_optimizers)
from ft_plugins.torch.store import agreed, claim, counted

log = logging.getLogger("ft_plugins.ttp")

FILENAME = "model_optim_rng.pt"
OPTIMIZER_FILENAME = "distrib_optim.pt"  # the distributed optimizer's parameter state, beside FILENAME


@dataclass
class MegatronStep:
    """What a save of the running step needs, attached to the step tracker at the step's start."""

    model: Any
    optimizer: Any
    scheduler: Any
    consumed: int  # samples consumed by the completed steps
    increment: int  # samples one step consumes
    scheduler_steps: int  # the scheduler's count when the step began
    rng: Any  # Megatron's rng_state list at the step boundary (None once the step completed)


class MegatronDump:
    """Snapshots the frozen step as a save at K would hold it, writes this rank's part, commits."""

    def __init__(self, feature: Ttp) -> None:
        self.feature = feature
        self._saved: set[int] = set()
        self._loaded = (0, 0.0)  # (consumed samples, floating point operations) the run started from
        self._grace_warned = False
        self._refusal: str | None = None
        self.marks = DeviceMarks()  # the step boundaries on the device: the dump copies behind the latest

    def refused(self, engine: str) -> bool:
        """Whether this run is one the dump cannot serve (said once in the log)."""
        if self._refusal is None:
            self._refusal = unsupported(megatron_args())
            if self._refusal:
                log.warning("ttp: the %s engine is off for this run: %s", engine, self._refusal)
        return bool(self._refusal)

    @staticmethod
    def step(args: tuple, kwargs: dict) -> MegatronStep:
        """The payload of a ``train_step`` call starting now."""
        names = ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler")
        given = dict(zip(names, args), **kwargs)
        parsed = megatron_args()
        scheduler = given["opt_param_scheduler"]
        increment = (megatron("core.parallel_state").get_data_parallel_world_size()
                     * parsed.micro_batch_size * megatron("core.num_microbatches_calculator").get_num_microbatches())
        rng = rng_state()
        return MegatronStep(given["model"], given["optimizer"], scheduler, parsed.consumed_train_samples,
                            increment, getattr(scheduler, "num_steps", 0), rng)

    @staticmethod
    def advance(step: MegatronStep) -> None:
        """The step completed: its samples are consumed, its RNG state is stale."""
        step.consumed, step.rng = step.consumed + step.increment, None

    # -- wrappers (wrapt signature) ----------------------------------------------------------------
    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = kwargs.get("iteration", args[0] if args else None)
        persistent = isinstance(iteration, int) and not kwargs.get("non_persistent_ckpt")
        if persistent and getattr(megatron_args(), "save", None) and withdraw(megatron_args().save, iteration):
            log.warning("ttp: the save of iteration %d writes over the dump of that step: the dump no longer counts "
                        "as committed until the save does", iteration)
        started = time.monotonic()
        with saving.timed_writes() as writes:
            result = wrapped(*args, **kwargs)
        if persistent:
            self._saved.add(iteration)
            self._measure_save(iteration, time.monotonic() - started, writes)
        return result

    def _measure_save(self, iteration: int, seconds: float, writes: list[tuple[float, int]]) -> None:
        """Rank 0 records how long the save's largest writer takes: at the speed of rank 0's own file writes, timed
        alone (``torch.save``), where it wrote any (``torch_dist`` writes its own way: the whole save's time then,
        barriers included). An async save's time is not the write's."""
        parsed = megatron_args()
        if (global_rank() or 0) != 0 or getattr(parsed, "async_save", False) or not getattr(parsed, "save", None):
            return
        written = grace.largest_writer(iteration_dir(parsed.save, iteration))
        own_seconds, own_bytes = sum(write[0] for write in writes), sum(write[1] for write in writes)
        if own_bytes and own_seconds:
            seconds = written * own_seconds / own_bytes
        grace.record(parsed.save, grace.Measured(written, seconds, f"save of iteration {iteration}"))
        self._warn_if_short(parsed.save)

    def _warn_if_short(self, save_dir: str) -> None:
        """Once per process: the dump needs longer than the launcher's grace (said by rank 0)."""
        line = None if self._grace_warned or (global_rank() or 0) != 0 else grace.warn_if_short(save_dir, os.environ)
        if line:
            self._grace_warned = True
            log.warning("ttp: %s", line)

    def load_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        import torch.distributed as dist

        load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
        load_dir = getattr(megatron_args(), load_arg, None)
        initialized = dist.is_available() and dist.is_initialized()
        if load_dir and (not initialized or dist.get_rank() == 0):
            self._complete(load_dir)
            self._warn_if_short(self.save_dir() or load_dir)
        if load_dir and initialized:
            dist.barrier()  # nobody reads the tracker before the commit is done
        result = wrapped(*args, **kwargs)
        if isinstance(result, tuple) and len(result) > 1:
            self.started_from(megatron_args().consumed_train_samples, result[1])
        return result

    # -- the dump ----------------------------------------------------------------------------------
    def save(self, reason: str, frozen: Frozen | None, commit: bool = True) -> None:
        """Write this rank's part of the dump of the frozen step (and commit it); never raises."""
        started = time.monotonic()
        try:
            abort_for_dump(reason)
            if frozen is None or frozen.torn:  # a torn rank has a role in the fault: it says so
                log.log(logging.DEBUG if frozen is None else logging.WARNING, "ttp: %s: nothing to dump (%s)",
                        reason, "no step began" if frozen is None else "this rank was caught inside an update")
                if frozen is not None and distributed_optimizer():
                    instance_state(frozen.payload.optimizer, -1)  # the instance's others learn it, write nothing
            else:
                with self.marks.side_stream(self.feature.settings["device_wait"]):
                    self._write(reason, started, *self.snapshot(frozen), commit=commit)
        except Exception as exc:  # never a half-committed dump: the commit checks every part
            log.error("ttp: dump failed: %s: %s", type(exc).__name__, exc)

    def snapshot(self, frozen: Frozen) -> tuple[MegatronStep, int, Any, int]:
        """(step, K, rng_state, consumed samples) as a save at the last completed step K would hold them."""
        step: MegatronStep = frozen.payload
        if frozen.phase == FORWARD:
            return step, frozen.completed, step.rng, step.consumed
        rng = rng_state()
        if frozen.phase == UPDATED:  # the update is done; finish the step's bookkeeping as train_step would
            if frozen.update_ok and getattr(step.scheduler, "num_steps", None) == step.scheduler_steps:
                step.scheduler.step(increment=step.increment)
            return step, frozen.completed + 1, rng, step.consumed + step.increment
        return step, frozen.completed, rng, step.consumed

    def save_dir(self) -> str:
        return self.feature.settings["save_dir"] or megatron_args().save

    def _write(self, reason: str, started: float, step: MegatronStep, iteration: int, rng: Any, consumed: int,
               commit: bool) -> None:
        checkpointing = megatron("training.checkpointing")
        parsed = megatron_args()
        save_dir = self.save_dir()
        if not save_dir:
            log.warning("ttp: %s: no --save directory and FT_PLUGINS_TTP_SAVE_DIR unset; nothing dumped", reason)
            return
        if iteration in self._saved or (tracker_iteration(save_dir) or -1) >= iteration:
            log.debug("ttp: %s: iteration %d is saved already; nothing to dump", reason, iteration)
            return
        rank = global_rank() or 0
        if Regroup.rebuilding():
            log.warning("ttp: %s: rank %d writes nothing: its process groups are being built again (recover); a "
                        "survivor whose groups stand writes the shards", reason, rank)
            return
        shard, shards = _shards(checkpointing, save_dir, iteration)
        writes: dict[str, Callable[[str], None]] = {}
        if parsed.use_distributed_optimizer:
            try:
                optimizer_state = instance_state(step.optimizer, iteration)
            except Exception as exc:
                # a would-be writer of its instance's part: it says why the part is missing
                log.warning("ttp: %s: rank %d writes nothing: its optimizer instance cannot gather its state (%s: %s)",
                            reason, rank, type(exc).__name__, exc)
                return
            if optimizer_state is None:
                return  # the first rank of the instance (of each of its parts) writes
            writes[OPTIMIZER_FILENAME] = lambda path: saving.save(optimizer_state, path)
        attempt = f"ft_plugins/ttp/{os.environ.get(RESTART_VAR, '0')}/{iteration}"
        if not claim(f"{attempt}/{shard}"):
            log.debug("ttp: %s: another survivor writes %s of iteration %d", reason, shard, iteration)
            return
        state = saved_state(step.model, step.optimizer, step.scheduler, iteration, rng, consumed)
        state["num_floating_point_operations_so_far"] = self.flops(consumed, parsed)
        writes[FILENAME] = lambda path: saving.save(state, path)
        part = Part(shard, iteration, shards, rank, attempt=agreed(f"{attempt}/dump", uuid.uuid4().hex))
        size = write_part(save_dir, part, writes)
        written = time.monotonic()
        grace.record(save_dir, grace.Measured(size, written - started, f"dump of iteration {iteration}"))
        status = self.commit(save_dir, iteration, counted(f"{attempt}/written"), len(shards)) if commit else \
            "committed on MindIO's rename"
        log.warning("ttp: %s: rank %d dumped %s of iteration %d in %.0f ms; %s", reason, rank, shard,
                    iteration, (written - started) * 1000, status)
        events.emit("dump", step=iteration, seconds=round(written - started, 4), shard=shard,
                    committed=status.startswith("committed"))
        sync_file_system(save_dir)  # against a crash of the node; a SIGKILL from here on loses nothing
        clear_staging(save_dir, part)
        log.debug("ttp: %s: rank %d's dump is on disk %.0f ms after it began", reason, rank,
                  (time.monotonic() - started) * 1000)

    def commit(self, save_dir: str, iteration: int, written: int | None = None, parts: int = 1) -> str:
        """The commit by the writer of the last of the dump's ``parts`` (``written``: its place among the writers
        counted on the store; None: no store, every writer tries): one committer reads every part's record, not
        every writer each (a dump of N shards had N writers each reading N records)."""
        if written is not None and written < parts:
            return f"part {written} of {parts} written; the writer of the last one commits"
        outcome = commit_dump(save_dir, iteration, durable=False)
        self.feature.saves.append(outcome.path)
        status = "committed" if outcome.committed else f"not committed yet ({'; '.join(outcome.reasons)})"
        return f"{status}: {outcome.path}"

    def started_from(self, consumed: int, flops: float) -> None:
        """Where this process's run began: a load's counters, or a replacement's, set from its peers'."""
        self._loaded = (consumed, flops)

    def flops(self, consumed: int, parsed: Any) -> float:
        """What ``train()`` counts as ``num_floating_point_operations_so_far`` once ``consumed`` samples are: its
        count per sample is the same whatever the batch (``--rampup-batch-size`` changes the batch)."""
        loaded, flops = self._loaded
        return flops + megatron("training.training").num_floating_point_operations(parsed, consumed - loaded)

    def _complete(self, save_dir: str) -> None:
        for outcome in complete_pending(save_dir):
            if outcome.committed:
                log.warning("ttp: committed the dying-gasp dump %s at start-up", outcome.path)
            else:
                log.warning("ttp: dying-gasp dump %s not committed: %s", outcome.path, "; ".join(outcome.reasons))


def unsupported(parsed: Any) -> str:
    """Why a survivor cannot write what a save would (empty when it can)."""
    form = getattr(parsed, "ckpt_format", "torch")
    if form not in RESUMES_TORCH_FORMAT and not getattr(parsed, "auto_detect_ckpt_format", False):
        return (f"--ckpt-format {form}: the dump is written in the torch format, which a job loads with "
                f"--ckpt-format {' or '.join(RESUMES_TORCH_FORMAT)}, or with --auto-detect-ckpt-format")
    if getattr(parsed, "data_parallel_random_init", False):
        return "--data-parallel-random-init: a save gathers every data-parallel rank's RNG state"
    return ""


def distributed_optimizer() -> bool:
    return bool(getattr(megatron_args(), "use_distributed_optimizer", False))


def instance_state(optimizer: Any, iteration: int) -> Any:
    """The distributed optimizer's parameter state as ``save_parameter_state`` saves it, gathered inside this
    rank's optimizer instance only (its gloo group, never a lost rank's): on a rank that saves it, None on the
    others. A chained optimizer (MoE: the dense and the experts' parts, each sharded over its own group) is
    saved, as Megatron saves it, as a list with one slot per part, filled on the part's first rank: the first
    rank of an expert group writes its shard's file with the dense slot empty. Every member must call it; they
    first exchange ``iteration`` (-1: this rank has nothing to dump) and raise unless all agree, so an instance
    never mixes steps. A lost member makes it raise. Where ``recover`` tends the groups (it may shut them down
    under the dump), the instance gathers in real groups of the same members, met for it (:func:`real_twins`).
    The members' model weights are gathered too (:func:`gather_parameters`), so the model file holds the step the
    optimizer state does."""
    import torch
    import torch.distributed as dist

    sharded = sharded_optimizers(optimizer)
    held = [member.data_parallel_group_gloo for member in sharded]
    # met per restart attempt, not per step: a torn member offers -1 and must meet the others to say so (one dump
    # ends the processes of an attempt)
    with real_twins(held, f"ft_plugins/dump/{os.environ.get(RESTART_VAR, '0')}") as groups:
        group = groups[0]
        mine = torch.tensor([iteration], dtype=torch.int64)
        found = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(found, mine, group=group)
        steps = [int(value) for value in found]
        members = dist.get_process_group_ranks(group)
        if iteration < 0 or len(set(steps)) != 1:
            raise RuntimeError(f"the members {members} of this optimizer instance stand at steps {steps}")
        for member, real in zip(sharded, groups):
            gather_parameters(member, real)
        try:
            for member, real in zip(sharded, groups):
                member.data_parallel_group_gloo = real
            states = [member.get_parameter_state_dp_zero() for member in sharded]
            # megatron-core 0.8 and 0.12 return a state on every rank, hollow but on the group's first (newer
            # releases return None there): only the first holds the instance's state
            states = [state if dist.get_rank(real) == 0 else None for state, real in zip(states, groups)]
        finally:
            for member, group_held in zip(sharded, held):
                member.data_parallel_group_gloo = group_held
    if len(getattr(optimizer, "chained_optimizers", None) or [optimizer]) == 1:
        return states[0]
    return states if any(state is not None for state in states) else None


def gather_parameters(optimizer: Any, group: Any) -> None:
    """Every shard of the model weights ``optimizer`` shards, from the rank that updates it, in ``group`` (its
    instance's gloo group). A rank's update writes only its own shard; the others arrive by Megatron's parameter
    all-gather after the update, and with ``--overlap-param-gather`` bucket by bucket inside the next step's
    forward, which a frozen rank never runs: the weights as they stand mix two steps. Megatron's own all-gather
    runs in another group, which the main thread may still be using; each rank's shard of a bucket is the same
    slice that one sends."""
    import torch.distributed as dist

    size, rank = group.size(), group.rank()
    for buffer in optimizer.buffers:
        for bucket in buffer.buckets:
            if bucket.param_data is None:
                continue
            shards = list(bucket.param_data.view(size, -1).unbind(0))
            dist.all_gather(shards, shards[rank].clone(), group=group)


def _shards(checkpointing: Any, save_dir: str, iteration: int) -> tuple[str, tuple[str, ...]]:
    """This rank's shard directory and every shard of the run, named by Megatron's ``get_checkpoint_name``."""
    mpu = megatron("core.parallel_state")

    def name(**ranks: int) -> str:
        path = checkpointing.get_checkpoint_name(save_dir, iteration, **ranks)
        return os.path.basename(os.path.dirname(path))

    shards = tuple(name(tensor_rank=t, pipeline_rank=p, expert_rank=e)
                   for t in range(mpu.get_tensor_model_parallel_world_size())
                   for p in range(mpu.get_pipeline_model_parallel_world_size())
                   for e in range(mpu.get_expert_model_parallel_world_size()))
    return name(), shards
