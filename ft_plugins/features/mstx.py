"""``mstx``: profiler ranges (``step {n}``, ``dataloader``, ``save_checkpoint``) for slow-node diagnosis."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ft_plugins.config import Option, parse_bool
from ft_plugins.features.base import Feature
from ft_plugins.vendors.ranges import BACKENDS, RangeBackend, select_backend

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

    def activity(self) -> str:
        done = ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items()))
        return f"ranges via {self.ranges.name}: {done or 'none yet'}"
