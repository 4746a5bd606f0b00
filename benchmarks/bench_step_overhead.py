"""Per-step cost of ft_plugins' Megatron hooks, against the same step unwrapped, in one run.

The step is a stand-in with megatron's ``train_step`` signature (it pulls one batch from the data
iterator like megatron's forward step does, then computes for ~5 ms); ft_plugins wraps it through
its public ``enable()`` exactly as it wraps the real one. Three variants, interleaved in rounds so
machine noise hits all alike:
  bare       the unwrapped step
  noop       all features on, no-op range backend (what runs where no profiler exists)
  recording  all features on, an in-memory mstx with torch_npu's signatures
Each figure is the fastest of the rounds (as timeit reports). Prints the added microseconds per step (measured on an empty step, where nothing hides them)
and the ratio of step times on the ~5 ms step.

    python benchmarks/bench_step_overhead.py [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import types

WORK_SECONDS = 0.005


def _install_stand_ins() -> types.ModuleType:
    """A minimal megatron.training and an in-memory torch_npu, before ft_plugins looks for them."""
    calls: list[tuple] = []
    ids = itertools.count(1)
    mstx = types.SimpleNamespace(
        range_start=lambda message, stream=None, domain="default": calls.append((message, stream)) or next(ids),
        range_end=lambda range_id, domain="default": calls.append((range_id,)),
        mark=lambda message, stream=None, domain="default": calls.append((message,)),
    )
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.npu = types.SimpleNamespace(mstx=mstx, current_stream=lambda: "stream")
    torch_npu.__spec__ = types.SimpleNamespace(name="torch_npu")
    sys.modules["torch_npu"] = torch_npu

    training = types.ModuleType("megatron.training.training")
    for name in ("megatron", "megatron.training", "megatron.training.checkpointing", "megatron.training.initialize"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["megatron.training.checkpointing"].save_checkpoint = lambda *a, **k: None
    sys.modules["megatron.training.initialize"].initialize_megatron = lambda *a, **k: None
    sys.modules["megatron.training.training"] = training
    training.calls = calls
    return training


def _make_step(work: float):
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None):
        next(data_iterator)
        if work:
            end = time.perf_counter() + work
            while time.perf_counter() < end:
                pass
        return {}, 0, False, False, 0, None, None, None

    return train_step


def _time_steps(step, steps: int) -> float:
    data = itertools.repeat(None)
    start = time.perf_counter()
    for iteration in range(steps):
        step(None, data, None, None, None, None, None, iteration=iteration)
    return (time.perf_counter() - start) / steps


def _options(doc: str) -> argparse.Namespace:
    """``--rounds`` and ``--steps``, what every per-step benchmark on this stand-in takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    return parser.parse_args()


def main() -> None:
    options = _options(__doc__)

    training = _install_stand_ins()
    os.environ["FT_PLUGINS_LOG"] = "error"
    import ft_plugins.torch as ft_torch

    variants = {}
    for name, backend in (("bare", None), ("noop", "noop"), ("recording", "torch_npu")):
        for work in (0.0, WORK_SECONDS):
            ft_torch.disable()
            training.train_step = _make_step(work)
            if backend:
                ft_torch.enable("mstx", mstx={"backend": backend})
            variants[(name, work)] = training.train_step
    ft_torch.disable()

    empty: dict[str, list[float]] = {name: [] for name in ("bare", "noop", "recording")}
    loaded: dict[str, list[float]] = {name: [] for name in empty}
    for _ in range(options.rounds):
        for name in empty:
            empty[name].append(_time_steps(variants[(name, 0.0)], options.steps * 10))
            loaded[name].append(_time_steps(variants[(name, WORK_SECONDS)], options.steps // 10 or 1))
        training.calls.clear()

    bare_empty = min(empty["bare"])  # the least-disturbed round, as timeit does
    bare_loaded = min(loaded["bare"])
    print(f"empty step, bare: {bare_empty * 1e6:.2f} us")
    for name in ("noop", "recording"):
        added = min(empty[name]) - bare_empty
        ratio = min(loaded[name]) / bare_loaded
        print(f"{name:9}: +{added * 1e6:.2f} us per step (step + dataloader ranges); "
              f"ratio on a {WORK_SECONDS * 1e3:.0f} ms step: {ratio:.4f}")


if __name__ == "__main__":
    main()
