"""Megatron glue for ``ttp``'s two engines: the survivors save the last completed step in Megatron's own
layout, and the dump is committed (:mod:`ft_plugins.checkpoint.dump`). The built-in engine dumps on a
fatal error or SIGTERM; the MindIO engine (:class:`MindioEngine`) dumps when MindIO's controller asks.

What it hooks, and why:
- ``train_step``: the iteration starting (K completed steps), the objects a save needs, the RNG
  state at the step boundary; a fatal exception inside the step dumps, then exits with code 1.
- the optimizer's own update (``step_with_ready_grads`` of the fp32 / mixed-precision / chained
  optimizers: no collective for the non-distributed optimizer, unlike the grad-norm all-reduce in
  ``step``): a rank inside it is never dumped half-updated; the dump waits until the update ends.
- ``save_checkpoint``: a step already saved is not dumped again; ``load_checkpoint``: dumps left
  complete but uncommitted are committed at start-up, before anybody reads the tracker.
- SIGTERM: a watcher thread woken through ``signal.set_wakeup_fd`` (a Python handler alone runs only
  once a blocked gloo collective returns). The previous handler (Megatron's ``--exit-signal-handler``)
  still runs. After a dump: flush, fsync, ``os._exit`` (exiting through the interpreter without
  ``destroy_process_group`` sometimes aborts).

The dump uses no collective with the non-distributed optimizer: one writer per shard is chosen by
``store.add`` on torchrun's store (which outlives every worker), and the state written is what
Megatron's ``save_checkpoint`` at K would write (``generate_state_dict``, its file naming, consumed
samples and scheduler as at K). With the distributed optimizer the members of each optimizer
instance first agree on K and gather the instance's state inside the instance's own gloo group
(Megatron's ``get_parameter_state_dp_zero``); an instance that lost a member fails there and writes
nothing, a complete one writes ``distrib_optim.pt`` beside the model file (replicas: see
``FT_PLUGINS_TTP_REPLICAS``).
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ft_plugins.checkpoint.dump import Part, commit_dump, complete_pending, tracker_iteration, write_part
from ft_plugins.faults import RESTART_VAR
from ft_plugins.features.ttp import Ttp
from ft_plugins.logs import exit_now
from ft_plugins.vendors.mindio import TorchProcess

log = logging.getLogger("ft_plugins.ttp")

FILENAME = "model_optim_rng.pt"
OPTIMIZER_FILENAME = "distrib_optim.pt"  # the distributed optimizer's parameter state, beside FILENAME
EXIT_ON_ERROR, EXIT_ON_SIGTERM = 1, 128 + signal.SIGTERM
UPDATE_WAIT = 10.0  # seconds a dump waits for a rank past its update to finish the step (or to fail)

# where the training step stands, for the dump
IDLE, FORWARD, UPDATE, UPDATED = "idle", "forward", "update", "updated"


def _megatron(name: str) -> Any:
    return sys.modules[f"megatron.{name}"]


@dataclass
class _Step:
    """The objects of the running step and the counters of the last completed one."""

    model: Any
    optimizer: Any
    scheduler: Any
    completed: int  # steps completed before this one
    consumed: int  # samples consumed by those
    increment: int  # samples one step consumes
    scheduler_steps: int  # the scheduler's count when the step began
    rng: Any  # Megatron's rng_state list at the step boundary


class BuiltinEngine:
    """The wrappers (wrapt signature) that track the step, and the dump itself."""

    def __init__(self, feature: Ttp) -> None:
        self.feature = feature
        self._cond = threading.Condition()
        self._phase = IDLE
        self._depth = 0  # nested optimizer updates in progress
        self._torn = False  # an update raised: this rank's state may be half-updated
        self._update_ok = True
        self._step: _Step | None = None
        self._dumping = False
        self._main_parked = False
        self._watching = False
        self._saved: set[int] = set()
        self._loaded = (0, 0.0)  # (iteration, floating point operations) the run started from
        self._refusal: str | None = None

    # -- hooks -------------------------------------------------------------------------------------
    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        from ft_plugins.torch.megatron import _current_iteration

        if self._refused():
            return wrapped(*args, **kwargs)
        iteration = _current_iteration(args, kwargs)
        self._step_begins()
        with self._cond:
            self._park_if_dumping()
            self._step = self._begin(args, kwargs, iteration)
            self._phase, self._torn, self._update_ok = FORWARD, False, True
        try:
            result = wrapped(*args, **kwargs)
        except Exception as exc:
            self._step_failed(f"{type(exc).__name__} in step {iteration + 1}", exc)
            raise
        with self._cond:
            step = self._step
            step.completed, step.consumed, step.rng = iteration + 1, step.consumed + step.increment, None
            self._phase = IDLE
            self._cond.notify_all()
            self._park_if_dumping()
        self._step_completed(iteration + 1)
        return result

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        with self._cond:
            self._park_if_dumping()
            self._depth += 1
            self._phase = UPDATE
        try:
            ok = wrapped(*args, **kwargs)
        except BaseException:
            with self._cond:
                self._depth -= 1
                self._torn = True
                self._cond.notify_all()
            raise
        with self._cond:
            self._depth -= 1
            self._update_ok = self._update_ok and bool(ok)
            if self._depth == 0:
                self._phase = UPDATED
            self._cond.notify_all()
        return ok

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = kwargs.get("iteration", args[0] if args else None)
        result = wrapped(*args, **kwargs)
        if isinstance(iteration, int) and not kwargs.get("non_persistent_ckpt"):
            self._saved.add(iteration)
        return result

    def load_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        import torch.distributed as dist

        megatron_args = _megatron("training.global_vars").get_args()
        load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
        load_dir = getattr(megatron_args, load_arg, None)
        initialized = dist.is_available() and dist.is_initialized()
        if load_dir and (not initialized or dist.get_rank() == 0):
            self._complete(load_dir)
        if load_dir and initialized:
            dist.barrier()  # nobody reads the tracker before the commit is done
        result = wrapped(*args, **kwargs)
        if isinstance(result, tuple) and len(result) > 1:
            self._loaded = (result[0], result[1])
        return result

    # -- what the engines do differently -----------------------------------------------------------
    def _step_begins(self) -> None:
        self._watch_sigterm()

    def _step_failed(self, reason: str, error: Exception) -> None:
        self._dump(reason, EXIT_ON_ERROR, error)

    def _step_completed(self, completed: int) -> None:
        pass

    # -- step tracking -----------------------------------------------------------------------------
    def _refused(self) -> bool:
        """Whether this run is one the dump cannot serve (said once in the log)."""
        if self._refusal is None:
            self._refusal = _unsupported(_megatron("training.global_vars").get_args())
            if self._refusal:
                log.warning("ttp: the %s engine is off for this run: %s", self.feature.engine, self._refusal)
        return bool(self._refusal)

    def _begin(self, args: tuple, kwargs: dict, iteration: int) -> _Step:
        names = ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler")
        given = dict(zip(names, args), **kwargs)
        megatron_args = _megatron("training.global_vars").get_args()
        scheduler = given["opt_param_scheduler"]
        increment = (_megatron("core.parallel_state").get_data_parallel_world_size()
                     * megatron_args.micro_batch_size * _megatron("core.num_microbatches_calculator").get_num_microbatches())
        rng = _megatron("training.checkpointing").get_rng_state("torch", None, None)
        return _Step(given["model"], given["optimizer"], scheduler, iteration, megatron_args.consumed_train_samples,
                     increment, getattr(scheduler, "num_steps", 0), rng)

    def _park_if_dumping(self) -> None:
        """Called with the lock held: once a dump started, the main thread changes no state any more."""
        if not self._dumping:
            return
        self._main_parked = True
        self._cond.notify_all()
        while True:
            self._cond.wait()

    # -- SIGTERM -----------------------------------------------------------------------------------
    def _watch_sigterm(self) -> None:
        """Once, from the main thread: a watcher thread woken by SIGTERM, whatever the main thread does."""
        if self._watching or threading.current_thread() is not threading.main_thread():
            return
        self._watching = True
        reader, writer = os.pipe()
        os.set_blocking(writer, False)
        previous = signal.getsignal(signal.SIGTERM)

        def chained(signum: int, frame: Any) -> None:  # runs late in the main thread; the watcher acts
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, chained)
        signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(reader,), name="ft_plugins-ttp-sigterm", daemon=True).start()

    def _watch(self, reader: int) -> None:
        while True:
            received = os.read(reader, 64)
            if signal.SIGTERM in received:
                self._dump("SIGTERM", EXIT_ON_SIGTERM)

    # -- the dump ----------------------------------------------------------------------------------
    def _dump(self, reason: str, code: int, error: BaseException | None = None) -> None:
        """Save the last completed step once (further callers wait for the first), then exit with ``code``."""
        started = time.monotonic()
        main = threading.current_thread() is threading.main_thread()
        with self._cond:
            if self._dumping:
                if main:
                    self._park_if_dumping()
                return
            snapshot = self._freeze(main, started)
        if error is not None:
            log.error("ttp: %s", "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        self._save(reason, started, snapshot, commit=True)
        exit_now(code)

    def _freeze(self, main: bool, started: float) -> tuple[_Step, int, Any, int] | None:
        """Called with the lock held: from now on the main thread changes no state; the last completed step."""
        self._dumping = True
        self._main_parked = self._main_parked or main
        while self._depth:  # an update in progress ends soon: it has no collective
            self._cond.wait()
        deadline = started + UPDATE_WAIT
        while self._phase == UPDATED and not self._main_parked and time.monotonic() < deadline:
            self._cond.wait(deadline - time.monotonic())
        return self._snapshot()

    def _save(self, reason: str, started: float, snapshot: tuple[_Step, int, Any, int] | None, commit: bool) -> None:
        try:
            if snapshot is None:
                log.warning("ttp: %s: nothing to dump (%s)", reason,
                            "this rank was caught inside an update" if self._torn else "no step began")
                if self._step is not None and _distributed_optimizer():
                    _instance_state(self._step.optimizer, -1)  # the instance's others learn it and write nothing
            else:
                self._write(reason, started, *snapshot, commit=commit)
        except Exception as exc:  # never a half-committed dump: the commit checks every part
            log.error("ttp: dump failed: %s: %s", type(exc).__name__, exc)

    def _snapshot(self) -> tuple[_Step, int, Any, int] | None:
        """(step, K, rng_state, consumed samples) as a save at the last completed step K would hold them."""
        step = self._step
        if step is None or self._torn:
            return None
        if self._phase == FORWARD:
            return step, step.completed, step.rng, step.consumed
        rng = _megatron("training.checkpointing").get_rng_state("torch", None, None)
        if self._phase == UPDATED:  # the update is done; finish the step's bookkeeping as train_step would
            if self._update_ok and getattr(step.scheduler, "num_steps", None) == step.scheduler_steps:
                step.scheduler.step(increment=step.increment)
            return step, step.completed + 1, rng, step.consumed + step.increment
        return step, step.completed, rng, step.consumed

    def _save_dir(self) -> str:
        return self.feature.settings["save_dir"] or _megatron("training.global_vars").get_args().save

    def _write(self, reason: str, started: float, step: _Step, iteration: int, rng: Any, consumed: int,
               commit: bool) -> None:
        import torch
        import torch.distributed as dist

        checkpointing = _megatron("training.checkpointing")
        megatron_args = _megatron("training.global_vars").get_args()
        save_dir = self._save_dir()
        if not save_dir:
            log.warning("ttp: %s: no --save directory and FT_PLUGINS_TTP_SAVE_DIR unset; nothing dumped", reason)
            return
        if iteration in self._saved or (tracker_iteration(save_dir) or -1) >= iteration:
            log.warning("ttp: %s: iteration %d is saved already; nothing to dump", reason, iteration)
            return
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        shard, shards = _shards(checkpointing, save_dir, iteration)
        writes: dict[str, Callable[[str], None]] = {}
        if megatron_args.use_distributed_optimizer:
            try:
                optimizer_state = _instance_state(step.optimizer, iteration)
            except Exception as exc:
                log.warning("ttp: %s: rank %d writes nothing: its optimizer instance cannot gather its state (%s: %s)",
                            reason, rank, type(exc).__name__, exc)
                return
            if optimizer_state is None:
                return  # the instance's first rank writes
            writes[OPTIMIZER_FILENAME] = lambda path: torch.save(optimizer_state, path)
        if not _claim(f"ft_plugins/ttp/{os.environ.get(RESTART_VAR, '0')}/{iteration}/{shard}"):
            log.warning("ttp: %s: another survivor writes %s of iteration %d", reason, shard, iteration)
            return
        state_args = copy.copy(megatron_args)
        state_args.consumed_train_samples = consumed
        model = _megatron("training.utils").unwrap_model(step.model)
        state = checkpointing.generate_state_dict(state_args, model, step.optimizer, step.scheduler, rng,
                                                  iteration=iteration)
        state["num_floating_point_operations_so_far"] = self._flops(iteration, megatron_args)
        writes[FILENAME] = lambda path: torch.save(state, path)
        write_part(save_dir, Part(shard, iteration, shards, rank), writes)
        written = time.monotonic()
        status = self._commit(save_dir, iteration) if commit else "committed on MindIO's rename"
        log.warning("ttp: %s: rank %d dumped %s of iteration %d in %.0f ms; %s", reason, rank, shard,
                    iteration, (written - started) * 1000, status)

    def _commit(self, save_dir: str, iteration: int) -> str:
        outcome = commit_dump(save_dir, iteration)
        self.feature.saves.append(outcome.path)
        status = "committed" if outcome.committed else f"not committed yet ({'; '.join(outcome.reasons)})"
        return f"{status}: {outcome.path}"

    def _flops(self, iteration: int, megatron_args: Any) -> float:
        """What ``train()`` counts as ``num_floating_point_operations_so_far`` at ``iteration``."""
        loaded, flops = self._loaded
        per_step = _megatron("training.training").num_floating_point_operations(
            megatron_args, megatron_args.global_batch_size)
        return flops + (iteration - loaded) * per_step

    def _complete(self, save_dir: str) -> None:
        for outcome in complete_pending(save_dir):
            if outcome.committed:
                log.warning("ttp: committed the dying-gasp dump %s at start-up", outcome.path)
            else:
                log.warning("ttp: dying-gasp dump %s not committed: %s", outcome.path, "; ".join(outcome.reasons))


class MindioEngine(BuiltinEngine):
    """MindIO TTP drives the dump (MindSpeed-LLM's wiring, done from the outside): the same step tracking,
    update bracketing and writer; MindIO's save handler writes the dump and its rename handler commits it.

    Extra hooks: ``_initialize_distributed`` (controller and processor start before ``init_process_group``)
    and ``train`` (replicas, data-parallel group and handlers reported, then run under MindIO's exception
    handler). No SIGTERM watcher: MindIO's save handler registration makes SIGTERM and SIGINT do nothing.
    """

    def __init__(self, feature: Ttp) -> None:
        super().__init__(feature)
        self.process: TorchProcess | None = None

    def initialize_distributed(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        from ft_plugins.vendors.mindio import load_framework_api

        try:
            process = TorchProcess(load_framework_api(), self.feature.where)  # imports torch_npu: only now
            process.start(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), os.environ)
            self.process = process
        except Exception as exc:  # never into training: the run goes on without dying-gasp saves
            log.warning("ttp: the mindio engine is off for this run: %s: %s", type(exc).__name__, exc)
        return wrapped(*args, **kwargs)

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.process is None or self._refused():
            return wrapped(*args, **kwargs)
        import torch.distributed as dist

        from ft_plugins.replicas import ReplicaLayout

        dp_ranks = dist.get_process_group_ranks(_megatron("core.parallel_state").get_data_parallel_group())
        megatron_args = _megatron("training.global_vars").get_args()
        # the distributed optimizer holds each shard once per instance; the non-distributed one, on every rank
        replicas = (megatron_args.num_distributed_optimizer_instances if megatron_args.use_distributed_optimizer
                    else len(dp_ranks))
        layout = ReplicaLayout.build(dp_ranks, replicas)
        handlers = {"save_ckpt": self.save, "rename": self.rename, "exit": self.exit}
        handlers.update({kind: _declined(kind) for kind in ("stop", "clean", "repair", "rollback", "rebuild_group")})
        handlers["stream_sync"] = _synchronize
        try:
            self.process.wire(dist.get_rank(), layout.mindio_replica_info(), list(dp_ranks), handlers)
            guarded = self.process.guarded(wrapped)
        except Exception as exc:  # e.g. a MindIO without one of these calls: train on, without it
            log.warning("ttp: the mindio engine is off for this run: %s: %s", type(exc).__name__, exc)
            self.process = None
            return wrapped(*args, **kwargs)
        return guarded(*args, **kwargs)

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The optimizer's own update reported to MindIO as the step it completes (``tft_start_updating_os``
        raises once a dump has started: the update never begins under a dump)."""
        if self.process is None or self._depth or self._step is None:
            return super().update(wrapped, instance, args, kwargs)
        self.process.start_update()
        ok = super().update(wrapped, instance, args, kwargs)
        self.process.end_update(self._step.completed + 1)
        return ok

    # -- MindIO's handlers -------------------------------------------------------------------------
    def save(self, step: int, save_info: Any, args: Any, ctx: Any) -> None:
        """Write this rank's part of the dump of ``step`` (MindIO calls this in a thread of its own)."""
        started = time.monotonic()
        with self._cond:
            snapshot = self._freeze(threading.current_thread() is threading.main_thread(), started)
        if snapshot is not None and snapshot[1] != step:
            log.warning("ttp: MindIO asks for step %d, the last completed step here is %d", step, snapshot[1])
        self._save(f"MindIO dump of step {step}", started, snapshot, commit=False)

    def rename(self, step: int, args: Any) -> None:
        """Commit the dump of ``step`` (idempotent: any survivor, or the next start-up, may complete it)."""
        log.warning("ttp: MindIO rename of step %d: %s", step, self._commit(self._save_dir(), step))

    def exit(self, *args: Any) -> None:
        exit_now(EXIT_ON_ERROR)

    # -- what differs from the built-in engine -----------------------------------------------------
    def _step_begins(self) -> None:
        pass

    def _step_failed(self, reason: str, error: Exception) -> None:
        """MindIO's exception handler takes the error to the controller; the main thread changes nothing more."""
        with self._cond:
            self._main_parked = True
            self._cond.notify_all()

    def _step_completed(self, completed: int) -> None:
        if self.process is not None:
            self.process.pause(completed)


def _declined(kind: str) -> Callable[..., None]:
    """Handlers for what the dump-only engine does not do (repair in place, rollback, rebuild): MindIO
    falls back to the dump when they raise; stop and clean have nothing to undo here."""
    def handler(*args: Any) -> None:
        if kind in ("stop", "clean"):
            log.info("ttp: MindIO %s: nothing to do (the main thread changes no state once a dump starts)", kind)
            return
        raise RuntimeError(f"MindIO {kind} is not supported by ft_plugins' dump-only engine")

    handler.__name__ = f"ft_plugins_{kind}"
    return handler


def _synchronize(*args: Any) -> None:
    import torch

    device = getattr(torch, "npu", None) or torch.cuda  # torch_npu adds torch.npu
    if device.is_available():
        device.synchronize()


def _unsupported(megatron_args: Any) -> str:
    """Why a survivor cannot write what a save would (empty when it can)."""
    if getattr(megatron_args, "ckpt_format", "torch") != "torch":
        return f"--ckpt-format {megatron_args.ckpt_format}: the dump writes the torch format (use --ckpt-format torch)"
    if getattr(megatron_args, "data_parallel_random_init", False):
        return "--data-parallel-random-init: a save gathers every data-parallel rank's RNG state"
    return ""


def _distributed_optimizer() -> bool:
    return bool(getattr(_megatron("training.global_vars").get_args(), "use_distributed_optimizer", False))


def _instance_state(optimizer: Any, iteration: int) -> Any:
    """The distributed optimizer's parameter state as ``save_parameter_state`` saves it, gathered inside this
    rank's optimizer instance only (its gloo group, never a lost rank's): on the instance's first rank, None
    on the others. Every member must call it; they first exchange ``iteration`` (-1: this rank has nothing
    to dump) and raise unless all agree, so an instance never mixes steps. A lost member makes it raise."""
    import torch
    import torch.distributed as dist

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    sharded = [member for member in chained if hasattr(member, "get_parameter_state_dp_zero")]
    group = sharded[0].data_parallel_group_gloo
    mine = torch.tensor([iteration], dtype=torch.int64)
    found = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(found, mine, group=group)
    steps = [int(value) for value in found]
    members = dist.get_process_group_ranks(group)
    if iteration < 0 or len(set(steps)) != 1:
        raise RuntimeError(f"the members {members} of this optimizer instance stand at steps {steps}")
    states = [member.get_parameter_state_dp_zero() for member in sharded]
    if sharded[0].data_parallel_group.rank() != 0:
        return None
    return states[0] if len(chained) == 1 else states


def _shards(checkpointing: Any, save_dir: str, iteration: int) -> tuple[str, tuple[str, ...]]:
    """This rank's shard directory and every shard of the run, named by Megatron's ``get_checkpoint_name``."""
    mpu = _megatron("core.parallel_state")

    def name(**ranks: int) -> str:
        path = checkpointing.get_checkpoint_name(save_dir, iteration, **ranks)
        return os.path.basename(os.path.dirname(path))

    shards = tuple(name(tensor_rank=t, pipeline_rank=p, expert_rank=e)
                   for t in range(mpu.get_tensor_model_parallel_world_size())
                   for p in range(mpu.get_pipeline_model_parallel_world_size())
                   for e in range(mpu.get_expert_model_parallel_world_size()))
    return name(), shards


def _claim(key: str) -> bool:
    """Whether this rank writes the shard: the first ``store.add`` on torchrun's store wins. Without a
    reachable store every survivor writes (each renames a whole file, so that is only wasted work)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store().add(key, 1) == 1
    except Exception as exc:
        log.info("ttp: writer claim unavailable (%s: %s); writing anyway", type(exc).__name__, exc)
        return True
