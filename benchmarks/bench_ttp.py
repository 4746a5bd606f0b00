"""Cost of ``ttp``'s built-in engine on the real Megatron example (one rank, CPU), against a run without it.

Two runs of ``examples/megatron_gpt/pretrain_gpt.py`` with the same seed and the same periodic save:
  bare  FT_PLUGINS=none
  ttp   FT_PLUGINS=ttp: step tracking, update bracketing and the SIGTERM watcher, then a SIGTERM
        injected into the last step, so the same process also writes and commits a dump
Rounds alternate the two, so machine noise hits both alike. Prints the median time per iteration
(after warm-up, before the save and the fault) of each, the fastest round's, and their ratio; and
the dump's time (from SIGTERM to the part and its record written; neither Megatron's save nor the dump before its
commit syncs) against Megatron's own ``save-checkpoint`` time of the same state in the same run.

    python benchmarks/bench_ttp.py [--iters 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "megatron_gpt" / "pretrain_gpt.py"
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
SAVE = re.compile(r"save-checkpoint \.+: \(([\d.]+), ([\d.]+)\)")
DUMP = re.compile(r"dumped mp_rank_00 of iteration \d+ in (\d+) ms")


def _run(workdir: Path, iters: int, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    command = [sys.executable, str(EXAMPLE), "--train-iters", str(iters), "--save", str(workdir / "ckpt"),
               "--save-interval", str(iters // 2), "--timing-log-level", "1"]
    result = subprocess.run(command, cwd=workdir, env={**clean, **env}, capture_output=True, text=True)
    return result.stdout + result.stderr


def _step_ms(output: str, first: int, last: int) -> float:
    times = [float(ms) for n, ms in ITERATION.findall(output) if first <= int(n) < last]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    iters, warm = options.iters, 5
    saved = iters // 2
    bare_ms, ttp_ms, dumps = [], [], []
    for _ in range(options.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            bare_dir, ttp_dir = Path(tmp, "bare"), Path(tmp, "ttp")
            bare_dir.mkdir()
            ttp_dir.mkdir()
            bare = _run(bare_dir, iters, FT_PLUGINS="none")
            ttp = _run(ttp_dir, iters, FT_PLUGINS="ttp", FT_PLUGINS_INJECT_FAULT=f"rank=0,step={iters - 1},kind=term")
        bare_ms.append(_step_ms(bare, warm, saved))
        ttp_ms.append(_step_ms(ttp, warm, saved))
        save, dump = SAVE.search(ttp), DUMP.search(ttp)
        if save and dump:
            dumps.append((float(dump.group(1)), float(save.group(2))))
    print(f"per step (fastest round): bare {min(bare_ms):.1f} ms, ttp {min(ttp_ms):.1f} ms, "
          f"ratio {min(ttp_ms) / min(bare_ms):.3f}")
    if not dumps:
        print("no save or dump timing found in the ttp runs' logs")
        return
    dump_ms, save_ms = min(dumps)
    print(f"dump {dump_ms:.0f} ms (SIGTERM to part + record written) vs save_checkpoint {save_ms:.0f} ms: "
          f"{dump_ms / save_ms:.2f}x (fastest of {len(dumps)})")


if __name__ == "__main__":
    main()
