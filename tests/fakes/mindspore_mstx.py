"""Fake of ``mindspore.profiler.mstx`` (same signatures), recording calls: the real one records nothing
off Ascend. Tests put it in place of ``mindspore.profiler.mstx`` and nothing else."""

import itertools
import sys

from fake_record import record

_ids = itertools.count(1)


def _stream_name(stream: object) -> object:
    """``"current"`` only for the object ``mindspore.runtime.current_stream()`` returns; any other by its repr."""
    if stream is None:
        return None
    runtime = sys.modules.get("mindspore.runtime")
    return "current" if runtime is not None and stream is runtime.current_stream() else repr(stream)


def mark(message, stream=None, domain="default"):
    record("mstx.mark", message, _stream_name(stream), domain=domain)


def range_start(message, stream=None, domain="default"):
    """Records the opening module too (``caller``), so tests tell MindSpore's own ranges from ft_plugins'."""
    range_id = next(_ids)
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    record("mstx.range_start", message, _stream_name(stream), domain=domain, id=range_id, caller=caller)
    return range_id


def range_end(range_id, domain="default"):
    record("mstx.range_end", range_id, domain=domain)
