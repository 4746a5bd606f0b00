"""The hand-over of the survivors' RNG files to the writer of a Trainer dump, on a real TCPStore in this
process: a survivor late by less than the bound is in the checkpoint, a lost rank costs the bound and no
more, and its file is the writer's."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist

from ft_plugins.torch.hf import rng_files

KEY = "ft_plugins/hf/ttp/0/5"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    """The default group's kind of store (a prefix over torchrun's TCPStore), standing in for it."""
    served = dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5)))
    monkeypatch.setattr(rng_files, "_store", lambda: served)
    return served


class Clock:
    """``time`` for :mod:`rng_files`: a clock that moves only when the gather sleeps, so what it waits is counted
    exactly, whatever the machine's load; ``then`` runs once the clock reaches its time (a survivor's late offer)."""

    def __init__(self, then: tuple[float, Callable[[], object]] | None = None) -> None:
        self.now, self.then = 0.0, then

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.then is not None and self.now >= self.then[0]:
            self.then[1]()
            self.then = None


def test_a_late_survivor_is_waited_for_and_a_lost_rank_costs_the_bound(
        store: dist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock((0.3, lambda: rng_files.offer(KEY, 1, b"rank 1")))
    monkeypatch.setattr(rng_files, "time", clock)
    assert rng_files.gather(KEY, 3, 0, 1.0) == {1: b"rank 1"}
    assert 1.0 <= clock.now < 1.0 + rng_files._POLL + 1e-9  # to the bound, and not a poll past it


def test_with_every_survivor_posted_there_is_no_wait(store: dist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in (1, 2):
        rng_files.offer(KEY, rank, f"rank {rank}".encode())
    clock = Clock()
    monkeypatch.setattr(rng_files, "time", clock)
    assert rng_files.gather(KEY, 3, 0, 10.0) == {1: b"rank 1", 2: b"rank 2"}
    assert clock.now == 0.0  # never slept


def test_a_lost_ranks_file_is_a_copy_of_the_writers(tmp_path: Path) -> None:
    (tmp_path / "rng_state_2.pth").write_bytes(b"rank 2")  # the writer's own, written with the checkpoint
    assert rng_files.write_files(str(tmp_path), {0: b"rank 0"}, 3, 2) == [1]
    assert [(tmp_path / f"rng_state_{rank}.pth").read_bytes() for rank in range(3)] == [b"rank 0", b"rank 2", b"rank 2"]
