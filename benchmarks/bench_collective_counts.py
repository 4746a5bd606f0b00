"""Per-collective cost of ``hangs``' collective counts, against the same collective uncounted, in one run.

One process, a gloo group of one rank, reporting into a mapped progress file as under ``ft-plugins run --
torchrun``: ``torch.distributed.all_reduce`` of one element (the shortest real collective there is here) and a
no-op stand-in with its signature (the counting's own cost), each called ``--calls`` times per round, stock and
counted (``CollectiveCounts``' patches applied and removed) interleaved round by round. Each figure is the median of
the rounds. Prints the added microseconds per collective and the ratio of the real all-reduce's times.

    python benchmarks/bench_collective_counts.py [--rounds 9] [--calls 5000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Any, Callable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _per_call(collective: Callable[..., Any], argument: Any, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        collective(argument)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5000)
    options = parser.parse_args()
    os.environ["FT_PLUGINS_LOG"] = "error"
    import torch
    import torch.distributed as dist
    import wrapt

    from ft_plugins import progress
    from ft_plugins.patching import PatchSet
    from ft_plugins.torch.collective_counts import CollectiveCounts

    directory = tempfile.mkdtemp(prefix="bench-counts-")
    assert progress.start(0, {"FT_PLUGINS_PROGRESS": directory})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    counts = CollectiveCounts()
    patches = PatchSet("hangs", counts.patches(), lambda patch_set, error: None)

    def stand_in(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    counted_stand_in = wrapt.FunctionWrapper(stand_in, counts.patches()[0].wrapper)
    tensor = torch.ones(1)
    times: dict[str, list[float]] = {name: [] for name in ("stock", "counted", "stand-in", "stand-in counted")}
    for _ in range(options.rounds):
        times["stock"].append(_per_call(dist.all_reduce, tensor, options.calls))
        patches.apply()
        times["counted"].append(_per_call(dist.all_reduce, tensor, options.calls))
        patches.remove()
        times["stand-in"].append(_per_call(stand_in, tensor, options.calls))
        times["stand-in counted"].append(_per_call(counted_stand_in, tensor, options.calls))
    median = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    print(f"all_reduce of 1 element (gloo, 1 rank): {median['stock']:.2f} us stock, {median['counted']:.2f} us "
          f"counted: {median['counted'] - median['stock']:+.2f} us per collective, ratio "
          f"{median['counted'] / median['stock']:.3f}")
    print(f"the counting alone (a no-op collective): {median['stand-in']:.2f} us stock, "
          f"{median['stand-in counted']:.2f} us counted: {median['stand-in counted'] - median['stand-in']:+.2f} us")
    entered = sum(progress.collectives(directory, 0).values())
    print(f"medians of {options.rounds} rounds of {options.calls} calls; collectives counted: {entered} "
          f"(expected {2 * options.rounds * options.calls})")


if __name__ == "__main__":
    main()
