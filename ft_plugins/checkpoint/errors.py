"""Every error the checkpoint package raises, under one root, :class:`CheckpointError`: callers catch one class."""

from __future__ import annotations

from typing import Iterable


class CheckpointError(Exception):
    """A save directory or checkpoint that cannot be examined at all; the message says which and why."""


class ManifestError(CheckpointError, ValueError):
    """A manifest that cannot be written or read; the message says which file and why."""


class NoIntactCheckpoint(CheckpointError):
    """Checkpoints exist but none is intact, and starting from scratch was not allowed.

    ``skipped`` holds ``(path, reason)`` for every checkpoint passed over, so any rank that raises it (not
    only the one that examined the directory) can say what was skipped. Picklable, e.g. across processes.
    """

    def __init__(self, message: str, skipped: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.skipped = tuple((str(path), str(reason)) for path, reason in skipped)

    def __reduce__(self) -> tuple[type, tuple[str, tuple[tuple[str, str], ...]]]:
        return type(self), (self.message, self.skipped)

    def __str__(self) -> str:
        return self.message
