"""Every rank's word on the checkpoint to resume, for :mod:`ft_plugins.checkpoint.agreed`: one MindSpore
all-gather of a few integers (AllGather runs on every backend, CPU included, where AllReduce on CPU only sums)."""

from __future__ import annotations

import os
from typing import Callable, Sequence

Gather = Callable[[Sequence[int]], list[tuple[int, ...]]]


def all_gather() -> Gather | None:
    """The all-gather over every rank; None where MindSpore's communication is not initialised or one process runs
    (the same answer on every rank of a job)."""
    from mindspore.communication.management import GlobalComm, get_group_size

    if not GlobalComm.INITED or get_group_size() == 1:
        return None

    def gather(values: Sequence[int]) -> list[tuple[int, ...]]:
        import numpy as np
        from mindspore import Tensor, ops

        rows = ops.AllGather()(Tensor(np.array(values, np.int32))).asnumpy().reshape(-1, len(values))
        return [tuple(int(value) for value in row) for row in rows]

    return gather


def own_directory(root: str, rank: int) -> str:
    """Where this rank's own files are: ``rank_N`` of a save directory with rank folders, else the directory."""
    try:
        with os.scandir(root) as entries:
            ranked = any(entry.name.startswith("rank_") and entry.is_dir() for entry in entries)
    except OSError:  # absent or unreadable here: this rank offers nothing
        return root
    return os.path.join(root, f"rank_{rank}") if ranked else root
