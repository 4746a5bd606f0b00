"""The job's communication backend, said once where the built-in ``ttp`` engine or ``recover`` relies on it (placed
by the Megatron glue, whose patches of ``torch.distributed`` apply to every torch job: the Trainer's too).

Both learn of a lost peer from a collective's error. gloo raises it within milliseconds; NCCL and HCCL block until
their own timeout or an abort (:mod:`ft_plugins.torch.abort`: the launcher's word that a worker was lost aborts them,
and so does a dump before it reads any state). That is verified on a CPU backend with NCCL's semantics, not on NCCL
or HCCL themselves (docs/verified.md, "Per communication backend"), so rank 0 says it when the default group is
made.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ft_plugins.patching import Patch
from ft_plugins.torch.abort import blocks

log = logging.getLogger("ft_plugins.torch")

BLOCKING = {"nccl": "NCCL's watchdog ends the process (10 minutes by default)",
            "hccl": "HCCL_EXEC_TIMEOUT ends it (1836 s by default)"}


def blocking_note(backend: str, features: str) -> str | None:
    """The line for a default group on ``backend`` (torch's name: ``nccl``, ``cpu:gloo,cuda:nccl`` ...), None on
    one that fails fast."""
    if not blocks(backend):
        return None
    name = next((name for name in BLOCKING if name in backend.lower()), backend)
    until = BLOCKING.get(name, "its own timeout")
    return (f"{features} on {name.upper()}: a collective whose peer is lost blocks there until {until} instead of "
            f"failing at once as on gloo; this rank's communicators are aborted when the launcher reports a lost "
            f"worker or node (a node once torchrun's rendezvous misses its keep-alives, 15 s by default) and before a "
            f"dump, which copies the last completed step on a stream of its own; not verified on {name.upper()} with "
            f"a lost peer (docs/verified.md, 'Per communication backend')")


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
