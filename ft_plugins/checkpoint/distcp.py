"""torch.distributed.checkpoint's ``.metadata``: where every shard lies, read without importing anything.

The file is a pickle of DCP's ``Metadata``. It is read by the C unpickler restricted so that every class
it names is replaced by :class:`_Inert`, an empty class of this module: no module is imported, no callable
of the file's choosing runs, nothing but plain data and one inert object is built. The stand-in for
``_StorageInfo`` keeps the state it is given (file, offset, length), which is all the check needs.

A large file is walked in a process of its own (:func:`walk_descriptor`, begun by :class:`MetadataWalk`): at
10,000 ranks the walk is a second of CPU or more, which in the checking process would hold the interpreter lock
the check's threads wait for, and which a check can begin before it stats the other files.
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
from ft_plugins.checkpoint.reading import is_inside, open_regular, read_at
from ft_plugins.launch import HELPER_CWD, helper_env  # here, not at the call: an import there could wait on a lock

_METADATA_LIMIT = 256 << 20  # a .metadata describes shards: megabytes even for large models
_FRAME = b"\x95"  # after PROTO 4 or 5: a framed pickle
_APART = 4 << 20  # bytes from which the walk runs in a process of its own: 0.1 s of CPU here, a process 0.04 s
_CHILD = "from ft_plugins.checkpoint.distcp import walk_descriptor; walk_descriptor()"
_MEMORY_PER_BYTE = 48  # what a walk apart may take for each byte of the pickle: an honest DCP .metadata takes 15
_MEMORY_SLACK = 256 << 20


class _Nothing:
    """What every stand-in builds: one object for all, which takes any state and any items and keeps nothing, so
    the unpickler's memo keeps no object alive for it (a quarter less memory at 10,000 ranks). Its state goes to
    ``callable``, a C function that looks at nothing."""

    __slots__ = ()
    __setstate__ = staticmethod(callable)

    # filled by SETITEMS / APPENDS / ADDITEMS when the file built a mapping, list or set subclass
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


_NOTHING = _Nothing()


def _giving(built: _Nothing) -> Callable[..., _Nothing]:
    """A stand-in's ``__new__``: ``built``, whatever the arguments."""
    return lambda *args, **kwargs: built


class _Inert:
    """What a pickle names, a class or a function, stood in for: called or instantiated with any arguments, it
    gives the one :data:`_NOTHING`."""

    __slots__ = ()
    __new__ = _giving(_NOTHING)


class _MetadataReader(pickle.Unpickler):
    """The C unpickler with every global replaced by an inert stand-in: linear, at C speed, importing nothing."""

    def __init__(self, handle: IO[bytes] | _Turns) -> None:
        super().__init__(handle)
        self.shard_records: list[Any] = []
        # the one stand-in whose states are kept: appended as they come, without a Python call
        keeper = type("_Kept", (_Nothing,), {"__slots__": (), "__setstate__": staticmethod(self.shard_records.append)})
        self._shard_record = type("_StorageInfo", (_Inert,), {"__slots__": (), "__new__": _giving(keeper())})

    def find_class(self, module: str, name: str) -> Callable[..., Any]:
        named = f"{module}.{name}"
        if named == "torch.Size":
            # every offset and size is one, built from its tuple: ``len`` stands in at C speed where a stand-in's
            # constructor is a Python call (0.2-0.3 s of the walk at 10,000 ranks), and copies nothing (``tuple`` would
            # copy a list or string given in its place, as often as the file asks)
            return len
        return self._shard_record if named.endswith("._StorageInfo") else _Inert

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
        return _extents(_read(data).shard_records)  # the reader, its memo and its stand-ins gone before
    finally:
        if collecting:
            gc.enable()


class WalkRefused(ValueError):
    """The pickle refused by the walk in a process of its own; its message names the error there."""


def walk_descriptor() -> None:
    """The process of its own: :func:`storage_extents` of the file open as descriptor ``argv[1]``, its first
    ``argv[2]`` bytes, as JSON on stdout, or the reason it was refused. Here the system bounds the walk's memory
    (:func:`_bound_memory`) where the memo pass does in the checking process: the pass runs only to name why a
    walk ran out of memory (a second of CPU saved at 10,000 ranks). The process ends without freeing what the
    walk built (another third of a second)."""
    data = read_at(int(sys.argv[1]), int(sys.argv[2]), 0)
    try:
        if _bound_memory(len(data)):
            gc.disable()  # for good: the process ends with the walk
            reader = _read_bounded(data)
            answer = {"extents": _extents(reader.shard_records)}
        else:
            answer = {"extents": storage_extents(data)}
    except Exception as exc:  # the unpickler and the checks raise UnpicklingError, EOFError, ValueError ...
        answer = {"refused": _why(exc)}
    json.dump(answer, sys.stdout)
    sys.stdout.flush()
    os._exit(0)


