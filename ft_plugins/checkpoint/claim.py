"""One writer per file among processes that could all write it (survivors dumping the same replica): a claim file
next to it, taken atomically, naming the process that holds it.

A claim is a hard link to a file already holding the claimer's pid, so it is never seen empty. A claim held by a
process gone (a survivor SIGKILLed mid-write) does not keep the file from being written: the next generation
(``<claim>.1``, ``<claim>.2``, ...) is claimed instead, each generation by one process only, and a generation is
passed over only once its holder is gone. The claim names where its pid means something (the kernel's boot and the
pid namespace): a holder on another host or in another container, writing to the same shared storage, cannot be
judged from here and keeps its claim.
"""

from __future__ import annotations

import os

from ft_plugins.processes import alive, namespace


def _generation(claim: str, number: int) -> str:
    return claim if number == 0 else f"{claim}.{number}"


def _holder(path: str) -> tuple[int, str] | None:
    """The pid in a claim (0, no process, when it holds none) and where it was taken (empty: here, as a claim
    written before claims said where); None when it was released meanwhile."""
    try:
        with open(path) as handle:
            pid, _, where = handle.read().partition(" ")
    except FileNotFoundError:
        return None
    return (int(pid) if pid.strip().isdigit() else 0), where.strip()


def _gone(holder: tuple[int, str]) -> bool:
    pid, where = holder
    return (not where or where == namespace()) and not alive(pid)


def take(claim: str) -> int | None:
    """Claim the file for this process: the generation taken, or None when a running process holds the claim."""
    mine = f"{claim}.pid-{os.getpid()}"
    with open(mine, "w") as handle:
        handle.write(f"{os.getpid()} {namespace()}")
    try:
        number = 0
        while True:
            try:
                os.link(mine, _generation(claim, number))
                return number
            except FileExistsError:
                holder = _holder(_generation(claim, number))
                if holder is not None and not _gone(holder):
                    return None
                if holder is not None:  # gone: the next generation (one released meanwhile is tried again)
                    number += 1
    finally:
        os.unlink(mine)


def release(claim: str, taken: int) -> None:
    """Remove the generation taken and those below it, whose holders are gone."""
    for number in range(taken, -1, -1):
        try:
            os.unlink(_generation(claim, number))
        except FileNotFoundError:
            pass
