"""Soak of ``recover``: one 4-rank Megatron job (CPU, gloo, DP=4) losing a rank again and again; rank 0 survives
every fault. Its open file descriptors, threads and resident memory are read from ``/proc`` after each repair
and must stay flat: a leaked group, socket, data loader or thread per recovery would show as a slope.

    python benchmarks/soak_recover.py [--recoveries 20] [--spares 1]

Prints one line per repair and the growth from the first repair to the last (against the first's value,
so the start-up's own growth does not count).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_recover import EXAMPLE, ROOT, TORCHRUN, free_port

REPAIRED = re.compile(r"rank 0 repaired generation (\d+)")
TAKER = re.compile(r"recover: rank \d+ exited with code -?\d+; (warm spare|replacement) pid")


def _rank_zero(marker: str) -> int | None:
    """This soak's worker of rank 0: RANK=0 in its environment, started by torchrun (not a data loader worker
    forked from it)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            parent = re.search(r"PPid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)
            launcher = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, AttributeError):
            continue
        if b"RANK=0" in environ and marker.encode() in environ and b"torchrun" in launcher:
            return int(pid)
    return None


def _sample(pid: int) -> tuple[int, int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return len(os.listdir(f"/proc/{pid}/fd")), threads, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recoveries", type=int, default=20)
    parser.add_argument("--spares", type=int, default=1)
    options = parser.parse_args()
    steps = 2 * options.recoveries + 2
    faults = ";".join(f"rank={1 + n % 3},step={2 * n + 2},kind=kill,life={n // 3}" for n in range(options.recoveries))
    marker = f"SOAK_MARKER={os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=faults, FT_PLUGINS_RECOVER_SPARES=str(options.spares),
               SOAK_MARKER=marker.partition("=")[2])
    samples: list[tuple[int, int, int]] = []
    takers = {"warm spare": 0, "replacement": 0}
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nproc-per-node", "4",
                   "--master-port", str(free_port()), str(EXAMPLE), "--micro-batch-size", "1", "--global-batch-size", "4",
                   "--train-iters", str(steps), "--save", str(Path(tmp, "ckpt")), "--save-interval", str(10 * steps)]
        job = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in job.stdout:
            taker = TAKER.search(line)
            if taker:
                takers[taker.group(1)] += 1
            found = REPAIRED.search(line)
            pid = _rank_zero(marker) if found else None
            if pid is not None:
                samples.append(_sample(pid))
                fds, threads, rss = samples[-1]
                print(f"generation {found.group(1):>2}: fds {fds}, threads {threads}, RSS {rss / 1024:.1f} MiB", flush=True)
        code = job.wait()
    if code != 0 or len(samples) < 2:
        raise SystemExit(f"the job ended with {code} after {len(samples)} repairs")
    (fds0, threads0, rss0), (fds1, threads1, rss1) = samples[0], samples[-1]
    print(f"\nover {len(samples)} repairs, first to last: fds {fds1 - fds0:+d}, threads {threads1 - threads0:+d}, "
          f"RSS {(rss1 - rss0) / 1024:+.1f} MiB ({rss1 / rss0:.3f}x); taken over by a warm spare "
          f"{takers['warm spare']} times, by a fresh process {takers['replacement']}")


if __name__ == "__main__":
    main()
