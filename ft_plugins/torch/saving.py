"""``torch.save`` of a dump in about the time of the write alone: the same archive, its CRC-32s computed faster.

``torch.save`` computes each record's CRC-32 (miniz's, a byte table) before it writes the record, which is more than
half of its time on a state in memory (0.45 s/GB with, 0.24 s/GB without, on our CPU machines). The archive here is
written by torch's own writer with its CRCs off, each record's CRC-32 computed as the record goes to the writer by
zlib-ng's (carry-less multiplication on x86-64, the CRC instructions on Arm: 0.05 s/GB here, against 0.25 s/GB for
Python's zlib, used where zlib-ng is missing), and the two places torch's archive keeps each (a data descriptor after
the record, the central directory at the end) filled in before the file is handed back: byte for byte
``torch.save``'s archive but for the random serialization id every archive gets. Where this torch's writer is not
the one this was made for, or the archive is not laid out as expected, ``torch.save`` writes the file instead.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import pickle
import struct
import time
import zipfile
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_DESCRIPTOR = b"PK\x07\x08"
_ENTRY = b"PK\x01\x02"
ARCHIVE_WRITER = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")  # torch's _save


def _fastest_crc32() -> Callable[[Any], int]:
    try:
        from zlib_ng import zlib_ng
    except ImportError:  # a platform zlib-ng has no wheel for
        return zlib.crc32
    return zlib_ng.crc32


CRC32 = _fastest_crc32()  # imported with the dump's glue: after a SIGTERM, the import cost a small dump half its time


class LayoutError(Exception):
    """The archive is not laid out as the CRCs' fill-in expects (a torch whose writer changed)."""


def save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, its CRC-32s computed by zlib-ng (see the module's docstring)."""
    import torch

    serialization = torch.serialization
    try:
        write_archive = serialization._save
        if not _takes_archive_writer_arguments(write_archive):
            raise TypeError(f"torch.serialization._save{inspect.signature(write_archive)}")
        writer = torch._C.PyTorchFileWriter(path, False, serialization._get_storage_alignment())
    except (AttributeError, TypeError, RuntimeError):  # not the writer this was made for: torch's own save
        torch.save(obj, path)
        return
    recorded = _Recorded(writer, CRC32)
    write_archive(obj, recorded, pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    crcs = recorded.crcs
    del writer, recorded  # closes the file
    try:
        fill_in_crcs(path, crcs)
    except LayoutError:
        torch.save(obj, path)


@contextmanager
def timed_writes() -> Iterator[list[tuple[float, int]]]:
    """Every ``torch.save`` to a file while the block runs, as (seconds, bytes): the write alone, without what a
    save does around it (the optimizer's gather, barriers waiting for the slowest rank), whose time says nothing of
    the file system's speed."""
    import torch

    writes: list[tuple[float, int]] = []
    original = torch.save

    def timed(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = original(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            writes.append((time.monotonic() - started, os.path.getsize(f)))
        return result

    torch.save = timed
    try:
        yield writes
    finally:
        if torch.save is timed:  # one patched over it meanwhile stays
            torch.save = original


def _takes_archive_writer_arguments(write_archive: Any) -> bool:
    """Whether torch's ``_save`` takes the five arguments given here (those after them have defaults)."""
    parameters = list(inspect.signature(write_archive).parameters.values())
    return (tuple(parameter.name for parameter in parameters[:len(ARCHIVE_WRITER)]) == ARCHIVE_WRITER
            and all(parameter.default is not parameter.empty for parameter in parameters[len(ARCHIVE_WRITER):]))


class _Recorded:
    """torch's archive writer, each record's CRC-32 computed from the bytes it hands to the file."""

    def __init__(self, writer: Any, crc32: Callable[[Any], int]) -> None:
        self._writer = writer
        self._crc32 = crc32
        self.crcs: dict[str, int] = {}

    def write_record(self, name: str, data: Any, size: int) -> None:
        self.crcs[name] = self._crc32(_bytes_of(data, size))
        self._writer.write_record(name, data, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def _bytes_of(data: Any, size: int) -> memoryview:
    """The bytes ``PyTorchFileWriter.write_record`` writes for ``data``: a string's UTF-8, a buffer's, or a CPU
    storage's memory (torch's save copies any other device's storage to the CPU before it writes it)."""
    if isinstance(data, str):
        return memoryview(data.encode())[:size]
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).cast("B")[:size]
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(data.data_ptr())).cast("B")


def fill_in_crcs(path: str, computed: dict[str, int]) -> None:
    """Write each member's CRC-32 into its data descriptor and its central directory entry; a member with none in
    ``computed`` (the records torch's writer adds as it ends the file) is read back, small as they are."""
    with open(path, "r+b") as handle:
        try:
            archive = zipfile.ZipFile(handle)
        except zipfile.BadZipFile as exc:
            raise LayoutError(str(exc)) from None
        members, directory_at = archive.infolist(), archive.start_dir
        end = handle.seek(0, os.SEEK_END)
        handle.seek(directory_at)
        directory = bytearray(handle.read(end - directory_at))
        entry = 0
        for member in members:
            if directory[entry:entry + 4] != _ENTRY or member.compress_type:
                raise LayoutError(f"{member.filename}: not a stored member where the central directory says")
            names, extra, comment = struct.unpack_from("<HHH", directory, entry + 28)
            at, entry = entry, entry + 46 + names + extra + comment
            if member.file_size == 0:
                continue  # the CRC-32 of nothing is 0, and torch writes such a record without a descriptor
            if member.flag_bits & 0x08 == 0:
                raise LayoutError(f"{member.filename}: no data descriptor")
            crc = computed.get(member.filename.partition("/")[2])
            if crc is None:
                crc = zlib.crc32(_member_bytes(handle, member))
            struct.pack_into("<I", directory, at + 16, crc)
            descriptor = _data_end(handle, member)
            handle.seek(descriptor)
            if handle.read(4) != _DESCRIPTOR:
                raise LayoutError(f"{member.filename}: no data descriptor after its data")
            handle.write(struct.pack("<I", crc))
        handle.seek(directory_at)
        handle.write(directory)


def _data_end(handle: Any, member: zipfile.ZipInfo) -> int:
    handle.seek(member.header_offset + 26)
    names, extra = struct.unpack("<HH", handle.read(4))
    return member.header_offset + 30 + names + extra + member.compress_size


def _member_bytes(handle: Any, member: zipfile.ZipInfo) -> bytes:
    handle.seek(_data_end(handle, member) - member.compress_size)
    return handle.read(member.compress_size)
