"""The newest-intact check at cluster scale, on a file system whose metadata operations are slow.

Generates Megatron save directories as Megatron writes them, files small, KEEP iterations each, the
tracker on the newest, a commit manifest in each (as the resume feature writes them):
  torch       ``iter_K/mp_rank_TT_PPP/{model_optim_rng,distrib_optim}.pt`` for --mp model-parallel shards
  torch_dist  ``iter_K/{.metadata, metadata.json, common.pt, __{rank}_0.distcp}``: the ``.metadata`` is
              torch.distributed.checkpoint's own ``Metadata`` object (its real classes) with --shards
              storage entries per rank (distributed-optimizer slices of every flat buffer), pickled as
              DCP pickles it; every ``.distcp`` file as long as its entries say
each judged at commit as resume judges a large save (the full check in a process of its own, which
records the verdict: the time training waits for it to start and the check's own time are printed),
and times the check in a child process (nothing leaks), in-process, at 0 ms and with every metadata
operation (stat, lstat, fstat, open, scandir, listdir, a directory entry's stat; exists/isfile go
through stat) wrapped to sleep --delay ms and counted. Each sleeps in the calling thread, without the
interpreter lock, so operations of several threads overlap as a metadata server's answers do. Scenarios:
  unjudged    newest intact, no verdict recorded (a save no check has seen: not judged at commit)
  first       newest intact, its verdict written at commit (the first start after a save, and every later one)
  truncated   newest holds one truncated rank file (damaged after its commit), the one before intact
  truncated, unjudged   the same without any verdict recorded
  unfinished  the newest truncated and without its manifest (a save Megatron wrote alone, cut short), every later
              start after the first that saw it (each start after its first refusal)
And ``ft-plugins ckpt latest DIR`` as a whole process (interpreter start included, 0 ms); and what follows each save
(``commit``: its manifest written, and the largest writer's bytes the grace learns), at 0 ms and at --delay. Figures are
medians of --runs child processes (wall time, and the CPU time of the check's process and of the processes it
waited for: a large ``.metadata`` is walked in one of its own; its stdin, stdout and /dev/null are not
metadata operations of the checkpoint's file system, though the open of /dev/null is counted), printed with their
ratio to reading the tracker alone (what Megatron itself reads) and, with --baseline-ref, to the code of
that git revision, run the same way; then, for each code, the newest truncated against the newest intact.

    python benchmarks/bench_ckpt_scale.py [--ranks 1024 10240] [--formats torch torch_dist]
        [--runs 5] [--delay 1] [--baseline-ref COMMIT]
"""

from __future__ import annotations

import argparse
import builtins
import collections
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERDICT_NAMES = ("ft_verdict.json",)


