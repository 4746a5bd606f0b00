"""``elastic``: elastic training (MindCluster's "elastic-training" strategy) under ``ft-plugins run``.

Megatron, on top of ``recover``: when a lost rank is not replaced within ``wait`` seconds (a node lost for good,
torchrun's ``--nnodes MIN:MAX``), the survivors drop every model replica that lost a rank and train on in place at
the smaller data-parallel size, the global batch kept (:mod:`ft_plugins.torch.megatron.elastic`); what ``recover``
does otherwise is unchanged. The Hugging Face Trainer, by restart: a checkpoint resumed by another number of
processes (torchrun's elastic restart) keeps its global batch and its data position (:mod:`ft_plugins.torch.hf
.elastic`); Accelerate, whose loop is the script's: the change said, and rank 0's generators for a process
with no RNG file of its own. It changes what a job does after a loss, so like ``recover`` it runs only when asked
for by name or ``all``.
"""

from __future__ import annotations

from ft_plugins.config import Option, parse_seconds
from ft_plugins.features.base import Feature
from ft_plugins.vendors import VendorUnavailable

DEFAULT_WAIT = 30.0  # seconds: MindCluster's wait-reschedule-timeout at its least (30..270 s)


class Elastic(Feature):
    name = "elastic"
    # Megatron's scale-in works on top of recover (its groups held and rebuilt in place, its hand-over of a step,
    # its fallback): its glue says so when recover is off; the Trainer's resume at another size needs nothing else
    summary = "elastic training: with no replacement for a lost rank, train on with fewer data-parallel replicas"
    options = (
        Option("wait", DEFAULT_WAIT, "seconds the survivors wait for a replacement before they go on without the lost "
               "ranks' model replicas (MindCluster's wait-reschedule-timeout)", parse_seconds),
    )

    def start(self) -> str:
        if self.framework != "pt":
            raise VendorUnavailable("elastic training is implemented for PyTorch (Megatron, the Hugging Face Trainer) "
                                    "under torchrun only")
        if not self.requested:
            raise VendorUnavailable("elastic changes what a job does after a loss: it runs only when asked for "
                                    "(FT_PLUGINS=elastic,recover,ttp or all)")
        self.changes: list[str] = []
        return (f"a lost rank not replaced within {self.settings['wait']:.0f} s: the survivors drop its model "
                "replica and train on in place at the smaller data-parallel size (Megatron, with recover); a "
                "checkpoint resumed by another number of processes keeps its global batch (Trainer), and a "
                "process with no RNG file takes rank 0's (Trainer, Accelerate)")

    def activity(self) -> str:
        return f"scale-ins: {', '.join(self.changes)}" if self.changes else "no scale-in"
