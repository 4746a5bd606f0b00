"""Warm spares on a kernel without ``pidfd_open``, and after the template's imports started a device: never two
processes for one rank. A kernel without ``pidfd_open`` (Linux before 5.3: 4.19 and 4.15 on many Ascend hosts) made the
template fail once a spare had taken the request, and the launcher then started a fresh process for the same rank;
the template now watches a taken spare by its pid. A device started by the template's imports (a fork then cannot
use it) turns spares off in one line, and a lost rank gets a fresh process. Both run the launcher's own handling of a
lost worker (:meth:`Supervisor._failed`) over a real template, with its fixtures from ``test_spares.py``."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from support import path_first
from test_spares import TEMPLATE, _ready, adoptions_undone, python_exec  # noqa: F401  (autouse fixtures)

from ft_plugins.launch import spare
from ft_plugins.launch.recover import Supervisor
from ft_plugins.launch.replacement import Replacement
from ft_plugins.launch.spares import Forked

ENOSYS = """import errno, os
def pidfd_open(pid, flags=0):
    raise OSError(errno.ENOSYS, "Function not implemented")  # what Linux before 5.3 answers
os.pidfd_open = pidfd_open
"""
MISSING = "import os\ndel os.pidfd_open  # a Python built without it\n"
NPU_STARTED = "import types\nnpu = types.SimpleNamespace(is_initialized=lambda: True)  # torch_npu after set_device\n"
RANK = "2"
# each process that runs as a rank leaves its rank in a file named by its pid, in $RANKS
WORKER = """import os, sys, time
with open(os.path.join(os.environ["RANKS"], str(os.getpid())), "w") as out:
    out.write(os.environ["RANK"])
