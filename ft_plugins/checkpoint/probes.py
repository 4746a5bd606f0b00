"""Structural checks of single checkpoint files that never unpickle or load tensors.

Each probe returns ``None`` for a sound file or a short reason. The fast form reads only what
locates the data (a zip central directory, a safetensors header, protobuf field headers); the
deep form also reads the data (zip CRCs, nested protobuf framing).
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Callable

Probe = Callable[[str, bool], "str | None"]

_SAFETENSORS_HEADER_LIMIT = 100 << 20


def torch_zip(path: str, deep: bool = False) -> str | None:
    """A ``torch.save`` archive: a zip whose central directory is whole and whose members lie inside it."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if not any(info.filename.endswith("data.pkl") for info in members):
                return "zip archive without data.pkl: not a torch.save file"
            directory_start = archive.start_dir
            for info in members:
                if info.header_offset + info.compress_size > directory_start:
                    return f"member {info.filename} runs past the archive's data (truncated)"
            if deep:
                bad = archive.testzip()
                if bad is not None:
                    return f"member {bad} fails its CRC check"
    except zipfile.BadZipFile as exc:
        return f"not a readable torch zip archive ({exc}; truncated or not written by torch.save)"
    except (OSError, EOFError) as exc:
        return f"unreadable: {exc}"
    return None


def safetensors(path: str, deep: bool = False) -> str | None:
    """A safetensors file: an 8-byte header length, a JSON header, and data that ends exactly at EOF."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header (truncated)"
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _SAFETENSORS_HEADER_LIMIT):
            return f"safetensors header length {length} exceeds the file (truncated or not safetensors)"
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            return "safetensors header is not valid JSON"
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1]):
            return f"safetensors entry {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return f"safetensors data should end at byte {8 + length + end}, file has {size} (truncated or padded)"
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("varint runs past the end")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _framing(data: bytes, nested: bool) -> str | None:
    """Walk protobuf fields of ``data``; each must end exactly where the next begins."""
    position = 0
    fields = 0
    try:
        while position < len(data):
            key, position = _varint(data, position)
            wire = key & 7
            if key >> 3 == 0:
                return f"field number 0 at byte {position}"
            if wire == 0:
                _, position = _varint(data, position)
            elif wire == 1:
                position += 8
            elif wire == 5:
                position += 4
            elif wire == 2:
                length, position = _varint(data, position)
                if nested and key >> 3 == 1:
                    inner = _framing(data[position:position + length], nested=False)
                    if inner:
                        return inner
                position += length
            else:
                return f"unknown protobuf wire type {wire} at byte {position}"
            if position > len(data):
                return "last protobuf field runs past the end (truncated)"
            fields += 1
    except ValueError as exc:
        return f"broken protobuf framing: {exc}"
    return None if fields else "no protobuf fields"


def mindspore_ckpt(path: str, deep: bool = False) -> str | None:
    """A MindSpore ``.ckpt``: protobuf ``Checkpoint`` messages whose framing ends exactly at EOF."""
    with open(path, "rb") as handle:
        data = handle.read()
    reason = _framing(data, nested=deep)
    return f"not a sound MindSpore checkpoint: {reason}" if reason else None


def json_file(path: str, deep: bool = False) -> str | None:
    try:
        with open(path, "rb") as handle:
            json.loads(handle.read())
    except (ValueError, UnicodeDecodeError):
        return "not valid JSON (truncated or garbage)"
    return None


def pickle_framing(path: str, deep: bool = False) -> str | None:
    """A pickle written whole starts with the PROTO opcode and ends with STOP; checked, never loaded."""
    with open(path, "rb") as handle:
        head = handle.read(2)
        handle.seek(-1, os.SEEK_END)
        tail = handle.read(1)
    if head[:1] != b"\x80" or tail != b".":
        return "pickle framing broken (truncated)"
    if deep:
        import pickletools

        with open(path, "rb") as handle:
            try:
                for _ in pickletools.genops(handle):  # opcode parsing only: nothing is constructed
                    pass
            except Exception as exc:  # pickletools raises ValueError and friends on garbage
                return f"pickle opcodes broken: {exc}"
    return None


def present(path: str, deep: bool = False) -> str | None:
    """Files with no inner structure to check (raw tensor bytes): non-empty is all we can say."""
    return None


BY_SUFFIX: dict[str, Probe] = {
    ".pt": torch_zip, ".pth": torch_zip, ".bin": torch_zip, ".tar": torch_zip,  # torch.save's .pth.tar habit
    ".safetensors": safetensors, ".ckpt": mindspore_ckpt, ".json": json_file, ".metadata": pickle_framing,
}


def probe(path: str, deep: bool = False) -> str | None:
    """Reason the file is not sound, or None: missing, empty, then the probe its suffix calls for."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable: {exc}"
    if size == 0:
        return "empty (0 bytes)"
    name = os.path.basename(path)
    check = BY_SUFFIX.get(os.path.splitext(name)[1] or name, present)
    try:
        return check(path, deep)
    except OSError as exc:
        return f"unreadable: {exc}"
