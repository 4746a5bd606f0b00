"""torch.distributed.checkpoint's ``.metadata``: where every shard lies, read without importing anything.

The file is a pickle of DCP's ``Metadata``. It is read by the C unpickler restricted so that every class
it names is replaced by :class:`_Inert`, an empty class of this module: no module is imported, no callable
of the file's choosing runs, nothing but plain data and inert stand-ins is built. The stand-in for
``_StorageInfo`` keeps the state it is given (file, offset, length), which is all the check needs.
"""

from __future__ import annotations

import os
import pickle
from typing import IO, Any

from ft_plugins.checkpoint.parallel import each
from ft_plugins.checkpoint.reading import is_inside, open_regular

_METADATA_LIMIT = 256 << 20  # a .metadata describes shards: megabytes even for large models


class _Inert:
    """What a pickle would construct, stood in for: accepts any arguments and state, keeps nothing."""

    records: list[Any] | None = None  # set on the one stand-in whose states are shard records

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if self.records is not None:
            self.records.append(state)

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

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__(handle)
        self.shard_records: list[Any] = []
        self._shard_record = type("_StorageInfo", (_Inert,), {"records": self.shard_records})

    def find_class(self, module: str, name: str) -> type:
        return self._shard_record if f"{module}.{name}".endswith("._StorageInfo") else _Inert

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not used by checkpoint metadata")


def storage_extents(handle: IO[bytes]) -> dict[str, int]:
    """The end of the last byte each ``.distcp`` file must hold. Raises for a pickle that is not whole
    or whose shard records lack a file, an offset or a length."""
    reader = _MetadataReader(handle)
    reader.load()
    extents: dict[str, int] = {}
    for state in reader.shard_records:
        fields = state[0] if isinstance(state, tuple) and state else state
        if not isinstance(fields, dict):
            raise ValueError("a shard record without a file, offset and length")
        path, offset, length = (fields.get(key) for key in ("relative_path", "offset", "length"))
        if not (isinstance(path, str) and type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise ValueError("a shard record without a file, offset and length")
        extents[path] = max(extents.get(path, 0), offset + length)
    return extents


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def distcp_metadata(path: str, deep: bool = False) -> str | None:
    """torch.distributed.checkpoint's ``.metadata``: a whole pickle (PROTO ... STOP) whose shard records
    (file, offset, length) all lie inside the ``.distcp`` files beside it. Read by stand-ins, never unpickled."""
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
    sizes = each(_size, [os.path.join(directory, relative) for relative, _ in shards])
    for (relative, end), actual in zip(shards, sizes):
        if actual is None:
            return f"names shard file {relative}, which is missing"
        if actual < end:
            return f"{relative} holds {actual} bytes, its shards need {end} (truncated)"
    return None
