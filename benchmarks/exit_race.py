"""How often a finished 2-rank gloo Trainer job dies at interpreter exit (SIGABRT, "terminate called without
an active exception": PyTorch issue 190489), without and with ft_plugins, in the same run.

Each round launches the tiny Trainer job of examples/hf_trainer (torchrun, 2 CPU ranks, gloo, a few steps,
a save, rank 0 writing the final state) twice: plain torchrun without ft_plugins, then under
``ft-plugins run`` (FT_PLUGINS=resume: the exit drain of ``ft_plugins.torch.hf.clean_exit`` is on with any
feature). Prints, for each, the runs that ended in SIGABRT after training completed, the other failures,
and the load average (the race shows more on a loaded machine).

    python benchmarks/exit_race.py [--runs 20] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer", "train.py")
BIN = os.path.dirname(sys.executable)
ABORT = "terminate called without an active exception"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _job(ft: bool, steps: int, workdir: str) -> str:
    """'clean', 'abort' (SIGABRT at exit after training) or 'failed'."""
    out = os.path.join(workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    torchrun = [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", "--master-port", str(_port())]
    command = ([os.path.join(BIN, "ft-plugins"), "run", "--"] if ft else []) + torchrun + [
        EXAMPLE, out, "--steps", str(steps), "--save-steps", str(steps), "--final", os.path.join(workdir, "final.pt")]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "TORCHELASTIC"))},
           "PYTHONPATH": ROOT, **({"FT_PLUGINS": "resume"} if ft else {})}
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=600)
    if result.returncode == 0:
        return "clean"
    trained = os.path.exists(os.path.join(workdir, "final.pt"))
    return "abort" if ABORT in result.stdout and trained else "failed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="jobs per arm")
    parser.add_argument("--steps", type=int, default=4)
    options = parser.parse_args()
    counts = {arm: {"clean": 0, "abort": 0, "failed": 0} for arm in ("without", "with")}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir:
        for run in range(options.runs):
            for arm in ("without", "with"):
                final = os.path.join(workdir, "final.pt")
                if os.path.exists(final):
                    os.unlink(final)
                counts[arm][_job(arm == "with", options.steps, workdir)] += 1
            print(f"round {run + 1}: {counts}", flush=True)
    print(f"load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"{os.cpu_count()} cores")
    for arm, count in counts.items():
        print(f"{arm} ft_plugins: SIGABRT at exit after training {count['abort']} of {options.runs} "
              f"({100 * count['abort'] / options.runs:.0f} %), other failures {count['failed']}")


if __name__ == "__main__":
    main()