def _torch_save_bytes(value: object) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def dcp_metadata(ranks: int, shards: int, shard_bytes: int) -> bytes:
    """A torch.distributed.checkpoint ``.metadata``: ``shards`` flat buffers each sliced over every rank."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    elements = shard_bytes // 4
    state, storage = {}, {}
    for buffer in range(shards):
        fqn = f"optimizer.distributed.buffer_{buffer // 3}.{('param', 'exp_avg', 'exp_avg_sq')[buffer % 3]}"
        chunks = [ChunkStorageMetadata(offsets=torch.Size([rank * elements]), sizes=torch.Size([elements]))
                  for rank in range(ranks)]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([ranks * elements]),
                                           chunks)
        for rank in range(ranks):
            storage[MetadataIndex(fqn, torch.Size([rank * elements]), 0)] = _StorageInfo(
                f"__{rank}_0.distcp", buffer * shard_bytes, shard_bytes)
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage, version="1.0.0"))


def build_torch(root: Path, keep: int, mp: int) -> None:
    model = _torch_save_bytes({"iteration": 0, "model": {"w": [0.0] * 16}})
    optimizer = _torch_save_bytes({"param_state": {"exp_avg": [0.0] * 16}})
    tensor, pipeline = 8, max(1, mp // 8)
    for iteration in range(1, keep + 1):
        for rank in range(mp):
            directory = root / f"iter_{iteration:07d}" / f"mp_rank_{rank % tensor:02d}_{rank // tensor:03d}"
            directory.mkdir(parents=True)
            (directory / "model_optim_rng.pt").write_bytes(model)
            (directory / "distrib_optim.pt").write_bytes(optimizer)
    assert pipeline * tensor == mp, "--mp must be a multiple of 8"


def build_torch_dist(root: Path, keep: int, ranks: int, shards: int) -> None:
    shard_bytes = 64
    metadata = dcp_metadata(ranks, shards, shard_bytes)
    common = _torch_save_bytes({"iteration": 0, "args": {"ckpt_format": "torch_dist"}})
    data = b"\0" * (shards * shard_bytes)
    for iteration in range(1, keep + 1):
        directory = root / f"iter_{iteration:07d}"
        directory.mkdir(parents=True)
        for rank in range(ranks):
            with open(directory / f"__{rank}_0.distcp", "wb") as handle:
                handle.write(data)
        (directory / ".metadata").write_bytes(metadata)
        (directory / "common.pt").write_bytes(common)
        (directory / "metadata.json").write_text(json.dumps({
            "sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}))


def build(root: Path, form: str, ranks: int, keep: int, mp: int, shards: int) -> tuple[float, tuple[float, float]]:
    """The save directory, every iteration committed as the resume feature commits; the commit's time
    (manifest), and the time until its check at commit started (what training waits for)."""
    from ft_plugins.checkpoint.committing import commit

    if form == "torch":
        build_torch(root, keep, mp)
    else:
        build_torch_dist(root, keep, ranks, shards)
    (root / "latest_checkpointed_iteration.txt").write_text(str(keep))
    start = time.perf_counter()
    for iteration in range(1, keep + 1):
        commit(root / f"iter_{iteration:07d}")
    return (time.perf_counter() - start) / keep, judge_all(root)


def judge_all(root: Path) -> tuple[float, float]:
    """Each iteration judged as at its commit, one after the other; the medians of the time to start a check
    (what training waits for) and of the check's own time in the background."""
    from ft_plugins.checkpoint.judging import judge_later

    starts, checks = [], []
    for directory in sorted(root.glob("iter_*")):
        start = time.perf_counter()
        process = judge_later(str(directory))
        starts.append(time.perf_counter() - start)
        assert process is None or process.wait() == 0
        checks.append(time.perf_counter() - start)
    return statistics.median(starts), statistics.median(checks)


def drop_verdicts(root: Path) -> None:
    for directory in root.glob("iter_*"):
        for name in VERDICT_NAMES:
            (directory / name).unlink(missing_ok=True)


def unfinish_newest(root: Path) -> None:
    """The newest's manifest removed: a save Megatron wrote alone (its truncated file then refuses it)."""
    newest = sorted(root.glob("iter_*"))[-1]
    for manifest in newest.glob("ft_manifest*.json"):
        manifest.unlink()


