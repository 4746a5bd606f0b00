"""torch.distributed.checkpoint's ``.metadata``: where every shard lies, read without importing anything.

The file is a pickle of DCP's ``Metadata``. It is read by the C unpickler restricted so that every class
it names is replaced by :class:`_Inert`, an empty class of this module: no module is imported, no callable
of the file's choosing runs, nothing but plain data and inert stand-ins is built. The stand-in for
``_StorageInfo`` keeps the state it is given (file, offset, length), which is all the check needs.
"""

from __future__ import annotations

import gc
import io
import itertools
import operator
import os
import pickle
from typing import IO, Any, Callable

from ft_plugins.checkpoint.memo_guard import refuse_memo_bombs
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import is_inside, open_regular

_METADATA_LIMIT = 256 << 20  # a .metadata describes shards: megabytes even for large models
_FRAME = b"\x95"  # after PROTO 4 or 5: a framed pickle


class _Inert(BaseException):
    """What a pickle would construct, stood in for: accepts any arguments and state, keeps nothing. Built on
    BaseException, whose constructor takes any arguments in C, and handed its state through ``id`` (a C
    function that looks at nothing): a million of them cost no Python call each."""

    __setstate__ = staticmethod(id)

    # filled by SETITEMS / APPENDS / ADDITEMS when the file built a mapping, list or set subclass
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


class _MetadataReader(pickle.Unpickler):
    """The C unpickler with every global replaced by an inert stand-in: linear, at C speed, importing nothing."""

    def __init__(self, handle: IO[bytes] | _Turns) -> None:
        super().__init__(handle)
        self.shard_records: list[Any] = []
        # the one stand-in whose states are kept: appended as they come, still without a Python call
        self._shard_record = type("_StorageInfo", (_Inert,), {"__setstate__": staticmethod(self.shard_records.append)})

    def find_class(self, module: str, name: str) -> type:
        return self._shard_record if f"{module}.{name}".endswith("._StorageInfo") else _Inert

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not used by checkpoint metadata")


class _Turns:
    """A framed pickle's bytes behind Python methods: the C unpickler calls one for each frame (64 KB), and each
    call is a point where the check's other threads take their turn at the interpreter lock, which the
    unpickling would otherwise hold for its whole run (a third of a second at 10,000 ranks). Unframed pickles
    (protocol 3 and older) read as they are: they would call once for each opcode."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self._data.read(size)

    def readinto(self, buffer: Any) -> int:
        return self._data.readinto(buffer)

    def readline(self) -> bytes:
        return self._data.readline()


def storage_extents(handle: IO[bytes]) -> dict[str, int]:
    """The end of the last byte each ``.distcp`` file must hold. Raises for a pickle that is not whole,
    puts to a memo index beyond its size (:mod:`.memo_guard`), or whose shard records lack a file, an offset
    or a length."""
    data = handle.read()
    refuse_memo_bombs(data)
    reader = _MetadataReader(_Turns(data) if data[2:3] == _FRAME else io.BytesIO(data))
    collecting = gc.isenabled()
    gc.disable()  # the reader's million small objects would set off a collection every 700: 40 % of its time
    try:
        reader.load()
    finally:
        if collecting:
            gc.enable()
    states = [fields[0] if type(fields) is tuple and fields else fields for fields in reader.shard_records]
    if not {*map(type, states)} <= {dict}:
        raise ValueError("a shard record without a file, offset and length")
    paths, offsets, lengths = ([*map(dict.get, states, itertools.repeat(key))]
                               for key in ("relative_path", "offset", "length"))
    if not ({*map(type, paths)} <= {str} and {*map(type, offsets), *map(type, lengths)} <= {int}
            and min(offsets, default=0) >= 0 and min(lengths, default=0) >= 0):
        raise ValueError("a shard record without a file, offset and length")
    # ordered by end, so each file keeps its furthest one
    return dict(sorted(zip(paths, map(operator.add, offsets, lengths)), key=operator.itemgetter(1)))


def _size(stat_of: Callable[[str], os.stat_result], path: str) -> int | None:
    try:
        return stat_of(path).st_size
    except FileNotFoundError:
        return None


def distcp_metadata(path: str, deep: bool = False, stat_of: Callable[[str], os.stat_result] = os.stat) -> str | None:
    """torch.distributed.checkpoint's ``.metadata``: a whole pickle (PROTO ... STOP) whose shard records
    (file, offset, length) all lie inside the ``.distcp`` files beside it (their sizes by ``stat_of``). Read by
    stand-ins, never unpickled."""
    with open_regular(path) as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(0)
        head = handle.read(2)
        handle.seek(-1, os.SEEK_END)
        tail = handle.read(1)
        if head[:1] != b"\x80" or tail != b".":
            return "pickle framing broken (truncated)"
        if size > _METADATA_LIMIT:
            return f"{size} bytes: implausibly large for checkpoint metadata"
        handle.seek(0)
        try:
            extents = storage_extents(handle)
        except Exception as exc:  # the unpickler and the checks raise UnpicklingError, EOFError, ValueError ...
            return f"pickle opcodes broken: {type(exc).__name__}: {str(exc)[:120]}"
    shards = sorted(extents.items())
    outside = next((relative for relative, _ in shards if not is_inside(relative)), None)
    if outside is not None:
        return f"names shard file {outside[:80]!r}, outside the checkpoint"
    directory = os.path.dirname(path)
    sizes = each(lambda relative: _size(stat_of, os.path.join(directory, relative)),
                 [relative for relative, _ in shards])
    for (relative, end), actual in zip(shards, sizes):
        if actual is None:
            return f"names shard file {relative}, which is missing"
        if actual < end:
            return f"{relative} holds {actual} bytes, its shards need {end} (truncated)"
    return None
