"""A pickle's memo indices, bounded before the C unpickler sees them.

``PUT`` and ``LONG_BINPUT`` name the memo slot they fill, and the C unpickler grows its memo to twice
that index at once (16 bytes a slot, each one written): four bytes of a hostile file can ask for 64 GiB,
which a large-memory node may grant. Every other way to fill the memo takes the next slot, so no
pickle needs an index beyond its own length in bytes; one that names such an index is refused unread.
One pass over the opcodes finds them: runs of opcodes that carry no such index and no long length are
skipped by a regular expression (at C speed), the rest are read here.
"""

from __future__ import annotations

import functools
import re
import struct

_STOP, _PUT, _LONG_BINPUT = b".", b"p", b"r"
_LINES = {b"c": 2, b"i": 2}  # GLOBAL and INST take a module line and a name line; other text opcodes one
_LENGTHS = {-3: "<i", -4: "<I", -5: "<Q"}  # pickletools' counted arguments: 4-byte signed, unsigned, 8-byte


@functools.cache
def _opcodes() -> tuple[re.Pattern[bytes], dict[bytes, int]]:
    """The run of opcodes to skip (no argument, a fixed one, or one counted by a byte), and how wide each
    other opcode's argument is (pickletools' codes: -1 lines, -3/-4/-5 counted by 4 or 8 bytes)."""
    import pickletools

    fixed: dict[int, list[bytes]] = {}
    counted, others = [], {}
    for opcode in pickletools.opcodes:
        code = opcode.code.encode("latin-1")
        width = opcode.arg.n if opcode.arg else 0
        if code in (_STOP, _PUT, _LONG_BINPUT) or width in (-1, -3, -4, -5):
            others[code] = width
        elif width == -2:
            counted.append(code)
        else:
            fixed.setdefault(width, []).append(code)
    codes = lambda group: b"[" + b"".join(re.escape(code) for code in group) + b"]"  # noqa: E731
    parts = [codes(group) + (b"." * width if width else b"+") for width, group in sorted(fixed.items())]
    lengths = b"|".join(re.escape(bytes([length])) + b".{%d}" % length for length in range(256))
    parts.append(codes(counted) + b"(?:" + lengths + b")")
    # a bounded run, not a possessive one (Python 3.11 and later): what a run may backtrack to stays small
    return re.compile(b"(?:" + b"|".join(parts) + b"){0,4096}", re.DOTALL), others


def refuse_memo_bombs(data: bytes) -> None:
    """Raise ValueError when the pickle in ``data`` puts to a memo index beyond its own length; a pickle
    that is broken otherwise is left to the unpickler to refuse."""
    run, others = _opcodes()
    position, end = 0, len(data)
    while position < end:
        skipped = run.match(data, position).end()
        if skipped > position:
            position = skipped
            continue
        code = data[position:position + 1]
        if code in (_STOP, b"") or code not in others:
            return  # the end, or an opcode the unpickler refuses
        if code == _LONG_BINPUT:
            index, position = int.from_bytes(data[position + 1:position + 5], "little"), position + 5
        elif others[code] == -1:
            first = position + 1
            for _ in range(_LINES.get(code, 1)):
                position = data.find(b"\n", position + 1)
                if position < 0:
                    return
            index = _decimal(data[first:position]) if code == _PUT else 0
            position += 1
        else:
            form = _LENGTHS[others[code]]
            if position + 1 + struct.calcsize(form) > end:
                return
            (length,) = struct.unpack_from(form, data, position + 1)
            index, position = 0, position + 1 + struct.calcsize(form) + max(length, 0)
        if index >= end:
            raise ValueError(f"memo index {index} beyond the pickle's {end} bytes (the unpickler would set "
                             f"aside {index * 16} bytes for it)")


def _decimal(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        return 0  # the unpickler refuses it
