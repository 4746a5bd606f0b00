"""Structural checks of single checkpoint files that never unpickle or load tensors.

Each probe returns ``None`` for a sound file or a short reason. The fast form reads only what
locates the data (a zip's end records and central directory, a safetensors header, protobuf field
headers, a DCP pickle's shard records read by inert stand-ins: :mod:`.distcp`); the deep form also
reads the data (zip CRCs, nested protobuf framing).
Whatever a file claims, memory stays bounded: payloads are seeked over or streamed, headers are
capped, and only regular files are opened (never a device, a FIFO or a directory).
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zipfile
from typing import IO, Callable

from ft_plugins.checkpoint.distcp import MetadataWalk, distcp_metadata
from ft_plugins.checkpoint.reading import open_regular, read_json

Probe = Callable[[str, bool], "str | None"]

_SAFETENSORS_HEADER_LIMIT = 100 << 20
_ZIP_DIRECTORY_LIMIT = 256 << 20  # a central directory entry is ~100 bytes: millions of tensors
_ZIP_TAIL = 22 + 0xFFFF  # the end record plus the longest zip comment


def _zip_end_records(handle: IO[bytes], size: int) -> tuple[str | None, int]:
    """Check the zip end records against each other and the file; ``(reason, entry count)``."""
    handle.seek(max(0, size - _ZIP_TAIL))
    tail = handle.read(_ZIP_TAIL)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return "no zip end record (truncated or not a zip archive)", 0
    _, _, _, on_disk, entries, directory_size, directory_offset, _ = struct.unpack("<4s4H2LH", tail[at:at + 22])
    end = size - len(tail) + at
    locator = tail[at - 20:at] if at >= 20 else b""
    if locator[:4] == b"PK\x06\x07":
        (record_at,) = struct.unpack("<Q", locator[8:16])
        if record_at + 56 > end - 20:
            return "zip64 end record lies outside the archive (corrupt end records)", 0
        handle.seek(record_at)
        record = handle.read(56)
        if record[:4] != b"PK\x06\x06":
            return "zip64 end record missing where its locator points (corrupt end records)", 0
        wide = struct.unpack("<QQQQ", record[24:56])
        for narrow, value, sentinel in zip((on_disk, entries, directory_size, directory_offset), wide,
                                           (0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)):
            if narrow != sentinel and narrow != value:
                return "zip end records disagree with each other (corrupt end records)", 0
        on_disk, entries, directory_size, directory_offset = wide
        end = record_at
    if on_disk != entries:
        return "zip end record counts differ (multi-part or corrupt archive)", 0
    if directory_offset + directory_size != end:
        return (f"zip central directory recorded at bytes {directory_offset}..{directory_offset + directory_size}, "
                f"but the end records start at {end} (lying end record or truncated archive)"), 0
    if directory_size > _ZIP_DIRECTORY_LIMIT:
        return f"zip central directory of {directory_size} bytes is implausibly large", 0
    return None, entries


def torch_zip(path: str, deep: bool = False) -> str | None:
    """A ``torch.save`` archive: end records that agree with the file, a central directory that holds
    as many members as they say, members inside the data area, and ``data.pkl``."""
    try:
        with open_regular(path) as handle:
            reason, entries = _zip_end_records(handle, handle.seek(0, os.SEEK_END))
            if reason:
                return f"not a readable torch zip archive: {reason}"
            handle.seek(0)
            with zipfile.ZipFile(handle) as archive:
                members = archive.infolist()
                if len(members) != entries:
                    return f"zip end record counts {entries} members, the central directory holds {len(members)}"
                if not any(info.filename.endswith("data.pkl") for info in members):
                    return "zip archive without data.pkl: not a torch.save file"
                for info in members:
                    if info.header_offset + info.compress_size > archive.start_dir:
                        return f"member {info.filename} runs past the archive's data (truncated)"
                if deep:
                    bad = archive.testzip()
                    if bad is not None:
                        return f"member {bad} fails its CRC check"
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, ValueError, struct.error) as exc:
        return f"not a readable torch zip archive ({exc}; truncated or not written by torch.save)"
    except EOFError as exc:
        return f"unreadable: {exc}"
    return None


def safetensors(path: str, deep: bool = False) -> str | None:
    """A safetensors file: an 8-byte header length, a JSON header, and data that ends exactly at EOF."""
    with open_regular(path) as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(0)
        head = handle.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header (truncated)"
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _SAFETENSORS_HEADER_LIMIT):
            return f"safetensors header length {length} exceeds the file (truncated or not safetensors)"
        try:
            header = json.loads(handle.read(length))
        except (ValueError, RecursionError):
            return "safetensors header is not valid JSON"
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"safetensors entry {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return f"safetensors data should end at byte {8 + length + end}, file has {size} (truncated or padded)"
    return None


class ProtobufReader:
    """Protobuf field headers read from a file, payloads skipped by seeking: memory independent of size."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.position = 0

    def varint(self, end: int) -> int:
        value = shift = 0
        while True:
            if self.position >= end or shift > 63:
                raise ValueError("varint runs past the end")
            byte = self.handle.read(1)
            if not byte:
                raise ValueError("varint runs past the end of the file")
            self.position += 1
            value |= (byte[0] & 0x7F) << shift
            if not byte[0] & 0x80:
                return value
            shift += 7

    def skip(self, length: int) -> None:
        self.position += length
        self.handle.seek(self.position)

    def walk(self, end: int, nested: bool) -> str | None:
        """Each field must end exactly where the next begins, the last one exactly at ``end``."""
        fields = 0
        while self.position < end:
            key = self.varint(end)
            wire = key & 7
            if key >> 3 == 0:
                return f"field number 0 at byte {self.position}"
            if wire == 0:
                self.varint(end)
            elif wire in (1, 5):
                self.skip(8 if wire == 1 else 4)
            elif wire == 2:
                length = self.varint(end)
                if self.position + length > end:
                    return "last protobuf field runs past the end (truncated)"
                if nested and key >> 3 == 1:
                    inner = self.walk(self.position + length, nested=False)
                    if inner:
                        return inner
                else:
                    self.skip(length)
            else:
                return f"unknown protobuf wire type {wire} at byte {self.position}"
            if self.position > end:
                return "last protobuf field runs past the end (truncated)"
            fields += 1
        return None if fields else "no protobuf fields"


