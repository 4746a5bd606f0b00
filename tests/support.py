"""Shared test support: where things are, and how to run a real Megatron job with the vendor fakes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

REPO = Path(__file__).resolve().parent.parent
FAKES = REPO / "tests" / "fakes"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MEGATRON_EXAMPLE = REPO / "examples" / "megatron_gpt" / "pretrain_gpt.py"
# megatron-core 0.19 beside the venv's 0.17 (scripts/setup.sh installs it); put first on PYTHONPATH to use it
NEWER_MEGATRON = Path(sys.prefix) / "megatron-core-0.19"
TRAINED_ON_0_19 = f"{NEWER_MEGATRON.name}{os.sep}megatron{os.sep}"  # in the warnings of each job that imports it
OLDEST_MEGATRON = Path(sys.prefix) / "megatron-core-0.8"  # megatron/core only
NEWER_TRANSFORMERS = Path(sys.prefix) / "transformers-5"  # the newest (scripts/requirements-transformers-5.txt)
OLDEST_TRANSFORMERS = Path(sys.prefix) / "transformers-4.40"  # scripts/requirements-transformers-4.40.txt
NEWER_MINDSPORE = Path(sys.prefix) / "mindspore-2.10"
NEWER_MINDFORMERS = Path(sys.prefix) / "mindformers-1.9"  # with MindSpore 2.9.0, the release it asks for
OLDEST_MINDFORMERS = Path(sys.prefix) / "mindformers-1.6"  # with the pinned MindSpore 2.7.2

def path_first(directory: Path) -> str:
    """This process's ``PYTHONPATH`` with ``directory`` first: for a child that must import from it."""
    return os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))


def first_on_path(side_dir: Path) -> dict[str, str]:
    """This environment with ``side_dir`` (a newer release installed beside the pinned one) first on
    ``PYTHONPATH``, for a child and every process it starts."""
    return {**os.environ, "PYTHONPATH": path_first(side_dir)}


def assert_child_pytest_passes(modules: Iterable[Path], env: dict[str, str], at_least: int, *options: str,
                               workers: int = 0) -> None:
    """One child pytest of ``modules`` in ``env`` (``options``: more of pytest's; ``workers``: its processes, 0 for
    one): every test passes (at least ``at_least``), none skipped."""
    run = subprocess.run([PYTHON, "-m", "pytest", "-q", "-n", str(workers), "-p", "no:cacheprovider", "-rfEs",
                          *options, *(str(module) for module in modules)], env=env, capture_output=True, text=True,
                         timeout=2400)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= at_least and not re.search(r"skipped|failed|error", summary), summary


def old_mindio(root: Path) -> None:
    """A ``mindio_ttp`` from before the tft_* rename (ttp_* functions only) under ``root``."""
    package = root / "mindio_ttp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "framework_ttp.py").write_text("def ttp_init_processor(rank, dp_ranks, dp_size, world_size, "
                                              "replica_num, enable_local_copy):\n    pass\n")


