"""The dump's copies on a stream of their own, for a device whose queue a blocked collective holds.

On CUDA (and on Ascend through torch_npu) a copy of a tensor to the host is queued on the current stream, behind
every kernel queued there before it. After a fault on NCCL or HCCL one of those is a collective waiting for a lost
peer, and a plain copy (what ``torch.save`` does) waits with it until the backend's watchdog ends the process. The
state of the last completed step is final once the device has run what was queued before the step's boundary:
:meth:`DeviceMarks.mark` records an event there (at each step's start and right after each optimizer update), and
:meth:`DeviceMarks.side_stream` lets the dump wait for that event, never longer than its deadline, then copy on a
stream that nothing blocked precedes. Where the event is not reached in time (a kernel queued before the boundary
is stuck itself), :class:`DeviceStuck` says so and nothing is copied. Without a device in use (CPU, gloo) both do
nothing.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger("ft_plugins.ttp")

POLL = 0.005  # seconds between two looks at the mark


class DeviceStuck(RuntimeError):
    """The device did not reach the last step boundary within the dump's deadline."""


def accelerator() -> Any:
    """The torch module of the device this process computes on (``torch.cuda``, ``torch.npu``), where one is in use
    (its runtime initialised); None otherwise. A CPU shim that claims CUDA without initialising it is no device."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for name in ("npu", "cuda"):
        module = getattr(torch, name, None)
        initialized = getattr(module, "is_initialized", None)
        try:
            if initialized is not None and initialized():
                return module
        except Exception:  # a half-installed device plugin
            continue
    return None


class DeviceMarks:
    """The latest step boundary on the device, and the dump's stream behind it."""

    def __init__(self) -> None:
        self._module: Any = None  # the device's torch module, found at the first mark that finds one
        self._event: Any = None
        self._device: int | None = None

    def mark(self) -> None:
        """A step boundary: an event recorded on the current stream (one record, microseconds); nothing without a
        device."""
        if self._event is None:
            module = accelerator()
            if module is None:
                return
            self._module, self._event, self._device = module, module.Event(), module.current_device()
        self._event.record()

    def after(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call`` (an optimizer update), then a mark: run inside the update's bracket, so no dump of the updated step
        copies before the device ran the update."""
        def marked() -> Any:
            result = call()
            self.mark()
            return result

        return marked

    @contextmanager
    def side_stream(self, deadline: float) -> Iterator[None]:
        """Inside: the current stream is one of the dump's own, once the device ran what was queued before the
        latest mark (waited for at most ``deadline`` seconds, else :class:`DeviceStuck`). ``deadline`` 0, no device
        or no mark yet: the current stream, as it stands."""
        module = self._module
        if module is None or deadline <= 0:
            yield
            return
        started = time.monotonic()
        while not self._event.query():
            if time.monotonic() - started > deadline:
                raise DeviceStuck(f"the device did not finish the work of the last completed step within {deadline:g} "
                                  "s (a kernel queued before the step's end does not end): nothing copied")
            time.sleep(POLL)
        log.info("ttp: the device ran the last completed step's work %.2f s into the dump's wait; the dump copies on "
                 "a stream of its own", time.monotonic() - started)
        with module.device(self._device):  # the dump may run in a thread of its own: another current device
            stream = module.Stream()
            with module.stream(stream):
                yield
            stream.synchronize()
