"""``torch.save`` of a dump in about the time of the write alone: the same archive, its CRC-32s computed beside it.

``torch.save`` computes each record's CRC-32 in the writing thread before it writes the record, which is more than
half of its time on a state in memory (0.45 s/GB with, 0.24 s/GB without, on our CPU machines). torch's archive
puts each record's CRC-32 in a data descriptor after the record and in the central directory at the end, so the
archive here is written by torch's own writer with CRCs off, while a pool of threads computes them from the same
bytes (``zlib.crc32`` runs without the interpreter lock, and so does torch's write), and the two places of each
are filled in before the file is handed back: byte for byte ``torch.save``'s archive but for the random
serialization id every archive gets. Where this torch's writer is not the one this was made for, or the archive
is not laid out as expected, ``torch.save`` writes the file instead.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import pickle
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

CHUNK = 32 << 20  # bytes of a record one thread takes at a time (a power of two): a large tensor's is shared out
_DESCRIPTOR = b"PK\x07\x08"
_ENTRY = b"PK\x01\x02"
_POLYNOMIAL = 0xEDB88320  # CRC-32's, reflected
ARCHIVE_WRITER = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")  # torch's _save


class LayoutError(Exception):
    """The archive is not laid out as the CRCs' fill-in expects (a torch whose writer changed)."""


def save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, its CRC-32s computed beside the write (see the module's docstring)."""
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
    with _Checksums() as checksums:
        write_archive(obj, _Recorded(writer, checksums), pickle, serialization.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
        del writer  # closes the file
        computed = checksums.results()
    try:
        fill_in_crcs(path, computed)
    except LayoutError:
        torch.save(obj, path)


def _takes_archive_writer_arguments(write_archive: Any) -> bool:
    """Whether torch's ``_save`` takes the five arguments given here (those after them have defaults)."""
    parameters = list(inspect.signature(write_archive).parameters.values())
    return (tuple(parameter.name for parameter in parameters[:len(ARCHIVE_WRITER)]) == ARCHIVE_WRITER
            and all(parameter.default is not parameter.empty for parameter in parameters[len(ARCHIVE_WRITER):]))


class _Recorded:
    """torch's archive writer, each record's bytes handed to the checksums as they go to the file."""

    def __init__(self, writer: Any, checksums: "_Checksums") -> None:
        self._writer = writer
        self._checksums = checksums

    def write_record(self, name: str, data: Any, size: int) -> None:
        self._checksums.add(name, data, size)
        self._writer.write_record(name, data, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class _Checksums:
    """CRC-32s of records computed in a pool of threads, a large record shared out in :data:`CHUNK` pieces."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) - 1)),
                                        thread_name_prefix="ft_plugins-crc")
        self._pending: dict[str, tuple[Any, list[Future[int]]]] = {}

    def __enter__(self) -> "_Checksums":
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)

    def add(self, name: str, data: Any, size: int) -> None:
        view = _bytes_of(data, size)
        head = size % CHUNK or min(size, CHUNK)  # the odd piece first: each after it shifts the CRC by CHUNK
        bounds = [(0, head), *((start, start + CHUNK) for start in range(head, size, CHUNK))]
        futures = [self._pool.submit(zlib.crc32, view[start:end]) for start, end in bounds]
        self._pending[name] = (data, futures)  # ``data`` kept: the view is into its memory

    def results(self) -> dict[str, int]:
        """Each record's CRC-32, by its name in the archive (without the archive's folder)."""
        done = {}
        for name, (_, futures) in self._pending.items():
            crc = futures[0].result()
            for future in futures[1:]:
                crc = _times(_zeros(CHUNK), crc) ^ future.result()
            done[name] = crc
        self._pending.clear()
        return done


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


def _times(matrix: tuple[int, ...] | list[int], vector: int) -> int:
    """A GF(2) 32x32 matrix (32 column words) times a 32-bit vector."""
    total, column = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[column]
        vector >>= 1
        column += 1
    return total


@functools.lru_cache(maxsize=None)
def _zeros(length: int) -> tuple[int, ...]:
    """The GF(2) operator that runs the CRC-32 register over ``length`` zero bytes (a power of two): applied to the
    CRC-32 of some bytes, xor the CRC-32 of ``length`` more, it gives the CRC-32 of both (zlib's ``crc32_combine``)."""
    operator = [_POLYNOMIAL] + [1 << bit for bit in range(31)]  # one zero bit
    for _ in range(length.bit_length() - 1 + 3):  # squared: 2, 4, ... 8 * length zero bits
        operator = [_times(operator, column) for column in operator]
    return tuple(operator)
