"""The RNG state a Trainer save holds (Python, numpy, torch's CPU and each device's generators), taken at
the end of every optimizer step so that a dump of that step can write it: it has to be cheap.

numpy's ``get_state`` copies its Mersenne Twister's 624 words one at a time (~100 µs, more than the rest of
the hooks together on a small step), while the global generator's raw state is 2,500 bytes that its ctypes
interface reads in ~1 µs. :class:`NumpyState` runs the full getter only when those bytes changed, or when a
cached Gaussian could have been spent since (numpy hands one out without drawing), so what it returns is what
``numpy.random.get_state()`` would return then. The one state it cannot see: ``set_state`` of the very same
words with a cached Gaussian added, which only restoring a state taken earlier does. Python's
``random.getstate`` builds 625 integers each time: :class:`PythonState` reads the module generator's C
words (its index and 624 words, 2,500 bytes) and its cached Gaussian the same way, and the getter only when
they changed. Each layout is checked once against its full getter; any other gets the full getter every time.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Callable

_WORDS = 624
_RAW_SIZE = 4 * _WORDS + struct.calcsize("i")  # numpy's mt19937_state: uint32_t key[624]; int pos
_HAS_GAUSS = 3  # ("MT19937", key, pos, has_gauss, cached_gaussian)


class _Watched:
    """A generator's full getter, called again only when its raw bytes changed or :meth:`_stale` says so."""

    def __init__(self, get: Callable[[], tuple], address: int | None, size: int) -> None:
        self._get, self._address, self._size = get, address, size
        self._raw = b""
        self._state: tuple = ()

    def __call__(self) -> tuple:
        if self._address is None:
            return self._get()
        raw = ctypes.string_at(self._address, self._size)
        if raw != self._raw or not self._state or self._stale(self._state):
            self._state, self._raw = self._get(), raw
        return self._state

    def _stale(self, state: tuple) -> bool:
        return False


class NumpyState(_Watched):
    """``numpy.random.get_state()``, read again only when the global generator's words changed (or a cached
    Gaussian could have been spent)."""

    def __init__(self) -> None:
        import numpy

        super().__init__(numpy.random.get_state, _raw_address(numpy), _RAW_SIZE)

    def _stale(self, state: tuple) -> bool:
        return bool(state[_HAS_GAUSS])


def _raw_address(numpy: Any) -> int | None:
    """Where the global generator keeps its words, if they are laid out as read here (checked once against
    the full getter; any other numpy gets the full getter every time)."""
    try:
        address = int(numpy.random.mtrand._rand._bit_generator.ctypes.state_address)
    except (AttributeError, TypeError, ValueError):
        return None
    state = numpy.random.get_state()
    if state[0] != "MT19937":
        return None
    expected = numpy.asarray(state[1], dtype=numpy.uint32).tobytes() + struct.pack("i", int(state[2]))
    return address if ctypes.string_at(address, _RAW_SIZE) == expected else None


_PY_OFFSET = object.__basicsize__  # CPython's PyObject_HEAD
_PY_RAW_SIZE = struct.calcsize("i") + 4 * _WORDS  # _random's RandomObject: int index; uint32_t state[624]


class PythonState(_Watched):
    """``random.getstate()``, read again only when the module's generator moved (its words, or its cached
    Gaussian)."""

    def __init__(self) -> None:
        import random

        self._generator = random._inst
        super().__init__(random.getstate, _python_address(self._generator), _PY_RAW_SIZE)

    def _stale(self, state: tuple) -> bool:
        return self._generator.gauss_next != state[2]


def _python_address(generator: Any) -> int | None:
    """Where ``generator`` keeps its index and words, if they are laid out as read here."""
    if type(generator).__basicsize__ < _PY_OFFSET + _PY_RAW_SIZE:
        return None
    _, internal, _ = generator.getstate()
    if len(internal) != _WORDS + 1:
        return None
    expected = struct.pack("i", internal[-1]) + struct.pack(f"{_WORDS}I", *internal[:-1])
    address = id(generator) + _PY_OFFSET
    return address if ctypes.string_at(address, _PY_RAW_SIZE) == expected else None


class RngState:
    """Takes every generator's state as ``Trainer._save_rng_state`` would write it."""

    def __init__(self) -> None:
        self._readers: tuple[PythonState, NumpyState, list[Any]] | None = None

    def take(self) -> dict[str, Any]:
        import torch

        if self._readers is None:  # the devices a run trains on do not change during it
            devices = [(name, getattr(torch, name, None)) for name in ("cuda", "npu")]
            present = [(name, device) for name, device in devices if device is not None and device.is_available()]
            self._readers = (PythonState(), NumpyState(), present)
        python, numpy, devices = self._readers
        state: dict[str, Any] = {"python": python(), "numpy": numpy(), "cpu": torch.random.get_rng_state()}
        for name, device in devices:
            state[name] = device.random.get_rng_state_all()
        return state


def restore(state: dict[str, Any]) -> None:
    """Puts a taken state back into every generator (before the Trainer writes its RNG file)."""
    import random

    import numpy
    import torch

    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    for name in ("cuda", "npu"):
        if name in state:
            getattr(torch, name).random.set_rng_state_all(state[name])
