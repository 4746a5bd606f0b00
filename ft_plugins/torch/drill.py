"""Fire drills in Megatron workers: the faults of ``FT_PLUGINS_INJECT_FAULT`` fired where they are named.

``at=forward`` fires as the step starts (before its forward pass), ``at=update`` inside the
optimizer's own update (``step_with_ready_grads``), ``at=save`` as ``save_checkpoint`` of that
iteration begins. Independent of the features: the same drill runs with ``FT_PLUGINS=none``, which
is how a test shows what a fault costs without ft_plugins. Applied before ``ttp``'s hooks, so
``ttp`` has seen the step begin (or the update begin) when a fault fires.
"""

from __future__ import annotations

from typing import Any, Callable

from ft_plugins import faults
from ft_plugins.torch.state import current_iteration


class FaultDrill:
    """The wrappers (wrapt signature) that fire this rank's planned faults, each once."""

    def __init__(self) -> None:
        self._drill = faults.Drill()
        self._iteration = 0

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._iteration = current_iteration(args, kwargs)
        self._drill.reached("forward", self._iteration)
        return wrapped(*args, **kwargs)

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._drill.reached("update", self._iteration)
        return wrapped(*args, **kwargs)

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = kwargs.get("iteration", args[0] if args else None)
        if isinstance(iteration, int):
            self._drill.reached("save", iteration)
        return wrapped(*args, **kwargs)