def _bound_memory(size: int) -> bool:
    """Limit this process's address space to what it holds now and what a walk of ``size`` bytes may take; False
    where the system cannot tell or set it (Linux's /proc and RLIMIT_AS), and then the memo pass bounds the walk."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            held = int(statm.read().split()[0]) * resource.getpagesize()
        limit = held + _MEMORY_PER_BYTE * size + _MEMORY_SLACK
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError, IndexError):
        return False
    return True


def _read_bounded(data: bytes) -> _MetadataReader:
    """:func:`_read` under a bound on memory: running out of it is named by the memo pass when a memo index
    beyond the pickle asked for it, else by the bound."""
    try:
        return _read(data)
    except MemoryError:
        pass  # out of the handler: what the walk built is freed before the pass runs
    refuse_memo_bombs(data)
    raise ValueError(f"reading it takes more memory than {_MEMORY_PER_BYTE} bytes for each of its bytes")


def _walk_apart(descriptor: int, size: int) -> subprocess.Popen[bytes] | None:
    """The walk of the file open as ``descriptor`` started in a process of its own, on another core beside the
    check's threads, reading the file itself; None when no interpreter could start."""
    try:
        return subprocess.Popen([sys.executable, "-c", _CHILD, str(descriptor), str(size)], pass_fds=(descriptor,),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=HELPER_CWD, env=helper_env(os.environ))
    except OSError:
        return None


def _answer(child: subprocess.Popen[bytes]) -> dict[str, int] | None:
    """The extents a walk apart found, None when it ended without its answer; raises WalkRefused. One read, a
    single wait without the interpreter lock (communicate() would take the lock again for every 4 KB, in turn
    with every thread of the check)."""
    with child:
        try:
            answer = json.loads(child.stdout.read())  # type: ignore[union-attr]
        except (OSError, ValueError):
            return None
    if "refused" in answer:
        raise WalkRefused(answer["refused"])
    return answer["extents"]


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:120]}"


def _read(data: bytes) -> _MetadataReader:
    """The pickle read by stand-ins: its shard records' states in ``shard_records``."""
    reader = _MetadataReader(_Turns(data) if data[2:3] == _FRAME else io.BytesIO(data))
    reader.load()
    return reader


def _extents(records: list[Any]) -> dict[str, int]:
    states = [fields[0] if type(fields) is tuple and fields else fields for fields in records]
    if not {*map(type, states)} <= {dict}:
        raise ValueError("a shard record without a file, offset and length")
    paths, offsets, lengths = ([*map(dict.get, states, itertools.repeat(key))]
                               for key in ("relative_path", "offset", "length"))
    if not ({*map(type, paths)} <= {str} and {*map(type, offsets), *map(type, lengths)} <= {int}
            and min(offsets, default=0) >= 0 and min(lengths, default=0) >= 0):
        raise ValueError("a shard record without a file, offset and length")
    furthest: dict[str, int] = {}
    for path, end in zip(paths, map(operator.add, offsets, lengths)):
        if end > furthest.get(path, -1):
            furthest[path] = end
    return furthest


def _size(stat_of: Callable[[str], os.stat_result], path: str) -> int | None:
    try:
        return stat_of(path).st_size
    except FileNotFoundError:
        return None


class MetadataWalk:
    """A ``.metadata`` opened and its walk begun: a large one's in a process of its own that reads the file
    through the descriptor opened here, so that a check can begin it before it stats the other files and the
    walk runs beside them; a small one is walked here when its problem is asked. Close it (a ``with`` block):
    a walk apart whose answer was not asked for is ended."""

    def __init__(self, path: str) -> None:
        self._handle = open_regular(path)
        self._child: subprocess.Popen[bytes] | None = None
        try:
            size = self._handle.seek(0, os.SEEK_END)
            self._handle.seek(0)
            head = self._handle.read(2)
            self._handle.seek(-1, os.SEEK_END)
            tail = self._handle.read(1)
            self.found = (("pickle framing broken (truncated)" if head[:1] != b"\x80" or tail != b"." else None)
                          or (f"{size} bytes: implausibly large for checkpoint metadata"
                              if size > _METADATA_LIMIT else None))  # what refuses the file unwalked
            if self.found is None and size >= _APART:
                self._child = _walk_apart(self._handle.fileno(), size)
        except BaseException:
            self.close()
            raise

    def extents(self) -> dict[str, int]:
        """:func:`storage_extents` of the file: the answer of the walk apart, or else walked here."""
        child, self._child = self._child, None
        extents = _answer(child) if child is not None else None
        if extents is None:
            self._handle.seek(0)
            extents = storage_extents(self._handle.read())
        return extents

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child.stdout.close()  # type: ignore[union-attr]
            self._child = None
        self._handle.close()

    def __enter__(self) -> MetadataWalk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def distcp_metadata(path: str, deep: bool = False, stat_of: Callable[[str], os.stat_result] = os.stat,
                    walk: MetadataWalk | None = None) -> str | None:
    """torch.distributed.checkpoint's ``.metadata``: a whole pickle (PROTO ... STOP) whose shard records
    (file, offset, length) all lie inside the ``.distcp`` files beside it (their sizes by ``stat_of``). Read by
    stand-ins, never unpickled. ``walk``: its walk begun earlier by the check (else begun here)."""
    with walk or MetadataWalk(path) as begun:
        if begun.found is not None:
            return begun.found
        try:
            extents = begun.extents()
        except WalkRefused as exc:
            return f"pickle opcodes broken: {exc}"
        except OSError:
            raise  # unreadable, as the probe says
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
