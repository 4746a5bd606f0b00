"""What a node lost for good costs, on the Megatron example (CPU, gloo) run as two torchrun agents of 2 ranks
(``--nnodes 1:2``, DP=4, the test harness of tests/torch_megatron/elastic_runs.py), in one run: the time from the
loss to training again, by a scale-in in place (``elastic``) and by ``ttp``'s dump and torchrun's restart at the
size left (what a job gets without ``elastic``, and what ``recover`` falls back to after its timeout).

Rank 2 stands still as the step after ``--fault`` completed steps begins, and its node (agent and workers) is then
SIGKILLed:
  scale-in  FT_PLUGINS=ttp,recover,elastic, FT_PLUGINS_ELASTIC_WAIT=--wait
  restart   FT_PLUGINS=ttp,resume, --max-restarts 1, --load: the survivors dump, torchrun's agent rendezvouses again
            with the one node left (c10d's last call: 30 s by default) and restarts its workers at DP=2, which
            resume from the dump
A loss's time to training again comes from Megatron's timestamped iteration lines (bench_hangs.to_training): from
the line of the last step completed before it to the line of the next step, less one step. Rounds alternate the
ways, so machine noise hits all alike. Prints each median, the scale-in's without its wait (a policy: MindCluster's
wait-reschedule-timeout, 30 s at least), the ratios against the restart, and what ``recover`` alone costs: its
timeout (180 s by default) and then the restart. ``--sharded``: both ways with Megatron's distributed optimizer in 2
instances (``FT_PLUGINS_TTP_REPLICAS=2``) and bf16, whose shards the scale-in lays out again.

    python benchmarks/bench_elastic.py [--iters 20] [--fault 10] [--rounds 3] [--wait 3] [--sharded]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "torch_megatron")]

from bench_hangs import to_training  # noqa: E402
from elastic_runs import elastic_job  # noqa: E402

RECOVER_TIMEOUT = 180.0  # recover's default wait for a replacement


SHARDED = ("--use-distributed-optimizer", "--bf16")


def _lost(way: str, iters: int, fault: int, wait: float, sharded: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        stuck = {"FT_PLUGINS_INJECT_FAULT": f"rank=2,step={fault},kind=stuck",
                 **({"FT_PLUGINS_TTP_REPLICAS": "2"} if sharded else {})}
        shape = ("--train-iters", str(iters), *(SHARDED if sharded else ()))
        if way == "scale-in":
            nodes = elastic_job(workdir, *shape, lose=(2,), FT_PLUGINS="ttp,recover,elastic",
                                FT_PLUGINS_ELASTIC_WAIT=str(wait), **stuck)
        else:
            nodes = elastic_job(workdir, *shape, "--load", str(workdir / "ckpt"), lose=(2,), restarts=1,
                                FT_PLUGINS="ttp,resume", **stuck)
        if nodes.codes[0] != 0:
            raise SystemExit(f"{way}: the node left ended with {nodes.codes[0]}:\n{nodes.outputs[0][-4000:]}")
        return to_training(nodes.job.output, fault)  # the last rank logs: rank 3 (lost) before, rank 1 after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fault", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=3.0, help="FT_PLUGINS_ELASTIC_WAIT")
    parser.add_argument("--sharded", action="store_true", help="the distributed optimizer in 2 instances, bf16")
    options = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    times: dict[str, list[float]] = {"scale-in": [], "restart": []}
    for _ in range(options.rounds):
        for way, values in times.items():
            values.append(_lost(way, options.iters, options.fault, options.wait, options.sharded))
            print(f"{way:8s} to training again {values[-1]:6.2f} s", flush=True)
    scale_in, restart = (statistics.median(times[way]) for way in ("scale-in", "restart"))
    own = scale_in - options.wait
    shape = ", the distributed optimizer in 2 instances, bf16" if options.sharded else ""
    print(f"\nmedians of {options.rounds} rounds, DP=4 -> 2 (two nodes of 2 ranks, one lost for good{shape}):")
    print(f"scale-in in place {scale_in:.2f} s ({own:.2f} s after its {options.wait:g} s wait); dump + restart at the "
          f"size left {restart:.2f} s; recover alone: its {RECOVER_TIMEOUT:.0f} s wait, then that restart "
          f"({RECOVER_TIMEOUT + restart:.0f} s)")
    print(f"scale-in / restart {scale_in / restart:.2f}x, without the wait {own / restart:.2f}x "
          f"(goal <= 0.3x, as an in-place recovery); with MindCluster's least wait (30 s) "
          f"{(own + 30) / restart:.2f}x")


if __name__ == "__main__":
    main()
