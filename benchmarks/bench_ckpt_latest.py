"""Choosing the newest intact checkpoint: ft_plugins against the vendor guide's approach, in one run.

A synthetic Megatron save directory (legacy torch format) of ITERATIONS x RANKS small but real
``torch.save`` files, with the tracker on the newest iteration and the newest BROKEN iterations
each holding one truncated rank file. Timed, median of --runs, warm page cache for both:
  ft_plugins  ``find_latest(DIR)``: names, then the newest candidates' files probed (zip central
              directories), stopping at the first intact one
  vendor      glob every checkpoint file, sort by mtime (newest first), then load each checkpoint's
              files in turn with ``torch.load(weights_only=True)`` until one loads completely
The same choice is checked for both. A second directory with a tenth of the history shows the
cost follows the candidates examined, not the history.

    python benchmarks/bench_ckpt_latest.py [--iterations 1000] [--ranks 64] [--broken 3] [--runs 5]
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ft_plugins.checkpoint import find_latest


def build(root: Path, iterations: int, ranks: int, broken: int) -> None:
    base = time.time() - iterations
    for iteration in range(1, iterations + 1):
        buffer = io.BytesIO()
        torch.save({"iteration": iteration, "weight": torch.full((64,), float(iteration))}, buffer)
        data = buffer.getvalue()
        directory = root / f"iter_{iteration:07d}"
        for rank in range(ranks):
            rank_dir = directory / f"mp_rank_{rank:02d}"
            rank_dir.mkdir(parents=True)
            path = rank_dir / "model_optim_rng.pt"
            path.write_bytes(data[: len(data) // 2] if iteration > iterations - broken and rank == ranks // 2
                             else data)
            os.utime(path, (base + iteration, base + iteration))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iterations))


def vendor_latest(root: Path) -> str | None:
    files = glob.glob(str(root / "iter_*" / "mp_rank_*" / "model_optim_rng.pt"))
    files.sort(key=os.path.getmtime, reverse=True)
    tried: set[str] = set()
    for path in files:
        checkpoint = os.path.dirname(os.path.dirname(path))
        if checkpoint in tried:
            continue
        tried.add(checkpoint)
        try:
            for rank_file in sorted(glob.glob(os.path.join(checkpoint, "mp_rank_*", "model_optim_rng.pt"))):
                torch.load(rank_file, map_location="cpu", weights_only=True)
        except Exception:
            continue
        return checkpoint
    return None


def timed(function, runs: int) -> tuple[float, object]:
    """Median wall time after one untimed warm-up call (the same page and dentry cache for every contender)."""
    results, seconds = function(), []
    for _ in range(runs):
        start = time.perf_counter()
        results = function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--broken", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        full, short = Path(temporary, "full"), Path(temporary, "short")
        start = time.perf_counter()
        build(full, options.iterations, options.ranks, options.broken)
        build(short, max(options.iterations // 10, options.broken + 1), options.ranks, options.broken)
        print(f"built {options.iterations} iterations x {options.ranks} ranks, newest {options.broken} broken, "
              f"in {time.perf_counter() - start:.1f} s")
        ours, selection = timed(lambda: find_latest(full), options.runs)
        vendor, vendor_choice = timed(lambda: vendor_latest(full), max(1, options.runs // 2))
        ours_short, _ = timed(lambda: find_latest(short), options.runs)
        expected = str(full / f"iter_{options.iterations - options.broken:07d}")
        assert selection.path == expected == vendor_choice, (selection.path, vendor_choice, expected)
        assert len(selection.skipped) == options.broken
        print(f"ft_plugins find_latest: {ours:.4f} s (chose {Path(selection.path).name}, "
              f"skipped {len(selection.skipped)})")
        print(f"vendor glob + mtime sort + torch.load in turn: {vendor:.4f} s (same choice)")
        print(f"speed-up vs vendor: {vendor / ours:.1f}x   target: >= 10x and ft_plugins < 0.5 s")
        print(f"history 10x shorter ({short.name}): ft_plugins {ours_short:.4f} s, "
              f"ratio full/short history {ours / ours_short:.2f} (history ratio 10)")


if __name__ == "__main__":
    main()
