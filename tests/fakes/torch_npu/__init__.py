"""Fake torch_npu: just what ft_plugins touches (npu.mstx, npu.current_stream), recording calls."""

from torch_npu import npu  # noqa: F401
