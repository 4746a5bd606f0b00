"""torchrun's restart attempts kept apart on the agent's store.

With ``--max-restarts`` torchrun restarts every worker after a failure; its workers share the agent's store
(needed by ``recover``, whose protocol and whose rank 0 must outlive a worker), and torch 2.13 does not key
a process group's rendezvous by attempt: a restarted rank reads the dead workers' Gloo addresses for every
group after the default one and fails (``connectFullMesh failed``). Each attempt's process groups get a
store prefix of their own. Core: torch is asked only when its rendezvous calls the wrapper.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Mapping

from ft_plugins.config import RESTART_VAR

PREFIX = "ft_plugins/attempt"


def attempt_prefix(env: Mapping[str, str]) -> str | None:
    """The prefix this worker's process groups take, or None (first attempt, or a store of its own)."""
    attempt = env.get(RESTART_VAR, "0") or "0"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    return f"{PREFIX}{attempt}/"


def keep_attempts_apart(rendezvous: ModuleType) -> None:
    """Wrap ``torch.distributed.rendezvous._create_c10d_store`` (the env:// rendezvous' store) with the prefix."""
    prefix = attempt_prefix(os.environ)
    create: Callable[..., Any] | None = getattr(rendezvous, "_create_c10d_store", None)
    if prefix is None or create is None or getattr(create, "_ft_plugins_prefix", None):
        return
    from torch.distributed import PrefixStore

    def per_attempt(*args: Any, **kwargs: Any) -> Any:
        return PrefixStore(prefix, create(*args, **kwargs))

    per_attempt._ft_plugins_prefix = prefix  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = per_attempt