def mindspore_ckpt(path: str, deep: bool = False) -> str | None:
    """A MindSpore ``.ckpt``: protobuf ``Checkpoint`` messages whose framing ends exactly at EOF."""
    with open_regular(path) as handle:
        try:
            end = handle.seek(0, os.SEEK_END)
            handle.seek(0)
            reason = ProtobufReader(handle).walk(end, nested=deep)
        except ValueError as exc:
            reason = f"broken protobuf framing: {exc}"
    return f"not a sound MindSpore checkpoint: {reason}" if reason else None


def json_file(path: str, deep: bool = False) -> str | None:
    try:
        read_json(path)
    except ValueError as exc:
        return f"not valid JSON ({exc}; truncated or garbage)"
    return None


def present(path: str, deep: bool = False) -> str | None:
    """Files with no inner structure to check (raw tensor bytes): non-empty is all we can say."""
    return None


BY_SUFFIX: dict[str, Probe] = {
    ".pt": torch_zip, ".pth": torch_zip, ".bin": torch_zip, ".tar": torch_zip,  # torch.save's .pth.tar habit
    ".safetensors": safetensors, ".ckpt": mindspore_ckpt, ".json": json_file, ".metadata": distcp_metadata,
}


def _probe_of(path: str) -> Probe:
    name = os.path.basename(path)
    return BY_SUFFIX.get(os.path.splitext(name)[1] or name, present)


def walked(path: str) -> bool:
    """Whether the file's probe walks it (a DCP ``.metadata``): a check may begin that walk early
    (:class:`.distcp.MetadataWalk`) and hand it to :func:`probe`."""
    return _probe_of(path) is distcp_metadata


def probe(path: str, deep: bool = False, stat_of: Callable[[str], os.stat_result] = os.stat,
          walk: MetadataWalk | None = None) -> str | None:
    """Reason the file is not sound, or None: missing, not a regular file, empty, then the probe its
    suffix calls for. ``stat_of`` gives the kind and size of the file and of those it refers to (a check's
    one stat of each); ``walk``: the file's walk, begun already (:func:`walked`)."""
    try:
        status = stat_of(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if not stat.S_ISREG(status.st_mode):
        return "not a regular file (a directory, device or FIFO)"
    if status.st_size == 0:
        return "empty (0 bytes)"
    check = _probe_of(path)
    try:
        return distcp_metadata(path, deep, stat_of, walk) if check is distcp_metadata else check(path, deep)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
