"""``recover``: in-place recovery (MindCluster's "recover" strategy) for Megatron under ``ft-plugins run -- torchrun``.

A lost rank is replaced while the healthy processes keep running: torchrun's agent restarts only the
failed worker (:mod:`ft_plugins.launch.recover`), the survivors rebuild the communication groups with
it and hand it the state of the last completed step (:mod:`ft_plugins.torch.megatron.recover`); no checkpoint
is written or read. When recovery cannot work, ``ttp``'s dump and a whole-job restart follow, as
without this feature. It changes how the launcher treats failures, so ``FT_PLUGINS=auto`` never turns
it on: only its name or ``all`` does.
"""

from __future__ import annotations

from ft_plugins.config import Option, parse_count, parse_seconds
from ft_plugins.features.base import Feature
from ft_plugins.vendors import VendorUnavailable

DEFAULT_TIMEOUT = 180.0  # seconds, as MindIO's TTP_NORMAL_ACTION_TIME_LIMIT


class Recover(Feature):
    name = "recover"
    requires = ("ttp",)  # its step tracking and, when recovery cannot work, its dump
    summary = "in-place recovery: a lost rank is replaced while the others keep running (falls back to ttp's dump)"
    options = (
        Option("timeout", DEFAULT_TIMEOUT, "seconds the survivors wait for a replacement to join before the dump",
               parse_seconds),
        Option("spares", 0, "processes per node kept waiting (forked from a template with torch and megatron "
               "imported) that take over a lost rank; 0: a fresh process is started", parse_count),
    )

    def start(self) -> str:
        if self.framework != "pt":
            raise VendorUnavailable("in-place recovery is implemented for PyTorch (Megatron) under torchrun only")
        if not self.requested:
            raise VendorUnavailable("recover changes how the launcher treats a failure: it runs only when asked "
                                    "for (FT_PLUGINS=recover,ttp or all)")
        self.recoveries: list[str] = []
        return (f"a lost rank is replaced in place: torchrun restarts only that worker, the survivors keep their "
                f"processes and send it the last completed step; without it after {self.settings['timeout']:.0f} s, "
                "ttp's dump and a whole-job restart")

    def activity(self) -> str:
        return f"recoveries: {', '.join(self.recoveries)}" if self.recoveries else "no recovery"
