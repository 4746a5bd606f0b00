"""Every rank's word on the checkpoint to resume, for :mod:`ft_plugins.checkpoint.agreed`: one MindSpore
all-gather of a few integers (AllGather runs on every backend, CPU included, where AllReduce on CPU only sums)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ft_plugins.checkpoint.agreed import Gather


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
