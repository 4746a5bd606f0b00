"""Processes as Linux's ``/proc`` shows them: whether one still runs, and who its parent is.

Framework-neutral: ``ft-plugins run`` uses it to find what a launcher leaves behind, the MindSpore
dying gasp to see a worker of its node exit. Where there is no ``/proc``, nothing is found.
"""

from __future__ import annotations

import os


def status(pid: int) -> tuple[bool, int] | None:
    """(exited, parent pid) of ``pid``; None when there is no such process. An exited process stays (a
    zombie) until its parent collects it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0] in (b"Z", b"X"), int(fields[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (not exited, not a zombie)."""
    found = status(pid)
    return found is not None and not found[0]


def all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def namespace() -> str:
    """Where a pid names a process: this kernel's boot and this pid namespace. A pid read from a file another host
    or container wrote (shared storage) names nothing here; empty where ``/proc`` does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""
