"""Where the Trainer's events go: the features listening in this process (set by the HF integration).

Kept apart from :mod:`.callback` (which subclasses transformers' ``TrainerCallback``) so that the
integration never imports transformers itself.
"""

from __future__ import annotations

from typing import Any

LISTENERS: list[Any] = []


def dispatch(event: str, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
    """Hand one Trainer event to every listener (``on_event(event, args, state, control, kwargs)``)."""
    for listener in list(LISTENERS):
        listener.on_event(event, args, state, control, kwargs)
