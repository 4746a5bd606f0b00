"""Profiler ranges behind one interface: torch_npu mstx, MindSpore mstx, CUDA nvtx, or nothing.

``range_start(message, device=False) -> handle`` / ``range_end(handle)``.
``device=True`` puts the range on the current device stream (what TaskD's slow-node diagnosis
reads for ``step {n}``). A vendor error inside a range call is logged once and the backend goes
quiet: profiling must never break a training step.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable

from ft_plugins.vendors import VendorUnavailable, versions

log = logging.getLogger("ft_plugins.mstx")

DOMAIN = "default"
BACKENDS = ("auto", "torch_npu", "mindspore", "nvtx", "noop")


if TYPE_CHECKING:  # a typing.Protocol costs its class creation at every training process's import
    from typing import Protocol

    class RangeBackend(Protocol):
        name: str

        def range_start(self, message: str, device: bool = False) -> Any: ...

        def range_end(self, handle: Any) -> None: ...


class NoopRanges:
    """Costs one Python call per range: what runs where no profiler exists."""

    name = "noop"

    def range_start(self, message: str, device: bool = False) -> Any:
        return None

    def range_end(self, handle: Any) -> None:
        return None


def _accepts(func: Callable[..., Any], parameter: str) -> bool:
    try:
        return parameter in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


class MstxRanges:
    """mstx as torch_npu and MindSpore expose it: ``range_start(msg, stream, domain=)`` -> id (0 = failed).

    Older torch_npu has ``range_start(msg, stream)`` with no domain and a stream required; the
    signature is read once here, not per call.
    """

    def __init__(self, name: str, mstx: Any, current_stream: Callable[[], Any]) -> None:
        self.name = name
        self._mstx = mstx
        self._current_stream = current_stream
        self._start_domain = _accepts(mstx.range_start, "domain")
        self._end_domain = _accepts(mstx.range_end, "domain")
        self._broken = False

    def _failed(self, call: str, exc: Exception) -> None:
        self._broken = True
        _went_quiet(self.name, call, exc)

    def range_start(self, message: str, device: bool = False) -> Any:
        if self._broken:
            return None
        try:
            stream = self._current_stream() if device or not self._start_domain else None
            if self._start_domain:
                return self._mstx.range_start(message, stream, domain=DOMAIN) or None
            return self._mstx.range_start(message, stream) or None
        except Exception as exc:
            self._failed("range_start", exc)
            return None

    def range_end(self, handle: Any) -> None:
        if handle is None or self._broken:
            return
        try:
            if self._end_domain:
                self._mstx.range_end(handle, domain=DOMAIN)
            else:
                self._mstx.range_end(handle)
        except Exception as exc:
            self._failed("range_end", exc)


class NvtxRanges:
    """CUDA nvtx: no streams, no domains; an error goes quiet as with mstx."""

    name = "nvtx"

    def __init__(self, nvtx: Any) -> None:
        self._nvtx = nvtx
        self._broken = False

    def range_start(self, message: str, device: bool = False) -> Any:
        if self._broken:
            return None
        try:
            return self._nvtx.range_start(message)
        except Exception as exc:
            self._broken = True
            _went_quiet(self.name, "range_start", exc)
            return None

    def range_end(self, handle: Any) -> None:
        if handle is None or self._broken:
            return
        try:
            self._nvtx.range_end(handle)
        except Exception as exc:
            self._broken = True
            _went_quiet(self.name, "range_end", exc)


def _went_quiet(backend: str, call: str, exc: Exception) -> None:
    """Said once per backend: its next calls return at once."""
    log.warning("mstx: %s.%s failed (%s: %s); ranges are off for this process", backend, call, type(exc).__name__, exc)


def _torch_npu() -> RangeBackend:
    if importlib.util.find_spec("torch_npu") is None:
        raise VendorUnavailable("torch_npu is not installed")
    npu = importlib.import_module("torch_npu").npu
    mstx = getattr(npu, "mstx", None)
    if mstx is None:
        raise VendorUnavailable(f"this torch_npu has no npu.mstx (needs torch_npu {versions.TORCH_NPU_MSTX} or newer)")
    return MstxRanges("torch_npu", mstx, npu.current_stream)


def _mindspore() -> RangeBackend:
    if importlib.util.find_spec("mindspore") is None:
        raise VendorUnavailable("mindspore is not installed")
    try:
        mstx = importlib.import_module("mindspore.profiler").mstx
        runtime = importlib.import_module("mindspore.runtime")
    except (ImportError, AttributeError) as exc:
        raise VendorUnavailable(f"this MindSpore has no profiler mstx ({exc}); needs MindSpore 2.5 or newer") from None
    return MstxRanges("mindspore", mstx, runtime.current_stream)


def _nvtx() -> RangeBackend:
    if importlib.util.find_spec("torch") is None:
        raise VendorUnavailable("torch is not installed")
    torch = importlib.import_module("torch")
    if torch.version.cuda is None or not torch.cuda.is_available():
        raise VendorUnavailable("no CUDA device (this torch is a CPU build or no GPU is visible)")
    return NvtxRanges(torch.cuda.nvtx)


_LOADERS: dict[str, Callable[[], RangeBackend]] = {
    "torch_npu": _torch_npu,
    "mindspore": _mindspore,
    "nvtx": _nvtx,
    "noop": NoopRanges,
}
_AUTO_ORDER = {"pt": ("torch_npu", "nvtx"), "ms": ("mindspore",)}


def select_backend(framework: str, choice: str = "auto") -> RangeBackend:
    """The backend named by ``choice``, or under ``auto`` the first present one for ``framework``.

    ``auto`` never picks ``noop``: where no profiler exists the feature is simply off.
    MindSpore's mstx is only picked automatically on Ascend, where it records anything.
    """
    if choice != "auto":
        return _LOADERS[choice]()
    reasons = []
    for name in _AUTO_ORDER[framework]:
        try:
            backend = _LOADERS[name]()
        except VendorUnavailable as exc:
            reasons.append(f"{name}: {exc}")
            continue
        if name == "mindspore" and importlib.import_module("mindspore").get_context("device_target") != "Ascend":
            reasons.append("mindspore: device target is not Ascend")
            continue
        return backend
    raise VendorUnavailable("no profiler runtime (" + "; ".join(reasons) + ")")
