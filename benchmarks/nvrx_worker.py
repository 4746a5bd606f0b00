"""A worker of ``bench_hangs.py``'s NVRx way: the Megatron example under nvidia-resiliency-ext 0.4.1's ``ft_launcher``,
with Megatron's own NVRx integration (``--enable-ft-package``, ``megatron/training/ft_integration.py``): its
sections (set-up, each step after the warm-up, each save) and, with ``--calc-ft-timeouts``, the timeouts it learns
and keeps beside the checkpoints for the next run (``ft_state.json``).

megatron-core 0.17.1 wants NVRx 0.6 or newer; 0.4.1 is the newest NVRx pip finds for Python 3.11. Two adaptations
make them meet, nothing else: NVRx's ``checkpointing`` package is hidden from this process (Megatron's check of
NVRx's asynchronous checkpointing refuses an NVRx older than 0.6 when it finds that package; without it Megatron
saves as on a machine without NVRx checkpointing), and ``init_workload_monitoring`` drops the ``num_warmup_iters``
that Megatron passes and NVRx 0.4.1 does not take (Megatron keeps its warm-up steps out of the step section itself).
ft_plugins runs only its fire drill (``FT_PLUGINS=none``, ``FT_PLUGINS_INJECT_FAULT``): the same hang as the other
ways.
"""

from __future__ import annotations

import importlib.abc
import os
import runpy
import sys
from typing import Any

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron_gpt",
                       "pretrain_gpt.py")
HIDDEN = "nvidia_resiliency_ext.checkpointing"


class _HideCheckpointing(importlib.abc.MetaPathFinder):
    """NVRx's checkpointing package, absent for this process (see the module's note)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            raise ModuleNotFoundError(f"{name} is hidden from the benchmark's worker", name=name)


def main() -> None:
    sys.meta_path.insert(0, _HideCheckpointing())
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    initialize = RankMonitorClient.init_workload_monitoring
    RankMonitorClient.init_workload_monitoring = lambda client, **newer: initialize(client)
    sys.argv = [EXAMPLE, *sys.argv[1:]]
    runpy.run_path(EXAMPLE, run_name="__main__")


if __name__ == "__main__":
    main()
