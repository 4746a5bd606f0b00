"""The dying gasp against Megatron's own save of the same state, by size and by phase (CPU, gloo).

For each state size per rank and each rank count (2 ranks: ``--tensor-model-parallel-size 2``, so both
ranks of the node write at once), ``torchrun`` starts workers that initialise Megatron in-process, build
the example's GPT (``examples/megatron_gpt``, bf16, Adam) with the hidden size that gives the size, and
take one optimizer step, so the optimizer holds its fp32 masters and both moments. Then, rounds
alternating which writer goes first:
  dump  ``ttp``'s built-in engine as a SIGTERM runs it: ``MegatronDump.save`` on the frozen step (the
        writer in ``ft_plugins/torch/megatron/dump.py``, the commit in ``ft_plugins/checkpoint/dump.py``)
  save  ``megatron.training.checkpointing.save_checkpoint`` (``--ckpt-format torch``)
Phases, timed inside the real calls: state (``generate_state_dict``; on a GPU the device-to-host copy is
torch.save's, inside serialization), serialization (the archive's writer minus its records' writes), write (the
zip records with their CRC-32s: ``torch.save`` computes each with miniz before writing the record, the dump's
writer, ``ft_plugins/torch/saving.py``, with zlib-ng, and fills them in after), commit (the rest up to the commit:
renames, part record, manifest, tracker, barriers), sync (the dump's wait for its file system after the commit).
The race a dump runs is against the launcher's SIGKILL, which what a process wrote survives in the page cache:
"dump/save" is the dump up to its commit against Megatron's save, which leaves its files there too. Megatron's
save does not sync: the benchmark fsyncs its files afterwards ("fsync after"), and "dump/(save+fsync)" is the
whole dump, sync included, against save + fsync. Each writer's figures are those of its fastest round (the least
disturbed, as timeit reports), the slowest rank's. Every file written is removed.

    python benchmarks/bench_dump_size.py [--sizes 0.1,0.5,2] [--ranks 1,2] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "megatron_gpt"
LAYERS = 2
BYTES_PER_PARAMETER = 14  # bf16 weight, fp32 master, two fp32 Adam moments
PHASES = ("state", "serialize", "write", "commit", "sync")


class Phases:
    """Seconds spent in each phase since the last :meth:`take`, timed by wrappers around the real calls."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def take(self) -> dict[str, float]:
        spent, self.spent = dict(self.spent), defaultdict(float)
        return spent

    def timed(self, phase: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.spent[phase] += time.perf_counter() - started

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, lambda *args, **kwargs: self.timed(phase, original, *args, **kwargs))

    def wrap_zip_writer(self, serialization: Any) -> None:
        """torch.save's records: their writes are "write", the rest of torch.save is "serialize"."""
        original = serialization._open_zipfile_writer
        phases = self

        class Writer:
            def __init__(self, file_like: Any) -> None:
                self._file_like = file_like

            def __getattr__(self, name: str) -> Any:
                return getattr(self._file_like, name)

            def write_record(self, *args: Any) -> Any:
                return phases.timed("write", self._file_like.write_record, *args)

        class Opened:
            def __init__(self, target: Any) -> None:
                self._opened = original(target)

            def __enter__(self) -> Writer:
                return Writer(self._opened.__enter__())

            def __exit__(self, *exc: Any) -> Any:
                return phases.timed("write", self._opened.__exit__, *exc)

        serialization._open_zipfile_writer = Opened


def hidden_size(gigabytes: float, ranks: int) -> int:
    """The hidden size whose GPT (``LAYERS`` layers, 12 h^2 parameters each) holds ``gigabytes`` per rank."""
    parameters = gigabytes * 1e9 / BYTES_PER_PARAMETER * ranks
    return max(64, round((parameters / (12 * LAYERS)) ** 0.5 / 64) * 64)


def _fsync_tree(root: str) -> None:
    for directory, _, names in os.walk(root):
        for name in names:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


def _tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names)


