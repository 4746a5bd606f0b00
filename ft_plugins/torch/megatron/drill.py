"""Fire drills in Megatron workers: the faults of ``FT_PLUGINS_INJECT_FAULT`` fired where they are named.

``at=forward`` fires as the step starts (before its forward pass), ``at=update`` inside the
optimizer's own update (``step_with_ready_grads``), ``at=save`` as ``save_checkpoint`` of that
iteration begins, ``at=data`` as the step takes its first batch from the data iterator, ``at=collective``
as the step starts, a hang then blocking in a receive from a peer that never sends, ``at=device`` as the step starts,
after a kernel of ``seconds`` is queued on the CUDA stream (:func:`ft_plugins.torch.drill.stuck_kernel`),
``at=gc`` as the step starts, inside a garbage collection.
Independent of the features: the same drill runs with ``FT_PLUGINS=none``, which is how a test shows what a fault
costs without ft_plugins. Applied before ``ttp``'s hooks, so ``ttp`` has seen the step begin (or the update begin)
when a fault fires.
"""

from __future__ import annotations

from typing import Any, Callable

from ft_plugins import faults
from ft_plugins.torch.drill import stuck_kernel
from ft_plugins.torch.megatron.state import current_iteration


class FaultDrill:
    """The wrappers (wrapt signature) that fire this rank's planned faults, each once."""

    def __init__(self) -> None:
        self._drill = faults.Drill()
        self._iteration = 0

    def train_step(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._iteration = current_iteration(args, kwargs)
        self._drill.reached("forward", self._iteration)
        self._drill.reached("collective", self._iteration, _receive_from_nobody)
        self._drill.reached("device", self._iteration, before=stuck_kernel)
        self._drill.reached("gc", self._iteration)
        if self._drill.plans("data", self._iteration) and len(args) > 1 and args[1] is not None:
            args = (args[0], _fire_at_next_batch(args[1], lambda: self._drill.reached("data", self._iteration)),
                    *args[2:])
        return wrapped(*args, **kwargs)

    def update(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self._drill.reached("update", self._iteration)
        return wrapped(*args, **kwargs)

    def save_checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        iteration = kwargs.get("iteration", args[0] if args else None)
        if isinstance(iteration, int):
            self._drill.reached("save", iteration)
        return wrapped(*args, **kwargs)


class _Firing:
    """A data iterator that fires a drill as the first batch is asked for."""

    def __init__(self, iterator: Any, fire: Callable[[], None]) -> None:
        self._iterator, self._fire = iterator, fire

    def __iter__(self) -> "_Firing":
        return self

    def __next__(self) -> Any:
        self._fire()
        return next(self._iterator)


def _fire_at_next_batch(iterator: Any, fire: Callable[[], None]) -> Any:
    """The step's data iterator, firing as its next batch is asked for. Megatron's replay wrapper
    (``RerunDataIterator``, which ``train_step`` insists on) stays what the step gets: what it reads from is wrapped."""
    if hasattr(iterator, "iterable"):
        iterator.iterable = _Firing(iterator.iterable, fire)
        return iterator
    return _Firing(iterator, fire)


def _receive_from_nobody() -> None:
    """Block in a collective no peer enters: a receive from the next rank, which never sends."""
    import torch
    import torch.distributed as dist

    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
