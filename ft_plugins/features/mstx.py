"""``mstx``: profiler ranges (``step {n}``, ``dataloader``, ``save_checkpoint``) for slow-node diagnosis."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import wrapt

from ft_plugins.config import Option, parse_bool
from ft_plugins.features.base import Feature
from ft_plugins.vendors.ranges import BACKENDS, select_backend

if TYPE_CHECKING:
    from ft_plugins.vendors.ranges import RangeBackend

STEP = "step"
DATALOADER = "dataloader"
SAVE_CHECKPOINT = "save_checkpoint"


class Mstx(Feature):
    name = "mstx"
    summary = "step / dataloader / save_checkpoint ranges on mstx (Ascend) or nvtx (CUDA)"
    options = (
        Option("backend", "auto", "range backend", choices=BACKENDS),
        Option("dataloader", True, "emit a 'dataloader' range around each batch fetch", parse_bool),
        Option("save_checkpoint", True, "emit a 'save_checkpoint' range around each save", parse_bool),
    )

    def start(self) -> str:
        self.ranges: RangeBackend = select_backend(self.framework, self.settings["backend"])
        self.counts: Counter[str] = Counter()
        return f"backend {self.ranges.name}"

    def begin_step(self, iteration: int) -> Any:
        """Open the ``step {n}`` range on the current device stream; pass the result to ``end``."""
        self.counts[STEP] += 1
        return self.ranges.range_start(f"step {iteration}", True)

    def begin(self, kind: str) -> Any:
        self.counts[kind] += 1
        return self.ranges.range_start(kind)

    def end(self, handle: Any) -> None:
        self.ranges.range_end(handle)

    def emits(self, kind: str) -> bool:
        """Whether ranges of this kind are switched on (``dataloader`` and ``save_checkpoint`` have options)."""
        return bool(self.settings.get(kind, True))

    def ranged(self, data_iterator: Any) -> Any:
        """``data_iterator`` with a ``dataloader`` range around every ``next`` (a list: each element)."""
        if data_iterator is None:
            return None
        if isinstance(data_iterator, list):  # one iterator per virtual pipeline stage
            return [self.ranged(item) for item in data_iterator]
        return _RangedIterator(data_iterator, self)

    def activity(self) -> str:
        done = ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items()))
        return f"ranges via {self.ranges.name}: {done or 'none yet'}"


class _RangedIterator(wrapt.ObjectProxy):  # type: ignore[misc]
    """An iterator proxy: a ``dataloader`` range around ``next``; every other attribute passes through,
    and ``isinstance`` checks see the wrapped iterator's class."""

    def __init__(self, wrapped: Any, mstx: Mstx) -> None:
        super().__init__(wrapped)
        self._self_mstx = mstx

    def __iter__(self) -> "_RangedIterator":
        return self

    def __next__(self) -> Any:
        handle = self._self_mstx.begin(DATALOADER)
        try:
            return next(self.__wrapped__)
        finally:
            self._self_mstx.end(handle)
