"""Megatron's training loop as ``recover`` meets it: a part of the loop attempted (a failure reduced to a
description), a step a peer completed, the loop's timers for a part run again, and the save of step K
that a lost rank interrupted.

A periodic save: Megatron's ``save_checkpoint_and_time`` (the training loop's save of step K) has collectives (barriers
before and after, inside ``save_checkpoint``), so a rank lost in it makes the survivors fail there,
each holding exactly the state of K (a save changes none), and the save on disk incomplete: the
lost rank may have been the writer of a shard, and the tracker is written last. After the repair
every rank calls the same ``save_checkpoint_and_time(K, ...)`` from its top, so that their
collectives meet in the same order: the survivors run it again where they failed, the replacement
(which joins at the start of step K + 1, the point the loop reaches right after that save) runs it
before its first step. Files the first attempt left are overwritten; the tracker names K once the
save completed, as in the uninterrupted run.
"""

from __future__ import annotations

import gc
import os
import traceback
from typing import Any, Callable

from ft_plugins.torch.megatron.state import megatron, optional_megatron, signature

TIMERS = ("save-checkpoint", "save-checkpoint-non-persistent")


def iteration_of(args: tuple, kwargs: dict) -> int:
    """``save_checkpoint_and_time``'s iteration argument."""
    return kwargs["iteration"] if "iteration" in kwargs else args[0]


def timers_as_before() -> None:
    """Megatron's timers as an interrupted part of the loop found them: the training interval running, the
    save's timers stopped (``save_checkpoint_and_time`` stops the one and starts the other, asserting both;
    the logging stops and starts the interval with a barrier each)."""
    timers = megatron("training.global_vars").get_timers()
    for name in TIMERS:
        timers(name, log_level=0).reset()
    interval = timers("interval-time", log_level=0)
    interval.reset()
    interval.start()


def save_as_the_loop(iteration: int, objects: tuple[Any, Any, Any], context: Any, iterator: Any) -> None:
    """The replacement's part of the save of ``iteration`` the survivors run again: the loop's own call."""
    model, optimizer, scheduler = objects
    flops = megatron("training.global_vars").get_args().num_floating_point_operations_so_far
    save = megatron("training.training").save_checkpoint_and_time
    given = {"train_data_iterator": iterator} if "train_data_iterator" in signature(save).parameters else {}
    save(iteration, model, optimizer, scheduler, flops, context, **given)  # no iterator in megatron-core 0.8


# what a communication backend says when a peer's connection broke (gloo, NCCL, HCCL): raised from C++
# through whichever Python line waited on the work, megatron's own (an overlapped gradient reduction) included
BACKEND_MARKERS = ("gloo", "nccl", "hccl", "connection reset by peer", "connection closed by peer", "broken pipe")
COMMUNICATION = f"{os.sep}torch{os.sep}distributed{os.sep}"


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing (a peer lost), not this rank's own error: raised inside torch's
    distributed package, a ``DistError``, or a backend's connection error. Megatron's own checks raised under
    ``megatron/core/distributed/`` (the NaN/Inf gradient check, its assertions) are this rank's own."""
    innermost = next(iter(reversed(list(traceback.walk_tb(exc.__traceback__)))), None)
    if innermost is not None and COMMUNICATION in innermost[0].f_code.co_filename:
        return True
    if any(cls.__name__ == "DistError" and cls.__module__.startswith("torch") for cls in type(exc).__mro__):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in BACKEND_MARKERS)


def attempt(wrapped: Callable[..., Any], args: tuple, kwargs: dict,
            lost: Callable[[], None]) -> tuple[Any, str | None, bool]:
    """Run the step; on failure return only a description and whether the exception is this rank's own
    (:func:`is_communication_failure` says it is not): the exception, its traceback and the frames' pending
    work are released before anybody waits. A peer lost (not our own exception): ``lost()`` first, at once
    (shutting this rank's connections down, so that peers whose collectives never reach the lost rank fail
    now, not after the collection: 0.4 s with megatron imported). The collection is of the young generations,
    where the failed step's cycles are (~1 ms; what an older one still holds of the dead groups is collected
    when they are destroyed: :mod:`.regroup`)."""
    try:
        return wrapped(*args, **kwargs), None, False
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        own = not is_communication_failure(exc)
        traceback.clear_frames(exc.__traceback__)
        if not own:
            lost()
    gc.collect(1)
    return None, reason, own


def forget_pending_communication(model: list[Any]) -> None:
    """Drop the handles megatron's DDP keeps of collectives a lost peer broke (what MindSpeed's clean handler
    does): ``grad_reduce_handle`` stays set until ``wait()`` returns, so with ``--overlap-grad-reduce`` the
    redone step's ``start_grad_sync`` asserted there was none; a kept handle also keeps the dead group's work
    alive. A parameter all-gather dispatched into the dead group is marked undispatched, to run again."""
    for chunk in model:
        for group in (*getattr(chunk, "bucket_groups", ()), *getattr(chunk, "expert_parallel_bucket_groups", ())):
            group.grad_reduce_handle = None
            if getattr(group, "param_gather_handle", None) is not None:
                group.param_gather_handle = None
                group.param_gather_dispatched = False


def done_by_peer(size: int) -> tuple:
    """``train_step``'s result (``size`` items) for a step a peer completed: nothing to log, no save or exit asked."""
    if size == 4:  # megatron-core up to 0.9: loss_dict, skipped_iter, grad_norm, num_zeros_in_grad
        return {}, 0, None, None
    return ({}, 0, False, False, 0, None, None, 0, *([None] * 8))[:size]


def rerun_anew() -> None:
    """Megatron's rerun state machine saw the failed attempt begin: the step starts over for it too."""
    rerun = optional_megatron("core.rerun_state_machine")  # since megatron-core 0.10
    if rerun is None:
        return
    machine = rerun.get_rerun_state_machine()
    if machine.state != rerun.RerunState.NOT_RUNNING_YET:
        machine.state = rerun.RerunState.NOT_RUNNING_YET
        machine.current_iteration -= 1


def replaced(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> tuple[tuple, dict]:
    if name in kwargs:
        return args, {**kwargs, name: value}
    return (*args[:index], value, *args[index + 1:]), kwargs
