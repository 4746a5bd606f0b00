"""What every MindSpore callback of ft_plugins shares: the rank, the runtime, the run's checkpoint callback."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Mapping

from ft_plugins.rank import global_rank
from ft_plugins.runtime import Runtime, activate

__all__ = ["FRAMEWORK", "before_step_ends", "checkpoint_callback", "global_rank", "on_instance", "runtime_for",
           "save_root"]

FRAMEWORK = "ms"
STEP_END = "on_train_step_end"

log = logging.getLogger("ft_plugins.mindspore")


def runtime_for(feature: str, runtime: Runtime | None, options: Mapping[str, Any]) -> Runtime:
    """The given runtime, or one activated for this feature alone (a single-feature callback used by itself)."""
    if runtime is not None:
        return runtime
    return activate(FRAMEWORK, features=feature, options={feature: dict(options)} if options else None)


def checkpoint_callback(cb_params: Any) -> Any:
    """The run's ``ModelCheckpoint`` (MindFormers' ``CheckpointMonitor`` is one): where checkpoints go."""
    from mindspore.train.callback import ModelCheckpoint

    return next((cb for cb in cb_params.list_callback if isinstance(cb, ModelCheckpoint)), None)


def save_root(directory: str) -> str:
    """The save directory holding every rank's checkpoints: MindFormers' CheckpointMonitor writes into ``rank_N``."""
    path = os.path.normpath(directory)
    return os.path.dirname(path) if re.fullmatch(r"rank_\d+", os.path.basename(path)) else path


def before_step_ends(cb_params: Any, hook: Callable[[Any], None]) -> Callable[[], None]:
    """Run ``hook(cb_params)`` at every train step end before any callback's own step end; returns the undo.

    ``Model.train`` calls the step ends in list order once the train network returned (the update done), its
    own callbacks (step sync, profiler) first: a callback listed before ours (a logger, a ModelCheckpoint
    saving) may run for seconds before our step end. So the run's first callback is wrapped, on its instance,
    never its class. The undo takes the wrapper off unless something replaced it since. A hook that raises
    is logged and taken off: nothing reaches training.
    """
    callbacks = cb_params.get("list_callback") or []
    if not callbacks:
        return lambda: None
    first = callbacks[0]
    step_end = getattr(first, STEP_END)
    name = getattr(hook, "__qualname__", repr(hook))
    undo: list[Callable[[], None]] = []

    def hooked(run_context: Any) -> None:
        try:
            hook(run_context.original_args())
        except Exception as exc:  # never into training; the callback's own step end still runs
            log.warning("%s before the step ends failed, taken off: %s: %s", name, type(exc).__name__, exc)
            undo[0]()
        step_end(run_context)

    try:
        undo.append(on_instance(first, STEP_END, hooked))
    except (AttributeError, TypeError) as exc:  # a callback with __slots__
        log.info("%s cannot run before the step ends (%s): it runs at ft_plugins' own step end", name, exc)
        return lambda: None
    return undo[0]


def on_instance(target: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Make ``replacement`` ``target``'s own attribute ``name`` (its class untouched); returns the undo, which puts
    back what was there unless something replaced it since."""
    own = vars(target).get(name) if hasattr(target, "__dict__") else None
    setattr(target, name, replacement)

    def undo() -> None:
        if vars(target).get(name) is replacement:
            if own is None:
                del vars(target)[name]
            else:
                setattr(target, name, own)

    return undo