def truncate_newest(root: Path) -> None:
    newest = sorted(root.glob("iter_*"))[-1]
    victim = sorted(newest.rglob("*.distcp"))[len(list(newest.rglob("*.distcp"))) // 2:][:1] or sorted(
        newest.rglob("model_optim_rng.pt"))[:1]
    with open(victim[0], "r+b") as handle:
        handle.truncate(victim[0].stat().st_size // 2)


# ---- the child: one check, metadata operations slowed and counted ----

class _Counter:
    """Metadata operations counted without a lock of the benchmark's own (one C call each, whole under the
    interpreter lock), which the check's threads would otherwise contend for at every operation."""

    def __init__(self, delay: float) -> None:
        self.delay, self._hits = delay, collections.defaultdict(list)

    @property
    def counts(self) -> dict[str, int]:
        return {kind: len(hits) for kind, hits in self._hits.items()}

    def hit(self, kind: str) -> None:
        self._hits[kind].append(None)
        if self.delay:
            time.sleep(self.delay)

    def wrap(self, kind: str, function):
        def slowed(*args, **kwargs):
            self.hit(kind)
            return function(*args, **kwargs)
        return slowed


class _Entry:
    """A directory entry whose ``stat()`` is a metadata operation (d_type answers is_dir/is_file for free)."""

    def __init__(self, entry: os.DirEntry, counter: _Counter) -> None:
        self._entry, self._counter = entry, counter
        self.name, self.path = entry.name, entry.path

    def stat(self, *args, **kwargs):
        self._counter.hit("stat")
        return self._entry.stat(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._entry, name)

    def __fspath__(self) -> str:
        return self.path


class _Listing:
    def __init__(self, entries, counter: _Counter) -> None:
        self._entries, self._counter = entries, counter

    def __iter__(self):
        return self

    def __next__(self) -> _Entry:  # os.walk takes the entries one at a time
        return _Entry(next(self._entries), self._counter)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._entries.close()

    def close(self) -> None:
        self._entries.close()


def slow_file_system(delay: float) -> _Counter:
    counter = _Counter(delay)
    for name, kind in (("stat", "stat"), ("lstat", "stat"), ("fstat", "stat"), ("open", "open"),
                       ("listdir", "listdir")):
        setattr(os, name, counter.wrap(kind, getattr(os, name)))
    opened = io.open
    # a descriptor already open (os.fdopen) asks nothing of the file system: only paths count
    builtins.open = io.open = lambda file, *args, **kwargs: (
        opened if isinstance(file, int) else counter.wrap("open", opened))(file, *args, **kwargs)
    scandir = os.scandir
    os.scandir = lambda *args: (counter.hit("listdir"), _Listing(scandir(*args), counter))[1]
    return counter


def _cpu_seconds() -> float:
    """This process's CPU time and that of the processes it waited for (the ``.metadata`` walk's)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def child(directory: str, delay_ms: float, what: str) -> None:
    from ft_plugins.checkpoint import find_latest
    from ft_plugins.checkpoint.naming import read_tracker

    counter = slow_file_system(delay_ms / 1000)
    start, cpu = time.perf_counter(), _cpu_seconds()
    if what == "tracker":
        chosen = str(read_tracker(directory).value)
    elif what == "commit":  # what follows each save: its commit's manifest, and the largest writer's bytes (grace)
        from ft_plugins.checkpoint.manifest import write_manifest
        from ft_plugins.grace import largest_writer

        newest = os.path.join(directory, f"iter_{read_tracker(directory).value:07d}")
        # the newest's own manifest, as resume writes it (the checks of every scenario ran before), whose sizes the
        # grace then reads, as it does after resume's commit
        chosen = write_manifest(newest)
        largest_writer(newest)
    else:
        chosen = find_latest(directory).path
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    print(json.dumps({"seconds": seconds, "cpu": cpu, "ops": counter.counts, "chose": chosen,
                      "code": str(Path(sys.modules["ft_plugins"].__file__).parent)}))


def run_child(root: Path, delay_ms: float, what: str, code: Path | None, before=None) -> dict:
    if before:
        before()
    path = os.pathsep.join(filter(None, (str(code) if code else "", os.environ.get("PYTHONPATH"))))
    result = subprocess.run([sys.executable, __file__, "--child", str(root), str(delay_ms), what],
                            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": path})
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if code is not None:
        assert report["code"].startswith(str(code)), report["code"]
    return report


def median_run(runs: int, *args, **kwargs) -> dict:
    reports = [run_child(*args, **kwargs) for _ in range(runs)]
    reports.sort(key=lambda report: report["seconds"])
    return reports[len(reports) // 2]


def process_seconds(root: Path, runs: int, before=None) -> float:
    seconds = []
    for _ in range(runs):
        if before:
            before()
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ft_plugins.cli", "ckpt", "latest", str(root)], check=True,
                       capture_output=True)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def baseline_code(ref: str, into: Path) -> Path:
    """The package as it was at git revision ``ref``, extracted beside the trees."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "ft_plugins"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def ops_text(report: dict) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in sorted(report["ops"].items()))


def measure(root: Path, form: str, ranks: int, options: argparse.Namespace, old: Path | None) -> None:
    keep = options.keep
    expected = {"intact": str(root / f"iter_{keep:07d}"), "truncated": str(root / f"iter_{keep - 1:07d}")}
    tracker = {delay: median_run(options.runs, root, delay, "tracker", None) for delay in (0, options.delay)}
    unjudged = lambda: drop_verdicts(root)  # noqa: E731
    label = f"{form} {ranks} ranks" if form == "torch_dist" else f"{form} {ranks} ranks ({options.mp} mp shards)"
    seconds: dict[tuple[str, str, float], float] = {}  # (code, scenario, delay): the median
    for scenario, state, before in [("unjudged", "intact", unjudged), ("first", "intact", None),
                                    ("truncated", "truncated", None), ("trunc-unj", "truncated", unjudged),
                                    ("unfinished", "truncated", None)]:
        if scenario == "first":
            judge_all(root)
        if scenario == "truncated":
            truncate_newest(root)
        if scenario == "unfinished":
            unfinish_newest(root)
        for delay in (0, options.delay):
            run_child(root, delay, "check", None, before)  # warm: an earlier check leaves its verdicts
            report = median_run(options.runs, root, delay, "check", None, before=before)
            assert report["chose"] == expected[state], (report["chose"], expected[state])
            seconds["now", scenario, delay] = report["seconds"]
            line = (f"{label:<34} {scenario:<9} {delay:>3} ms/op: {report['seconds']:7.3f} s, CPU {report['cpu']:.2f} s"
                    f" ({report['seconds'] / tracker[delay]['seconds']:7.0f}x the tracker alone; {ops_text(report)})")
            if old is not None:  # warmed alike: each code leaves the verdicts it reads (of its own version)
                run_child(root, delay, "check", old, before)
                then = median_run(options.baseline_runs, root, delay, "check", old, before=before)
                assert then["chose"] == expected[state], then["chose"]
                seconds["before", scenario, delay] = then["seconds"]
                line += f"\n{'':<34} {'':<9} {'':>3}  before {options.baseline_ref}: {then['seconds']:7.3f} s, " \
                        f"CPU {then['cpu']:.2f} s " \
                        f"(before/now {then['seconds'] / report['seconds']:.1f}x; {ops_text(then)})"
            print(line, flush=True)
        whole = process_seconds(root, options.runs, before)
        print(f"{label:<34} {scenario:<9} whole process, 0 ms/op: {whole:.3f} s", flush=True)
    for delay in (0, options.delay):
        report = median_run(options.runs, root, delay, "commit", None)
        line = f"{label:<34} {'commit':<9} {delay:>3} ms/op: {report['seconds']:7.3f} s ({ops_text(report)})"
        if old is not None:
            then = median_run(options.baseline_runs, root, delay, "commit", old)
            line += f"; before {options.baseline_ref}: {then['seconds']:7.3f} s"
        print(line, flush=True)
    for code in ("now", "before") if old is not None else ("now",):
        print(f"{label:<34} {code:<9} newest truncated / newest intact: " + "; ".join(
            f"{judged} at {delay:g} ms/op {seconds[code, damaged, delay] / seconds[code, intact, delay]:.2f}x"
            for judged, damaged, intact in (("never judged", "trunc-unj", "unjudged"), ("judged", "truncated", "first"))
            for delay in (0, options.delay)), flush=True)


def options_or_child(parser: argparse.ArgumentParser, child_main) -> argparse.Namespace | None:
    """The parsed options; None once ``child_main(directory, delay_ms, what)`` ran for ``--child`` (a measured
    child process of the benchmark)."""
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if not options.child:
        return options
    child_main(options.child[0], float(options.child[1]), options.child[2])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 10240])
    parser.add_argument("--formats", nargs="+", default=["torch", "torch_dist"], choices=["torch", "torch_dist"])
    parser.add_argument("--keep", type=int, default=10, help="iterations kept")
    parser.add_argument("--mp", type=int, default=128, help="model-parallel shards of the torch format")
    parser.add_argument("--shards", type=int, default=12, help="storage entries per rank in .metadata")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--delay", type=float, default=1.0, help="ms per metadata operation")
    parser.add_argument("--baseline-ref", help="also time the code of this git revision")
    parser.add_argument("--baseline-runs", type=int, default=1)
    options = options_or_child(parser, child)
    if options is None:
        return
    with tempfile.TemporaryDirectory(prefix="ft_ckpt_scale_") as temporary:
        old = baseline_code(options.baseline_ref, Path(temporary, "old")) if options.baseline_ref else None
        for form in options.formats:
            for ranks in options.ranks:
                root = Path(temporary, f"{form}_{ranks}")
                start = time.perf_counter()
                commit_seconds, (started, checked) = build(root, form, ranks, options.keep, options.mp,
                                                           options.shards)
                print(f"built {form}, {ranks} ranks, {options.keep} iterations in {time.perf_counter() - start:.1f} s "
                      f"(commit: {commit_seconds:.2f} s per save; its check started in {started * 1e3:.1f} ms, "
                      f"took {checked:.2f} s in the background)", flush=True)
                measure(root, form, ranks, options, old)
                shutil.rmtree(root)


if __name__ == "__main__":
    main()