def read_records(path: Path) -> list[dict]:
    """The calls the vendor fakes recorded, in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    """A finished training run: exit code, combined output, the vendor calls it made, its save dir."""

    returncode: int
    output: str
    records: list[dict]
    save: Path | None = None

    def by_pid(self) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for entry in self.records:
            out.setdefault(entry["pid"], []).append(entry)
        return out

    def processes(self, expected: int) -> dict[int, list[dict]]:
        """``by_pid()``, asserting it holds ``expected`` processes: a loop over none would pass vacuously."""
        processes = self.by_pid()
        assert len(processes) == expected, f"{len(processes)} processes recorded calls, expected {expected}"
        return processes

    def ranges(self, pid: int) -> list[tuple[str, object]]:
        """(message, stream) of every range one process opened, in start order; asserts they balance."""
        open_ids: list[int] = []
        started: list[tuple[str, object]] = []
        for entry in self.by_pid()[pid]:
            if entry["api"] == "mstx.range_start":
                started.append((entry["args"][0], entry["args"][1]))
                open_ids.append(entry["kwargs"]["id"])
            elif entry["api"] == "mstx.range_end":
                assert open_ids and open_ids[-1] == entry["args"][0], "ranges must close innermost first"
                open_ids.pop()
        assert not open_ids, f"unclosed ranges {open_ids}"
        return started

    def range_names(self, pid: int) -> list[str]:
        return [name for name, _ in self.ranges(pid)]

    def calls(self) -> list[tuple]:
        """Every recorded call without process-specific details (pid, range ids), in order."""
        return [(r["api"], r["args"], {k: v for k, v in r["kwargs"].items() if k != "id"}, r["rank"],
                 r["dist_initialized"]) for r in self.records]


def fake_env(record: Path, *extra_paths: Path, **overrides: str) -> dict[str, str]:
    """A child environment with the vendor fakes importable and recording to ``record``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE"))}
    paths = [str(p) for p in (*extra_paths, FAKES)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
    env["FT_FAKE_RECORD"] = str(record)
    env.update(overrides)
    return env


def run_megatron(workdir: Path, nproc: int, env: dict[str, str], *args: str,
                 entry: Path = MEGATRON_EXAMPLE, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real megatron ``pretrain()`` example: torchrun for 2+ ranks, plain python for 1."""
    if nproc > 1:
        command = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), str(entry)]
    else:
        command = [PYTHON, str(entry)]
    return run_to_end([*command, *args], workdir, env, timeout)


def saved_tensors(path: Path, parts: tuple[str, ...] | None = ("model", "optimizer")) -> dict[str, "torch.Tensor"]:
    """Tensors of a checkpoint file a test wrote itself (trusted: full load is fine), by nested key;
    ``parts``: the top-level entries to take (None: all)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(value: object, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{prefix}[{index}]")
        elif torch.is_tensor(value):
            flat[prefix] = value

    walk(state if parts is None else {part: state[part] for part in parts}, "")
    assert flat
    return flat


def assert_bit_identical(left: Path, right: Path,
                         parts: tuple[str, ...] | None = ("model", "optimizer")) -> None:
    """Same tensor names, every tensor equal bit for bit (the model and optimizer parts by default)."""
    import torch

    a, b = saved_tensors(left, parts), saved_tensors(right, parts)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different


OUTSIDE_FLOOR = 2.0  # seconds: a time measured from outside the job errs by up to a step (slow on a loaded CPU)


def assert_agrees(reported: float, outside: float, what: object) -> None:
    """A time ``ft-plugins report`` gives against the same time measured from outside the job: within 10 %, or
    :data:`OUTSIDE_FLOOR` where that is more."""
    assert abs(reported - outside) <= max(0.1 * outside, OUTSIDE_FLOOR), (what, reported, outside)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: a hung job's workers too (torchrun starts each in a session
    of its own, so a process group does not reach them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def abort_descendants(pid: int) -> None:
    """SIGABRT every descendant of ``pid``, the deepest first: those started with ``PYTHONFAULTHANDLER=1`` (as
    :func:`run_to_end` starts them) write every thread's Python stack to their stderr first, which says where a hung
    job stood; the workers' own stacks come after their data loader workers', in the tail a failing test shows."""
    import psutil

    levels: list[list[psutil.Process]] = []
    try:
        generation = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return
    while generation:
        levels.append(generation)
        below = []
        for process in generation:
            try:
                below += process.children()
            except psutil.NoSuchProcess:
                pass
        generation = below
    for level in reversed(levels):
        for process in level:
            try:
                process.send_signal(signal.SIGABRT)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(level, timeout=5)


def finish(process: subprocess.Popen, timeout: int) -> tuple[str, str]:
    """``process``'s (stdout, stderr) once it ended; still running after ``timeout`` seconds, its descendants are
    made to write their stacks (:func:`abort_descendants`), it is killed with all of them, and the test fails with
    the tail of its output, those stacks last."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ended = process.poll() is not None
        abort_descendants(process.pid)
        kill_tree(process.pid)
        holders = kill_output_holders(process)  # orphans of the job (no descendants any more) keep its pipes open
        out, err = process.communicate()
        what = f"ended, but processes it left held its output: {holders}" if ended else "still running"
        raise AssertionError(f"{what} after {timeout} s:\n{(out or '')[-4000:]}\n{(err or '')[-12000:]}") from None


def kill_output_holders(process: subprocess.Popen) -> list[int]:
    """SIGKILL every other process holding ``process``'s output pipes open; their pids."""
    pipes = {f"pipe:[{os.fstat(stream.fileno()).st_ino}]" for stream in (process.stdout, process.stderr) if stream}
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if int(pid) != os.getpid() and links & pipes:
            holders.append(int(pid))
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    return holders


def kill_running(pids: Iterable[int]) -> None:
    """SIGKILL those of ``pids`` still running (a test's leftovers)."""
    from ft_plugins.processes import alive

    for pid in pids:
        if alive(pid):
            with suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)


def wait_gone(pids: list[int], timeout: float = 180) -> None:
    """Until none of ``pids`` runs (orphans finishing on their own), or kill them and fail."""
    from ft_plugins.processes import alive

    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            kill_running(pids)
            raise AssertionError(f"processes {pids} still running after {timeout} s")
        time.sleep(0.1)


CLAIM_HOLDER = ("import sys, time\nfrom ft_plugins.checkpoint.claim import take\n"
                "print(take(sys.argv[1]), flush=True)\ntime.sleep(120)\n")


def claim_holder(claim: Path) -> subprocess.Popen:
    """A process that took ``claim`` (``ft_plugins.checkpoint.claim``) and holds it, running until killed."""
    process = subprocess.Popen([PYTHON, "-c", CLAIM_HOLDER, str(claim)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "0"
    return process


def run_to_end(command: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """``subprocess.run`` with captured text output, except that a job still running after ``timeout`` seconds is
    killed with all its workers and the test fails showing where it stood (not a bare ``TimeoutExpired``). The
    whole output is kept in ``cwd/jobs.log``: a failure's message shows only its tail."""
    process = subprocess.Popen(command, cwd=cwd, env={"PYTHONFAULTHANDLER": "1", **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    out, err = finish(process, timeout)
    with open(cwd / "jobs.log", "a") as log:  # every job run here, whole, for a post-mortem
        log.write(f"$ {' '.join(command)}\n{out}\n{err}\nexit {process.returncode}\n\n")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


_ports: Iterator[int] | None = None


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range and in a slice of its own for each pytest
    worker. A port the kernel handed out as free (``bind(0)``) is from that range, where the other worker's
    jobs take theirs for every gloo connection: one was taken before torchrun bound it (EADDRINUSE)."""
    import itertools
    import random
    import socket

    global _ports
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    size = (low - PORTS_FROM) // PORT_SLICES
    if _ports is None:
        start = PORTS_FROM + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % PORT_SLICES * size
        first = random.randrange(size)
        _ports = itertools.cycle([*range(start + first, start + size), *range(start, start + first)])
    for port in itertools.islice(_ports, size):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"every port of this worker's slice ({size} below {low}) is bound")


PORTS_FROM, PORT_SLICES = 10000, 8


VENDOR_PACKAGES = ("taskd", "torch_npu", "mindio_ttp", "fake_record", "mindspore_mstx")


def _vendor_modules() -> list[str]:
    return [name for name in sys.modules if name.split(".")[0] in VENDOR_PACKAGES]


@contextmanager
def vendor_modules_isolated() -> Iterator[None]:
    """Forget vendor modules (fakes or placeholders) on entry and drop those imported inside on exit,
    so one test's vendor stand-in never leaks into another's."""
    saved = {name: sys.modules.pop(name) for name in _vendor_modules()}
    try:
        yield
    finally:
        for name in _vendor_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def cache_dir() -> Path:
    """Downloads the tests keep between runs (``$FT_PLUGINS_TEST_CACHE``, default ``~/.cache/ft_plugins-tests``)."""
    return Path(os.environ.get("FT_PLUGINS_TEST_CACHE") or Path.home() / ".cache" / "ft_plugins-tests")


def pypi_file(project: str, version: str, sdist: bool = False) -> Path:
    """The wheel (for this interpreter) or sdist of ``project==version``, downloaded once into the test cache."""
    wheels = cache_dir() / "wheels"
    pattern = f"{project.replace('-', '_')}-{version}" + (".tar.gz" if sdist else "-*.whl")
    found = sorted(wheels.glob(pattern)) or sorted(wheels.glob(pattern.replace("_", "-", 1)))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        *(["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]),
                        f"{project}=={version}", "-d", str(wheels)], check=True, capture_output=True)
        found = sorted(wheels.glob(pattern)) or sorted(wheels.glob(pattern.replace("_", "-", 1)))
    return found[0]


def mindformers_wheel(version: str) -> Path:
    return pypi_file("mindformers", version)


_STATUS_START = re.compile(r"; (?=[a-z]+ (?:enabled \(|disabled: |requested but disabled: ))")


def statuses(messages: Iterable[str], feature: str) -> list[str]:
    """The ``feature ...`` parts of ft_plugins' start-up summaries (one line, the features joined by "; ")."""
    return [part for message in messages for part in _STATUS_START.split(message) if part.startswith(f"{feature} ")]


def agent_store_client(port: int) -> Any:
    """A process's own connection to a TCPStore standing in for torchrun's agent store at ``port``, in one job's
    namespace of recover's protocol (``ft_plugins.recovery.namespace``)."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    return PrefixStore("ft_plugins/recover/test/0/",
                       TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
