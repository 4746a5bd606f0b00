"""MindIO's process-level online recovery (MindCluster's ``recover`` strategy, MindIO "ARF") for Megatron
through ``import ft_plugins.torch``, outside MindSpeed-LLM: the handlers MindIO's controller calls when a
rank is lost, made of the built-in recovery's pieces (:mod:`.regroup`, :mod:`.handover`).

MindIO owns the control loop: its exception handler around ``train`` reports the failure, waits while
the controller calls the handlers, then calls ``train`` again on the same objects. In its order:

- ``stop`` (survivors): the NPU stopped (torch_npu, where it exists) and this process's gloo connections
  shut down, so a collective still pending with the lost rank fails in the training thread now;
- ``clean`` (survivors): the NPU restarted, where this rank stands noted (the state a save at its last
  completed step would hold), every group destroyed with a time bound, the layout held on the fake backend;
- ``rebuild_group`` (every rank, the replacement included): the groups built again exactly as Megatron
  built them, on a store prefix all ranks count alike, every reference re-pointed;
- ``repair`` (the source and each rank lacking the state): the state a save at step K holds, sent by the
  source over the data-parallel group;
- ``rollback`` (every rank): counters, RNG and data at exactly K; training continues at K + 1.

MindIO's replacement for the lost rank (its "reboot node") holds its collectives (fake backend) while it
starts, reads no checkpoint (``--load`` ignored) and raises ``ARF FINISH`` at ``train`` to join the repair.
A handler called out of order, or for a layout it cannot repair, answers MindIO's failure code and says
why in one line; MindIO then falls back to its dump, which the handlers left intact.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ft_plugins import progress
from ft_plugins.features.recover import Recover
from ft_plugins.patching import Patch
from ft_plugins.rank import global_rank, is_rank_zero
from ft_plugins.recovery import key, mark_trained, worker_namespace
from ft_plugins.torch.megatron import loop
from ft_plugins.torch.megatron.handover import (Batches, Chunks, apply, kept, receive, send, set_rng, state_at,
                                                unreplicated, without_load)
from ft_plugins.torch.megatron.regroup import Regroup, megatron_roots, require_successors
from ft_plugins.torch.megatron.state import TRAINING, megatron, megatron_args, optional_megatron
from ft_plugins.vendors import mindio

log = logging.getLogger("ft_plugins.recover")

STAGES = ("stop", "clean", "rebuild_group", "repair", "rollback")
# the stage each handler follows: what MindIO's controller has called on this rank before it. MindIO stops and
# cleans before each dump too (its TTP_STOP_CLEAN_BEFORE_DUMP), whatever stage failed: a stop follows any
AFTER = {"stop": ("", *STAGES), "clean": ("stop",), "rebuild_group": ("clean",), "repair": ("rebuild_group",),
         "rollback": ("rebuild_group", "repair"), "zit_downgrade_rebuild": ("clean",)}
ENDING = ("rollback", "zit_downgrade_rebuild")  # the handlers after which training goes on


class Refused(RuntimeError):
    """A handler cannot do what MindIO asks; the message says why (MindIO answers its failure code)."""


class MindioRecovery:
    """The wrappers (wrapt signature) and MindIO's recovery handlers of one worker."""

    ZIT = False  # MindIO's scale-in and scale-out (ZIT): :class:`.mindio_elastic.MindioElastic`'s

    def __init__(self, feature: Recover, ttp: Any) -> None:
        self.feature = feature
        self.tracker, self.writer = ttp.tracker, ttp.writer  # ttp's, shared
        self.regroup = Regroup()
        self.replacement = False
        self.stage = ""
        self.objects: tuple[Any, Any, Any] | None = None  # model, optimizer, scheduler
        self.batches: Batches | Chunks | None = None
        self.running = 0  # the step that was running when the failure came
        self.mine: tuple[int, Any, int, float] | None = None  # K, rng, consumed, flops; None when torn
        self.received: dict[str, Any] | None = None
        self.store: Any = None
        self.started = 0.0
        self.announced = False

    def patches(self) -> tuple[Patch, ...]:
        return (*self.regroup.patches(),
                Patch(TRAINING, "setup_model_and_optimizer", self.setup_model_and_optimizer),
                Patch(TRAINING, "train", self.train),
                Patch(TRAINING, "train_step", self.train_step))

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """MindIO's recovery handlers, by the kind ``tft_register_<kind>_handler`` takes."""
        return {"stop": self.stop, "clean": self.clean, "rebuild_group": self.rebuild_group, "repair": self.repair,
                "rollback": self.rollback}

    def replacing(self) -> None:
        """MindIO started this process for a lost rank: collectives held until the repair."""
        self.replacement = self.regroup.fake = True

    # -- hooks -------------------------------------------------------------------------------------
    def setup_model_and_optimizer(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """A replacement reads no checkpoint: its state comes from a peer."""
        if not self.replacement:
            return wrapped(*args, **kwargs)
        with without_load(f"MindIO's replacement of rank {global_rank()}"):
            return wrapped(*args, **kwargs)

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Inside MindIO's exception handler, so once per (re)start of ``train``."""
        names = ("forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator")
        given = {**dict(zip(names, args)), **kwargs}
        self.objects = (given["model"], given["optimizer"], given["opt_param_scheduler"])
        iterator = given["train_data_iterator"]
        self.batches, given_iterator = kept(iterator, self.batches)
        if given_iterator is not iterator:
            args, kwargs = loop.replaced(args, kwargs, 4, "train_data_iterator", given_iterator)
        if self.replacement:
            log.warning("recover: rank %s (pid %d) started by MindIO for a lost rank; waiting for its repair",
                        global_rank(), os.getpid())
            self.tracker.mark_torn()  # nothing here is worth a dump until the state came
            raise RuntimeError(mindio.ARF_FINISH)
        if not self.announced and is_rank_zero():
            self.announced = True
            log.warning("recover: MindIO's controller repairs a lost rank in place (stop, clean, rebuild_group, "
                        "repair, rollback handlers); its dump when it cannot")
        result = wrapped(*args, **kwargs)
        mark_trained(self._launcher_store, global_rank() or 0)
        return result

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The step's batches are kept while it runs (a step run again reads them again)."""
        if self.batches is not None:
            self.batches.begin_step()
        result = wrapped(*args, **kwargs)
        if self.batches is not None:
            self.batches.begin_step()  # between steps nothing is kept
        return result

    # -- MindIO's handlers -------------------------------------------------------------------------
    def stop(self, args: Any, ctx: Any) -> None:
        self._guard("stop", self._stop)

    def clean(self, uce_error: bool, args: Any, ctx: Any) -> int:
        """Answers MindIO's code itself (0 done, 1 failed), as MindIO's clean handlers do."""
        try:
            self._enter("clean")
            if uce_error:
                raise Refused("a memory error (UCE) on this device is not repaired in place")
            mindio.restart_device()
            self.running, self.mine = self._standing()
            rank, world = placement()
            from torch.distributed import PrefixStore

            require_successors(self.regroup.hold(rank, world, PrefixStore("mindio-hold/", self._store()),
                                                   megatron_roots(self.objects)), Refused)
        except Exception as exc:
            self._refusal("clean", exc)
            return mindio.RET_ERROR
        self.stage = "clean"
        return mindio.RET_OK

    def rebuild_group(self, fault_ranks: list[int], args: Any, ctx: Any) -> None:
        self._guard("rebuild_group", self._rebuild, fault_ranks)

    def repair(self, step: int, need_rebuild: bool, error_ranks: list[int], repair_info: dict[str, Any],
               args: Any, ctx: Any) -> None:
        self._guard("repair", self._repair, step, repair_info)

    def rollback(self, step: int, args: Any, ctx: Any) -> None:
        self._guard("rollback", self._rollback, step)

    # -- what they do ------------------------------------------------------------------------------
    def _stop(self) -> None:
        self.started = time.monotonic()
        progress.report(progress.RECOVERY)  # the repair's own bound at the launcher (hangs)
        stopped = mindio.stop_device()
        self.regroup.interrupt()
        log.warning("recover: MindIO stop on rank %s (pid %d): %s, its group connections shut down", global_rank(),
                    os.getpid(), "NPU stopped" if stopped else "no NPU")

    def _rebuild(self, fault_ranks: list[int]) -> None:
        from torch.distributed import PrefixStore

        rank, world = placement()
        self.started = self.started if not self.replacement else time.monotonic()
        store = self._store()
        # every rebuild involves every rank, and a replacement carries its rank's count on: all agree
        count = store.add(f"mindio/rebuilds/{rank}", 1)
        require_successors(self.regroup.join(rank, world, PrefixStore(f"mindio/{count}/world/", store),
                                               megatron_roots(self.objects)), Refused)
        if self.replacement or is_rank_zero():
            log.warning("recover: MindIO rebuild_group on rank %d: the groups rebuilt with the replacement of "
                        "rank%s %s", rank, "" if len(fault_ranks) == 1 else "s", ", ".join(map(str, fault_ranks)))

    def _repair(self, step: int, info: dict[str, Any]) -> None:
        import torch.distributed as dist

        refusal = _unsupported(info)
        if refusal:
            raise Refused(refusal)
        rank = dist.get_rank()
        group, members = _data_parallel()
        strangers = sorted((set(info["src"]) | set(info["dst"])) - set(members))
        if strangers:
            raise Refused(f"rank{'s' if len(strangers) > 1 else ''} {', '.join(map(str, strangers))} outside "
                          f"this rank's data-parallel group {members}: no replica of this state there")
        model, optimizer, scheduler = self.objects
        if info["repair_type"] == mindio.repair_type("RT_SEND"):
            if self.mine is None or self.mine[0] != step:
                raise Refused(f"asked to send step {step}, this rank holds {self._held()}")
            completed, rng, consumed, flops = self.mine
            sent = send(state_at(model, optimizer, scheduler, completed, rng, consumed, flops), tuple(info["dst"]),
                        group)
            log.warning("recover: MindIO repair: rank %d sent the state of step %d (%.1f MB) to rank%s %s", rank,
                        step, sent / 1e6, "" if len(info["dst"]) == 1 else "s", ", ".join(map(str, info["dst"])))
            return
        state = receive(info["src"][0], group)
        if state["iteration"] != step:
            raise Refused(f"received step {state['iteration']} from rank {info['src'][0]}, MindIO asked for {step}")
        with self.tracker.holding():
            apply(state, model, optimizer, scheduler)
        self.received = {"consumed": state["args"].consumed_train_samples,
                         "flops": state["num_floating_point_operations_so_far"]}

    def _rollback(self, step: int) -> None:
        """Every rank at exactly ``step``."""
        self._stand_at(step)
        launcher = self._store_generation()
        if launcher:
            self._launcher_store().add(key(launcher, "done"), 1)
        if self.replacement or is_rank_zero():
            self.feature.recoveries.append(f"MindIO step {step}")
            log.warning("recover: MindIO rollback on rank %d in %.2f s: every rank stands at step %d, training "
                        "continues at step %d", global_rank(), time.monotonic() - self.started, step, step + 1)
        self.replacement = self.regroup.fake = False
        self.mine = self.received = None
        progress.report(progress.STEP)

    def _stand_at(self, step: int) -> int:
        """This rank at exactly ``step``: counters, RNG and the data iterator at ``step + 1``'s first batch; the
        samples consumed."""
        parsed = megatron_args()
        per_step = megatron("core.num_microbatches_calculator").get_num_microbatches()
        if self.received is not None:
            consumed, flops = self.received["consumed"], self.received["flops"]  # the RNG came with the state
        elif self.mine is not None and self.mine[0] == step:
            _, rng, consumed, flops = self.mine
            set_rng(rng)
        else:
            raise Refused(f"to stand at step {step}: this rank holds {self._held()} and received nothing")
        parsed.iteration, parsed.consumed_train_samples = step, consumed
        parsed.num_floating_point_operations_so_far = flops
        if self.replacement:  # its iterator was built from the first sample: its micro-batches of every step done
            self.writer.started_from(consumed, flops)
            self.batches.skip(consumed // (parsed.micro_batch_size
                                           * megatron("core.parallel_state").get_data_parallel_world_size()))
        elif self.running == step + 1:
            self.batches.rewind()  # the step that failed runs again on the batches it read
        else:
            self.batches.finish(per_step)  # the step that failed is done (here or by the source)
        rerun = optional_megatron("core.rerun_state_machine")  # since megatron-core 0.10
        if rerun is not None:
            rerun.get_rerun_state_machine().state = rerun.RerunState.NOT_RUNNING_YET  # train() sets the iteration
        global_vars = megatron("training.global_vars")  # the failed step left its timers running
        global_vars._GLOBAL_TIMERS = None
        global_vars._set_timers(parsed)
        return consumed

    # -- helpers -----------------------------------------------------------------------------------
    def _enter(self, stage: str) -> None:
        """Refuse a handler MindIO calls out of its order."""
        expected = ("",) if self.replacement and stage == "rebuild_group" else AFTER[stage]
        if self.stage not in expected:
            done = f"after {self.stage}" if self.stage else "before any other handler"
            raise Refused(f"{stage} called {done} (expected after {' or '.join(s or 'start' for s in expected)})")
        if self.objects is None:
            raise Refused(f"{stage} called before train started: nothing to repair yet")

    def _guard(self, stage: str, work: Callable[..., None], *args: Any) -> None:
        """Run one handler; a failure is logged in one line and raised: MindIO answers its failure code."""
        try:
            self._enter(stage)
            work(*args)
        except Exception as exc:
            self._refusal(stage, exc)
            raise Refused(str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}") from None
        self.stage = "" if stage in ENDING else stage

    @staticmethod
    def _refusal(stage: str, exc: Exception) -> None:
        why = str(exc) if isinstance(exc, Refused) else f"{type(exc).__name__}: {exc}"
        log.error("recover: MindIO %s refused on rank %s: %s; MindIO falls back to its dump", stage, global_rank(),
                  why.splitlines()[0] if why else type(exc).__name__)

    def _standing(self) -> tuple[int, tuple[int, Any, int, float] | None]:
        """The step that was running, and (K, RNG, consumed, flops) as a save at K would hold them (None: torn)."""
        with self.tracker.holding():
            frozen = self.tracker.peek()
            if frozen is None or frozen.torn:
                return (frozen.completed + 1 if frozen else 0), None
            _, completed, rng, consumed = self.writer.snapshot(frozen)
        return frozen.completed + 1, (completed, rng, consumed, self.writer.flops(consumed, megatron_args()))

    def _held(self) -> str:
        return "a torn state" if self.mine is None else f"step {self.mine[0]}"

    def _launcher_store(self) -> Any:
        from torch.distributed import PrefixStore

        return PrefixStore(worker_namespace(os.environ), self._store())

    def _store_generation(self) -> int:
        """The generation ``ft-plugins run``'s launcher announced (0 under another launcher)."""
        return int(self._launcher_store().add("generation", 0))

    def _store(self) -> Any:
        """torchrun's agent store: it outlives every worker (a rank 0 worker's store would die with it)."""
        if self.store is None:
            from datetime import timedelta

            from torch.distributed import TCPStore

            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                raise Refused("the workers' store is not torchrun's agent store (it would die with rank 0)")
            self.store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=self.feature.settings["timeout"]))
        return self.store


def placement() -> tuple[int, int]:
    """This rank and the job's size as its groups stand: a scale-in numbered them anew, torchrun's variables not."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return global_rank() or 0, int(os.environ.get("WORLD_SIZE", "1"))


def _unsupported(info: dict[str, Any]) -> str:
    """Why this repair cannot be done here ("" when it can)."""
    if why := unreplicated(megatron_args()):
        return why
    if any(kind != mindio.optimizer_type("ATTENTION") for kind in info.get("type", [])):
        return "expert (MoE) optimizer state is not repaired in place yet"
    if info.get("repair_type") not in (mindio.repair_type("RT_SEND"), mindio.repair_type("RT_RECV_REPAIR")):
        return f"repair type {info.get('repair_type')!r} (e.g. a checkpoint load) is not done in place"
    return ""


def _data_parallel() -> tuple[Any, list[int]]:
    """The data-parallel group the state travels in (its gloo twin where Megatron made one), and its ranks."""
    import torch.distributed as dist

    mpu = megatron("core.parallel_state")
    group = mpu.get_data_parallel_group_gloo(with_context_parallel=True) or mpu.get_data_parallel_group(
        with_context_parallel=True)
    return group, dist.get_process_group_ranks(group)
