"""MindSpore's resume choice at cluster scale, on a file system whose metadata operations are slow: what one rank
reads before training, now and before.

Generates a MindSpore save directory as ModelCheckpoint writes it under msrun, ``rank_N/net-E_S.ckpt`` for N ranks
(1,024 and 10,240), --keep saves each, every file a real MindSpore checkpoint (``mindspore.save_checkpoint``) and
committed as ``resume`` commits it (its manifest beside it). Times, in a child process, each metadata operation
slept --delay ms and counted (``bench_ckpt_scale.py``'s slow file system), the choice as one rank makes it:
  before  every rank examined every rank's files (``find_latest(root, rank=0)``): N files a rank, N² in the job,
          and the ranks could still see different things (node-local disks, NFS attribute caches)
  now     each rank examines only its own (``rank_0``), then the ranks agree by all-gather rounds (one when every
          rank's newest is intact: 4 integers a rank; the collective's time is the backend's, not counted here)
Figures are medians of --runs children.

    python benchmarks/bench_ms_resume.py [--ranks 1024 10240] [--keep 3] [--runs 3] [--delay 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ckpt_scale import ops_text, options_or_child, slow_file_system  # noqa: E402

STEPS_PER_EPOCH = 8


def one_checkpoint(directory: Path) -> bytes:
    """The bytes of a small real MindSpore checkpoint."""
    import numpy as np
    from mindspore import Parameter, Tensor, save_checkpoint

    path = directory / "one.ckpt"
    save_checkpoint([{"name": f"w{i}", "data": Parameter(Tensor(np.full((64,), i, np.float32)), name=f"w{i}")}
                     for i in range(4)], str(path))
    return path.read_bytes()


def build(root: Path, ranks: int, keep: int) -> None:
    from ft_plugins.checkpoint import commit

    data = one_checkpoint(root.parent)
    for rank in range(ranks):
        directory = root / f"rank_{rank}"
        directory.mkdir(parents=True)
        for save in range(1, keep + 1):
            step = save * 4
            path = directory / f"net-{(step - 1) // STEPS_PER_EPOCH + 1}_{(step - 1) % STEPS_PER_EPOCH + 1}.ckpt"
            path.write_bytes(data)
            commit(path)


def child(root: str, delay_ms: float, what: str) -> None:
    from ft_plugins.checkpoint.select import Search, find_latest
    from ft_plugins.checkpoint.layouts.mindspore import own_folder

    counter = slow_file_system(delay_ms / 1000)
    start = time.perf_counter()
    if what == "before":
        chosen = find_latest(root, rank=0).path
    else:
        chosen = Search(own_folder(root, 0)).next_intact().path
    print(json.dumps({"seconds": time.perf_counter() - start, "ops": counter.counts, "chose": chosen}))


def median_child(root: Path, delay: float, what: str, runs: int) -> dict:
    reports = []
    for _ in range(runs):
        result = subprocess.run([sys.executable, __file__, "--child", str(root), str(delay), what], check=True,
                                capture_output=True, text=True)
        reports.append(json.loads(result.stdout.strip().splitlines()[-1]))
    reports.sort(key=lambda report: report["seconds"])
    return reports[len(reports) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 10240])
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delay", type=float, default=1.0, help="ms per metadata operation")
    options = options_or_child(parser, child)
    if options is None:
        return
    os.environ.setdefault("FT_PLUGINS_LOG", "error")
    for ranks in options.ranks:
        with tempfile.TemporaryDirectory(prefix="ft_ms_resume_") as temporary:
            root = Path(temporary, "ckpt")
            started = time.perf_counter()
            build(root, ranks, options.keep)
            print(f"{ranks} ranks, {options.keep} saves each, built in {time.perf_counter() - started:.1f} s",
                  flush=True)
            seconds = {}
            for delay in (0, options.delay):
                for what in ("before", "now"):
                    report = median_child(root, delay, what, options.runs)
                    assert report["chose"] and report["chose"].endswith("net-2_4.ckpt"), report["chose"]
                    seconds[what, delay] = report["seconds"]
                    print(f"  {what:<6} {delay:>3g} ms/op: {report['seconds']:7.3f} s ({ops_text(report)})",
                          flush=True)
            print("  before / now: " + "; ".join(f"{seconds['before', delay] / seconds['now', delay]:.0f}x at "
                                                 f"{delay:g} ms/op" for delay in (0, options.delay)), flush=True)


if __name__ == "__main__":
    main()
