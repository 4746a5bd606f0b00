"""Where the training step stands, for a dying gasp: the last completed step K, the step's phase, and
whether this rank is inside its optimizer update. Framework-neutral: the Megatron glue, the Hugging Face
callback and in-place recovery drive one :class:`StepTracker` each from their own hooks.

A save of K must never see a half-updated state, so the update is bracketed (:meth:`StepTracker.update`):
a freeze waits for an update in progress to end (it has no collective), and once frozen the main thread
changes no state any more: it parks at its next step boundary or update.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

# where the training step stands
IDLE, FORWARD, UPDATE, UPDATED = "idle", "forward", "update", "updated"


class Frozen(NamedTuple):
    """The tracker's state once frozen: ``completed`` steps before the current one (K), its ``phase``,
    whether its update reported success, what the driver attached to the step, and ``torn``: the rank was
    caught inside an update that raised, so its state may be half-updated (nothing to save)."""

    phase: str
    completed: int
    update_ok: bool
    payload: Any
    torn: bool


class AlreadyFrozen(RuntimeError):
    """Another trigger froze the tracker first: it saves; this one has nothing to do."""


class StepTracker:
    """The step state machine; thread-safe (the triggers run in other threads)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.phase = IDLE
        self.completed = 0  # last completed step K
        self.payload: Any = None  # what the driver attached at the step's start (None: no step began)
        self.torn = False  # an update raised: this rank's state may be half-updated
        self._depth = 0  # nested optimizer updates in progress
        self._update_ok = True
        self._frozen = False
        self._main_parked = False

    @property
    def inside_update(self) -> bool:
        return self._depth > 0

    @property
    def frozen(self) -> bool:
        return self._frozen

    def begin(self, completed: int, payload: Any) -> None:
        """A step starts after ``completed`` steps; ``payload`` is what a save of this step needs."""
        with self._cond:
            self._park_if_frozen()
            self.completed, self.payload = completed, payload
            self.phase, self.torn, self._update_ok = FORWARD, False, True

    def end(self, advance: Callable[[Any], None] | None = None) -> int:
        """The step completed (``advance(payload)`` runs under the lock); returns the new K."""
        with self._cond:
            self.completed += 1
            if advance is not None:
                advance(self.payload)
            self.phase = IDLE
            self._cond.notify_all()
            self._park_if_frozen()
        return self.completed

    def update(self, call: Callable[[], Any]) -> Any:
        """Run the optimizer's update bracketed: never started under a freeze, never frozen half-way."""
        with self._cond:
            self._park_if_frozen()
            self._depth += 1
            self.phase = UPDATE
        try:
            ok = call()
        except BaseException:
            with self._cond:
                self._depth -= 1
                self.torn = True
                self._cond.notify_all()
            raise
        with self._cond:
            self._depth -= 1
            self._update_ok = self._update_ok and bool(ok)
            if self._depth == 0:
                self.phase = UPDATED
            self._cond.notify_all()
        return ok

    def stand_still(self) -> None:
        """The main thread changes no state any more (it failed, and another party drives the save)."""
        with self._cond:
            self._main_parked = True
            self._cond.notify_all()

    @contextmanager
    def standing_still(self) -> Iterator[None]:
        """The main thread changes no state for a while (e.g. while it waits for a repair), so a freeze
        need not wait for it; once frozen meanwhile, it never goes on."""
        self.stand_still()
        try:
            yield
        finally:
            with self._cond:
                self._park_if_frozen()
                self._main_parked = False

    @contextmanager
    def holding(self) -> Iterator[None]:
        """The tracker's lock, for a driver that changes the step's state (no freeze sees it half-changed)."""
        with self._cond:
            yield

    def peek(self) -> Frozen | None:
        """The state a freeze would return now, without freezing (call it holding the lock when it must not move)."""
        with self._cond:
            return None if self.payload is None else Frozen(self.phase, self.completed, self._update_ok,
                                                            self.payload, self.torn)

    def mark_torn(self) -> None:
        """This rank's state is not worth saving until a driver :meth:`align` s it again."""
        with self._cond:
            self.torn = True

    def align(self, phase: str) -> None:
        """Called holding the lock: a driver replaced the step's state; it stands in ``phase``, whole."""
        self.phase, self.torn, self._update_ok = phase, False, True

    def freeze(self, wait: float, exclusive: bool = True) -> Frozen | None:
        """Stop the main thread changing state and return the state to save; None when no step began. A rank past its update gets ``wait`` seconds to finish the
        step. ``exclusive``: a second freeze raises :class:`AlreadyFrozen` (from the main thread it parks)."""
        main = threading.current_thread() is threading.main_thread()
        with self._cond:
            if self._frozen and exclusive:
                if main:
                    self._park_if_frozen()
                raise AlreadyFrozen("the step tracker is frozen already")
            self._frozen = True
            self._main_parked = self._main_parked or main
            while self._depth:  # an update in progress ends soon: it has no collective
                self._cond.wait()
            deadline = time.monotonic() + wait
            while self.phase == UPDATED and not self._main_parked and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if self.payload is None:
                return None
            return Frozen(self.phase, self.completed, self._update_ok, self.payload, self.torn)

    def _park_if_frozen(self) -> None:
        """Called with the lock held: once frozen, the main thread stays here for good, even when a signal
        handler raises in it (torch's SIGCHLD handler: a data loader worker ended) while a save is writing."""
        if not self._frozen:
            return
        self._main_parked = True
        self._cond.notify_all()
        while True:
            try:
                self._cond.wait()
            except Exception:  # the wait re-takes the lock before raising: park again
                continue
