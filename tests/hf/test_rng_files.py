"""The hand-over of the survivors' RNG files to the writer of a Trainer dump, on a real TCPStore in this
process: a survivor late by less than the bound is in the checkpoint, a lost rank costs the bound and no
more, and its file is the writer's."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

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


def test_a_late_survivor_is_waited_for_and_a_lost_rank_costs_the_bound(store: dist.Store) -> None:
    late = threading.Timer(0.3, rng_files.offer, (KEY, 1, b"rank 1"))
    late.start()
    started = time.monotonic()
    files = rng_files.gather(KEY, 3, 0, started + 1.0)
    waited = time.monotonic() - started
    late.join()
    assert files == {1: b"rank 1"}
    assert 1.0 <= waited < 1.5


def test_with_every_survivor_posted_there_is_no_wait(store: dist.Store) -> None:
    for rank in (1, 2):
        rng_files.offer(KEY, rank, f"rank {rank}".encode())
    started = time.monotonic()
    assert rng_files.gather(KEY, 3, 0, started + 10.0) == {1: b"rank 1", 2: b"rank 2"}
    assert time.monotonic() - started < 1.0


def test_a_lost_ranks_file_is_a_copy_of_the_writers(tmp_path: Path) -> None:
    (tmp_path / "rng_state_2.pth").write_bytes(b"rank 2")  # the writer's own, written with the checkpoint
    assert rng_files.write_files(str(tmp_path), {0: b"rank 0"}, 3, 2) == [1]
    assert [(tmp_path / f"rng_state_{rank}.pth").read_bytes() for rank in range(3)] == [b"rank 0", b"rank 2", b"rank 2"]
