"""The fire drills' pieces shared by the torch frameworks' drills (Megatron's, the Trainer's)."""

from __future__ import annotations

from ft_plugins import faults


def stuck_kernel(fault: faults.Fault) -> None:
    """A kernel that runs about ``fault.seconds`` on the current CUDA stream, queued without waiting for it: what a
    collective waiting for a lost peer is to the device (NCCL, HCCL), for the work queued after it (CUDA only:
    ``torch.cuda._sleep``, timed here against a short one)."""
    import torch

    if not torch.cuda.is_initialized():
        raise RuntimeError(f"at=device needs a CUDA device in use ({fault})")
    probe, start, end = 10_000_000, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles_per_second = probe / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(cycles_per_second * fault.seconds))