time.sleep(float(os.environ.get("HOLD", "0")))
sys.exit(int(os.environ.get("CODE", "0")))
"""


class Store:
    """torchrun's store as the supervisor uses it for one failure."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def add(self, name: str, amount: int) -> int:
        self.values[name] = self.values.get(name, 0) + amount
        return self.values[name]

    def set(self, name: str, value: str) -> None:
        self.values[name] = value

    def check(self, names: list[str]) -> bool:
        return all(name in self.values for name in names)

    def compare_set(self, name: str, expected: str, desired: str) -> Any:
        if self.values.get(name, "") == expected:
            self.values[name] = desired
        return self.values[name]


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Path]:
    """Where the processes running as a rank say so; what a failing test left running is ended."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    yield folder
    for pid in _running_as(folder, RANK):
        os.kill(pid, signal.SIGKILL)


def _context(tmp_path: Path, ranks: Path, preload: str) -> SimpleNamespace:
    """torchrun's process context of ``python -u WORKER`` workers, local rank 2 lost; its entrypoint runs the
    template (without torch's imports; ``preload`` imported from ``tmp_path`` instead) or, for a fresh process,
    Python."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    entrypoint = tmp_path / "python"  # the PYTHON_EXEC of the python_exec fixture: a Python command to torchrun
    entrypoint.write_text(f'#!/bin/sh\nif [ "$3" = ft_plugins.launch.spare ]; then shift 3; '
                          f'exec {sys.executable} -c "{TEMPLATE}" "$@"; fi\nexec {sys.executable} "$@"\n')
    entrypoint.chmod(0o755)
    lost = SimpleNamespace(proc=SimpleNamespace(pid=1 << 22, poll=lambda: -signal.SIGKILL),
                           close=lambda death_sig: None)  # its group ended already
    env = {"HOLD": "60", "RANKS": str(ranks), "PRELOAD": preload, "PYTHONPATH": path_first(tmp_path)}
    return SimpleNamespace(entrypoint=str(entrypoint), args={0: ("-u", str(worker)), 2: ("-u", str(worker))},
                           envs={0: {**env, "RANK": "0"}, 2: {**env, "RANK": RANK}}, stdouts={2: ""}, stderrs={2: ""},
                           subprocess_handlers={2: lost})


def _lose_rank(supervisor: Supervisor, context: SimpleNamespace, ranks: Path) -> Any:
    """The launcher's handling of local rank 2's failure; the handle torchrun then holds for that rank, once its
    process runs as the rank."""
    group = SimpleNamespace(workers={2: SimpleNamespace(global_rank=2, world_size=4)},
                            spec=SimpleNamespace(rdzv_handler=SimpleNamespace(use_agent_store=True)))
    supervisor._begin_attempt(0)  # each loss the first of a job: no repair under way
    supervisor.store = Store()
    supervisor._failed(group, context, 2, -signal.SIGKILL)
    handler = context.subprocess_handlers[2]
    deadline = time.monotonic() + 60
    while not (ranks / str(handler.proc.pid)).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return handler


def _running_as(ranks: Path, rank: str) -> list[int]:
    """The live processes that run as ``rank``."""
    found = []
    for said in ranks.iterdir():
        try:
            state = Path(f"/proc/{said.name}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z" and said.read_text() == rank:
            found.append(int(said.name))
    return found


@pytest.mark.parametrize("kernel", [ENOSYS, MISSING], ids=["linux-4.19", "no-pidfd_open"])
def test_without_pidfd_open_a_spare_takes_over_alone_and_its_end_is_known(tmp_path: Path, ranks: Path,
                                                                          kernel: str) -> None:
    (tmp_path / "nopidfd.py").write_text(kernel)
    context = _context(tmp_path, ranks, "nopidfd")
    supervisor = Supervisor(1)
    _ready(supervisor.spares, context)
    try:
        handler = _lose_rank(supervisor, context, ranks)
        assert _running_as(ranks, RANK) == [handler.proc.pid], "one process runs as rank 2"
        assert isinstance(handler.proc, Forked), "a warm spare took over"
        assert handler.proc.poll() is None  # training
        handler.close(signal.SIGKILL)  # torchrun's close of the rank: its process group
        assert handler.proc.wait(timeout=30) == -signal.SIGKILL, "the template saw the spare end without a pidfd"
        context.envs[2] = {**context.envs[2], "HOLD": "0", "CODE": "5"}
        again = _lose_rank(supervisor, context, ranks)  # the spare forked in the first one's place
        assert isinstance(again.proc, Forked) and again.proc.wait(timeout=30) == 5
    finally:
        supervisor.spares.stop()
        supervisor.spares.template.wait(timeout=30)
    assert supervisor.spares.template.returncode == 0


def test_a_device_started_by_the_templates_imports_turns_spares_off_in_one_line(
        tmp_path: Path, ranks: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "torch_npu.py").write_text(NPU_STARTED)
    context = _context(tmp_path, ranks, "torch_npu")
    supervisor = Supervisor(1)
    with caplog.at_level(logging.WARNING, logger="ft_plugins.recover"):
        supervisor.spares.refill(context)
        assert supervisor.spares.template.wait(timeout=60) == 0, "it forks nothing and ends"
        handler = _lose_rank(supervisor, context, ranks)
        supervisor.spares.refill(context)  # the next round: no template again
    assert isinstance(handler, Replacement), "a fresh process, as without spares"
    assert _running_as(ranks, RANK) == [handler.proc.pid]
    said = [record.getMessage() for record in caplog.records if "spares" in record.getMessage()]
    assert len(said) == 1, said
    assert ("warm spares off for this job: the spare template's imports (json, decimal, torch_npu and what they "
            "load) started an NPU (torch_npu.npu.is_initialized()) before its forks") in said[0]
    assert "set FT_PLUGINS_RECOVER_SPARES=0" in said[0] and "a lost rank is replaced by a fresh process" in said[0]
    handler.close(signal.SIGKILL)
    assert handler.proc.wait(timeout=30) == -signal.SIGKILL


def _module(name: str, **attributes: Any) -> SimpleNamespace:
    return SimpleNamespace(__name__=name, **attributes)


@pytest.mark.parametrize("cuda, npu, said", [
    (True, None, "CUDA (torch.cuda.is_initialized())"),
    (False, True, "an NPU (torch_npu.npu.is_initialized())"),
    (False, False, ""),
    (None, None, ""),  # neither imported: neither is imported to ask
])
def test_what_started_a_device_is_asked_of_the_frameworks_already_imported(monkeypatch: pytest.MonkeyPatch,
                                                                          cuda: bool | None, npu: bool | None,
                                                                          said: str) -> None:
    for name, started, place in (("torch", cuda, "cuda"), ("torch_npu", npu, "npu")):
        if started is None:
            monkeypatch.delitem(sys.modules, name, raising=False)
        else:
            state = SimpleNamespace(is_initialized=lambda started=started: started)
            monkeypatch.setitem(sys.modules, name, _module(name, **{place: state}))
    assert spare.device_started() == said
    if cuda is None:
        assert "torch" not in sys.modules and "torch_npu" not in sys.modules
