"""The job's communication backend, said once where the built-in ``ttp`` engine or ``recover`` cannot rely on it
(placed by the Megatron glue, whose patches of ``torch.distributed`` apply to every torch job: the Trainer's too).

Both learn of a lost peer from a collective's error. gloo raises it within milliseconds; NCCL and HCCL block until
their own timeout or an abort, and the dump's device-to-host copies queue behind the blocked collective. Nothing of
that is verified here (docs/verified.md, "Per communication backend"), so rank 0 says it when the default group is
made: users learn it at start, not after ten minutes of a job that neither dumps nor repairs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ft_plugins.patching import Patch

log = logging.getLogger("ft_plugins.torch")

BLOCKING = {"nccl": "NCCL's watchdog ends the process (10 minutes by default)",
            "hccl": "HCCL_EXEC_TIMEOUT ends it (1836 s by default)"}


def blocking_note(backend: str, features: str) -> str | None:
    """The line for a default group on ``backend`` (torch's name: ``nccl``, ``cpu:gloo,cuda:nccl`` ...), None on
    one that fails fast."""
    blocking = [name for name in BLOCKING if name in backend.lower()]
    if not blocking:
        return None
    name = blocking[0]
    return (f"{features} on {name.upper()}: a collective whose peer is lost blocks there until {BLOCKING[name]} "
            f"instead of failing at once as on gloo, and the dump and the repair wait for it; not verified on "
            f"{name.upper()} (docs/verified.md, 'Per communication backend')")


class BackendNote:
    """The wrapper (wrapt signature) of ``torch.distributed.init_process_group`` that says :func:`blocking_note`
    on rank 0, once."""

    def __init__(self, features: str) -> None:
        self.features = features  # what relies on a collective's error: "ttp's built-in engine", "... and recover"
        self.said = False

    def patches(self) -> tuple[Patch, ...]:
        return (Patch("torch.distributed", "init_process_group", self.init_process_group),)

    def init_process_group(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if not self.said:
            self.said = True
            try:
                import torch.distributed as dist

                note = blocking_note(str(dist.get_backend()), self.features)
                if note is not None and dist.get_rank() == 0:
                    log.warning(note)
            except Exception as exc:  # never into the job's own set-up: the group is made
                log.debug("the default group's backend not read: %s: %s", type(exc).__name__, exc)
        return result
