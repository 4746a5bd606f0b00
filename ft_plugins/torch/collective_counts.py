"""``hangs``: each collective a rank enters on a process group counted into its progress report
(:func:`ft_plugins.progress.entered`), so its launcher can tell a rank waiting for a peer from the peer it waits
for by the counts, not only by where its main thread stands (on an asynchronous backend a collective returns at
once, and its rank waits later, at a host sync).

torch's point-to-point operations are not counted: a pipeline stage sends to one peer and receives from another,
so their counts differ by design.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ft_plugins import progress
from ft_plugins.patching import Patch

DISTRIBUTED = "torch.distributed"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list")


class CollectiveCounts:
    """The wrappers (wrapt signature) of torch's collectives that count them, per group."""

    def __init__(self) -> None:
        self._keys: dict[Any, int] = {}  # group -> its key (a destroyed group's entry is a few bytes)

    def patches(self) -> tuple[Patch, ...]:
        return tuple(Patch(DISTRIBUTED, name, self._counting(), required=False) for name in COLLECTIVES)

    def _counting(self) -> Callable[..., Any]:
        """A collective's wrapper; the position of its ``group`` argument is read from the function itself at its
        first call (-1: it takes none, and is not counted)."""
        position: list[int] = []

        def counted(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            if not position:
                names = list(inspect.signature(wrapped).parameters)
                position.append(names.index("group") if "group" in names else -1)
            if position[0] >= 0:
                key = self._key(kwargs.get("group", args[position[0]] if len(args) > position[0] else None))
                if key:
                    progress.entered(key)
            return wrapped(*args, **kwargs)

        return counted

    def _key(self, group: Any) -> int:
        """The group's key (0: not counted: no default group, or one torch does not know the ranks of)."""
        import torch.distributed as dist

        group = dist.group.WORLD if group is None else group
        key = self._keys.get(group)
        if key is None and group is not None:
            try:
                key = progress.group_key(dist.get_process_group_ranks(group))
            except Exception:  # never the collective's own error: it is not counted
                key = 0
            self._keys[group] = key
        return key or 0
