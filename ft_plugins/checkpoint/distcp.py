"""torch.distributed.checkpoint's ``.metadata``: where every shard lies, read without importing anything.

The file is a pickle of DCP's ``Metadata``. It is read by the C unpickler restricted so that every class
it names is replaced by :class:`_Inert`, an empty class of this module: no module is imported, no callable
of the file's choosing runs, nothing but plain data and inert stand-ins is built. The stand-in for
``_StorageInfo`` keeps the state it is given (file, offset, length), which is all the check needs.

A large file is walked in a process of its own (:func:`walk_stdin`): at 10,000 ranks the walk is half a second
of CPU, which in the checking process would hold the interpreter lock the check's threads wait for.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import operator
import os
import pickle
import subprocess
import sys
from typing import IO, Any, Callable

from ft_plugins.checkpoint.memo_guard import refuse_memo_bombs
from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import is_inside, open_regular
from ft_plugins.launch import HELPER_CWD, helper_env  # here, not at the call: an import there could wait on a lock

_METADATA_LIMIT = 256 << 20  # a .metadata describes shards: megabytes even for large models
_FRAME = b"\x95"  # after PROTO 4 or 5: a framed pickle
_APART = 4 << 20  # bytes from which the walk runs in a process of its own: 0.1 s of CPU here, a process 0.04 s
_CHILD = "from ft_plugins.checkpoint.distcp import walk_stdin; walk_stdin()"


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


def storage_extents(data: bytes) -> dict[str, int]:
    """The end of the last byte each ``.distcp`` file must hold, by the pickle ``data``. Raises for a pickle that
    is not whole, puts to a memo index beyond its size (:mod:`.memo_guard`), or whose shard records lack a file,
    an offset or a length."""
    refuse_memo_bombs(data)
    collecting = gc.isenabled()
    # the reader's million small objects would set off a collection every 700 (40 % of its time), and collection
    # turned back on while they live would go over all of them once more (as long as the walk): off until gone
    gc.disable()
    try:
        return _extents(_shard_records(data))
    finally:
        if collecting:
            gc.enable()


class WalkRefused(ValueError):
    """The pickle refused by the walk in a process of its own; its message names the error there."""


def walk_stdin() -> None:
    """The process of its own: :func:`storage_extents` of the pickle on stdin, as JSON on stdout, or the reason
    it was refused."""
    try:
        answer = {"extents": storage_extents(sys.stdin.buffer.read())}
    except Exception as exc:  # the unpickler and the checks raise UnpicklingError, EOFError, ValueError ...
        answer = {"refused": _why(exc)}
    json.dump(answer, sys.stdout)


def _walked_apart(data: bytes) -> dict[str, int] | None:
    """:func:`storage_extents` of ``data`` in a process of its own, on another core beside the check's threads;
    None when no such process ran to its answer (then the walk runs here). Raises WalkRefused."""
    try:
        # one write and one read, each a single wait without the interpreter lock (communicate() would take the
        # lock again for every 4 KB, in turn with every thread of the check)
        with subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, cwd=HELPER_CWD, env=helper_env(os.environ)) as child:
            with child.stdin:
                child.stdin.write(data)
            answer = json.loads(child.stdout.read())
    except (OSError, ValueError):  # no interpreter to start, or it died before its answer
        return None
    if "refused" in answer:
        raise WalkRefused(answer["refused"])
    return answer["extents"]


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:120]}"


def _shard_records(data: bytes) -> list[Any]:
    """The states of the pickle's shard records; the reader, its memo and every stand-in are gone on return."""
    reader = _MetadataReader(_Turns(data) if data[2:3] == _FRAME else io.BytesIO(data))
    reader.load()
    return reader.shard_records


def _extents(records: list[Any]) -> dict[str, int]:
    states = [fields[0] if type(fields) is tuple and fields else fields for fields in records]
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
        data = handle.read()
    try:
        extents = _walked_apart(data) if len(data) >= _APART else None
        if extents is None:
            extents = storage_extents(data)
    except WalkRefused as exc:
        return f"pickle opcodes broken: {exc}"
    except Exception as exc:  # the unpickler and the checks raise UnpicklingError, EOFError, ValueError ...
        return f"pickle opcodes broken: {_why(exc)}"
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
