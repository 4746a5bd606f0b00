"""The dying-gasp dump's commit at cluster scale: metadata operations in all, and the committer's time.

A dump of N shards (512, 1,024 and 10,240), each shard's part written by its writer as the dump writes it (a small
file, its part record), on this machine's disk. Then, in a child process whose every metadata operation (stat, open,
scandir, listdir) sleeps --delay ms and is counted (``bench_ckpt_scale.py``'s stand-in of a slow file system):

  one check   a writer's coverage check with every part there (``dump_problems``): what each writer's attempt read
  commit      the commit by the one committer (``commit_dump``: the check, the rename, the manifest, the tracker)

Now one writer commits (the last counted on torchrun's store); before, every writer tried as it finished, the i-th
reading the i records there: N·(N + 1)/2 record reads in all, inside the launcher's grace. Printed per N: the
operations of one check and of the commit, the commit's time as the committer sees it, and the operations in all
now and before (counted from the check's own operations per record), and the bytes of the records the commit reads.

    python benchmarks/bench_dump_commit.py [--shards 512 1024 10240] [--delay 1]
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

from bench_ckpt_scale import options_or_child, slow_file_system  # noqa: E402

ITERATION = 7


def build(save: Path, shards: int) -> None:
    from ft_plugins.checkpoint.dump import Part, write_part

    names = tuple(f"mp_rank_{shard:05d}" for shard in range(shards))
    for writer, name in enumerate(names):
        write_part(str(save), Part(name, ITERATION, names, writer, attempt="bench"),
                   {"model_optim_rng.pt": lambda path: Path(path).write_bytes(b"\0" * 4096)})


def child(save: str, delay_ms: float, what: str) -> None:
    from ft_plugins.checkpoint.dump import commit_dump, dump_problems
    from ft_plugins.checkpoint.naming import dump_dir

    counter = slow_file_system(delay_ms / 1000)
    started = time.perf_counter()
    if what == "check":
        outcome = not dump_problems(dump_dir(save, ITERATION))
    else:
        outcome = commit_dump(save, ITERATION, durable=False).committed
    print(json.dumps({"seconds": time.perf_counter() - started, "ops": counter.counts, "ok": outcome}))


def run_child(save: Path, delay_ms: float, what: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", str(save), str(delay_ms), what],
                            capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[512, 1024, 10240])
    parser.add_argument("--delay", type=float, default=1.0, help="ms per metadata operation")
    options = options_or_child(parser, child)
    if options is None:
        return
    for shards in options.shards:
        with tempfile.TemporaryDirectory(prefix="ft_dump_commit_") as temporary:
            save = Path(temporary)
            build(save, shards)
            recorded = sum(path.stat().st_size for pattern in ("*/*/ft_part.json", "*/ft_layout-*.json")
                           for path in save.glob(pattern))
            check = run_child(save, options.delay, "check")
            commit = run_child(save, options.delay, "commit")
        per_record = sum(check["ops"].values()) / shards
        before = per_record * shards * (shards + 1) / 2 + sum(commit["ops"].values()) - sum(check["ops"].values())
        print(f"{shards} shards, {options.delay:g} ms per metadata operation:")
        print(f"  the records and the run's list of shards: {recorded / 1e6:.2f} MB in all")
        print(f"  one check {sum(check['ops'].values())} operations ({check['seconds']:.2f} s); the commit "
              f"{sum(commit['ops'].values())} operations, {commit['seconds']:.2f} s as the committer sees it")
        print(f"  in all: now {sum(commit['ops'].values())} operations (one committer); before about {before:,.0f} "
              f"(every writer's check of the records there as it finished): {before / 1000 * options.delay:,.0f} s "
              "of metadata operations inside the grace")


if __name__ == "__main__":
    main()