def worker(options: argparse.Namespace) -> None:
    """One torchrun worker: build the state once, then time the two writers round by round."""
    os.environ.update(FT_PLUGINS="none", FT_PLUGINS_LOG="error")
    sys.path.insert(0, str(EXAMPLE))
    sys.argv = [sys.argv[0], "--no-ft-plugins-import"]
    import pretrain_gpt  # noqa: E402  (installs the CPU shim)
    import torch
    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing, get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    ranks = int(os.environ["WORLD_SIZE"])
    sys.argv += [*pretrain_gpt.DEFAULTS, "--num-layers", str(LAYERS), "--bf16",
                 "--hidden-size", str(hidden_size(options.size, ranks)), "--tensor-model-parallel-size", str(ranks),
                 "--save", os.path.join(options.dir, "save"), "--save-interval", "1000000", "--log-interval", "1000000"]
    initialize_megatron(extra_args_provider=pretrain_gpt.extra_args)
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
    optimizer.step()  # Adam's moments exist from here on, as in any save after the first step

    from ft_plugins.steps import FORWARD, Frozen
    from ft_plugins.torch import saving
    from ft_plugins.torch.megatron import dump as dump_module
    from ft_plugins.torch.megatron.dump import MegatronDump, MegatronStep

    phases = Phases()
    phases.wrap(checkpointing, "generate_state_dict", "state")
    phases.wrap(torch, "save", "archive")
    phases.wrap(saving, "save", "archive")
    phases.wrap_zip_writer(torch.serialization)
    for owner, name in ((saving._Recorded, "write_record"), (saving, "fill_in_crcs")):
        phases.wrap(owner, name, "write")
    phases.wrap(dump_module, "sync_file_system", "sync")
    rng = checkpointing.get_rng_state("torch", None, None)
    parsed = get_args()
    rank = dist.get_rank()

    def dump(directory: str, iteration: int) -> None:
        writer = MegatronDump(_Feature(directory))
        step = MegatronStep(model, optimizer, scheduler, 0, 0, getattr(scheduler, "num_steps", 0), rng)
        writer.save("benchmark", Frozen(FORWARD, iteration, True, step, False))

    def save(directory: str, iteration: int) -> None:
        parsed.save = directory
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)

    def timed(write: Callable[[str, int], None], directory: str, iteration: int) -> dict[str, float]:
        dist.barrier()
        phases.take()
        started = time.perf_counter()
        write(directory, iteration)
        total = time.perf_counter() - started
        return {**phases.take(), "total": total}

    results: list[dict[str, Any]] = []
    for round_index in range(options.rounds):
        iteration = round_index + 1
        dump_dir, save_dir = (os.path.join(options.dir, f"{name}{iteration}") for name in ("dump", "save"))
        order = [("dump", dump), ("save", save)]
        measured: dict[str, dict[str, float]] = {}
        for name, write in order if round_index % 2 == 0 else order[::-1]:
            directory = dump_dir if name == "dump" else save_dir
            measured[name] = timed(write, directory, iteration)
            if name == "save":  # Megatron does not fsync: time it here, as the fair comparison needs
                started = time.perf_counter()
                _fsync_tree(os.path.join(directory, f"iter_{iteration:07d}"))
                measured[name]["fsync after"] = time.perf_counter() - started
                phases.take()
            dist.barrier()
        for name, directory in (("dump", dump_dir), ("save", save_dir)):
            measured[name]["bytes"] = _tree_bytes(os.path.join(directory, f"iter_{iteration:07d}",
                                                               f"mp_rank_{rank:02d}"))
        gathered: list[Any] = [None] * ranks
        dist.all_gather_object(gathered, measured)
        dist.barrier()
        if rank == 0:
            results.append({name: {key: max(g[name].get(key, 0.0) for g in gathered) for key in gathered[0][name]}
                            for name in measured})
            for directory in (dump_dir, save_dir):
                shutil.rmtree(directory, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        with open(options.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()


class _Feature:
    """What ``MegatronDump`` reads of its feature: the dump's directory, and where commits are listed."""

    def __init__(self, save_dir: str) -> None:
        self.settings = {"save_dir": save_dir}
        self.saves: list[str] = []


def _fastest(results: list[dict[str, Any]], name: str, by: Callable[[dict[str, float]], float]) -> dict[str, float]:
    """The writer's least-disturbed round (as timeit reports) by ``by`` of its figures, split by phase; "commit" is
    what the total leaves after the timed phases, "committed" the total without the sync after the commit."""
    spent = dict(min((result[name] for result in results), key=by))
    spent["serialize"] = spent.get("archive", 0.0) - spent.get("write", 0.0)
    timed = spent.get("state", 0.0) + spent.get("archive", 0.0) + spent.get("sync", 0.0)
    spent["commit"] = max(0.0, spent["total"] - timed)
    spent["committed"] = spent["total"] - spent.get("sync", 0.0)
    return {key: spent.get(key, 0.0) for key in (*PHASES, "committed", "total", "fsync after", "bytes")}


def _committed(figures: dict[str, float]) -> float:
    return figures["total"] - figures.get("sync", 0.0)


def _on_disk(figures: dict[str, float]) -> float:
    return figures["total"] + figures.get("fsync after", 0.0)


def _run(size: float, ranks: int, rounds: int, root: str) -> list[dict[str, Any]]:
    workdir = tempfile.mkdtemp(prefix="bench-dump-size-", dir=root)
    out = os.path.join(workdir, "results.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               __file__, "--worker", "--size", str(size), "--rounds", str(rounds), "--dir", workdir, "--out", out]
    try:
        env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron asks it of tensor parallelism
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"worker failed ({result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.1,0.5,2", help="GB of state per rank, comma-separated")
    parser.add_argument("--ranks", default="1,2", help="ranks of one node writing at once, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options)
        return
    print(f"{'ranks':>5} {'GB/rank':>7} {'writer':>6} " + " ".join(f"{p:>9}" for p in PHASES)
          + f" {'committed':>9} {'total':>7} {'+fsync':>7}   dump/save  dump/(save+fsync)")
    for ranks in (int(r) for r in options.ranks.split(",")):
        for size in (float(s) for s in options.sizes.split(",")):
            results = _run(size, ranks, options.rounds, options.dir)
            dump, save = _fastest(results, "dump", _committed), _fastest(results, "save", _committed)
            dump_synced = _on_disk(_fastest(results, "dump", _on_disk))
            saved_synced = _on_disk(_fastest(results, "save", _on_disk))
            for name, split in (("dump", dump), ("save", save)):
                row = " ".join(f"{split[p]:9.3f}" for p in PHASES)
                after = f"{saved_synced:7.3f}" if name == "save" else " " * 7
                ratios = (f"   {dump['committed'] / save['total']:9.2f}  {dump_synced / saved_synced:16.2f}"
                          if name == "dump" else "")
                print(f"{ranks:5d} {split['bytes'] / 1e9:7.2f} {name:>6} {row} {split['committed']:9.3f} "
                      f"{split['total']:7.3f} {after}{ratios}", flush=True)


if __name__ == "__main__":
    main()
