"""``ft_plugins.launch.leftovers``: torchrun's close of its workers, then SIGKILL to what the failed ones left in
their process groups. Real processes in torch's own ``SubprocessHandler`` (each in a session of its own, as torchrun
starts its workers); the real jobs: ``tests/torch_megatron/test_dump_grace.py`` (under ``ft-plugins run``) and its
negative control, plain torchrun, in ``test_builtin_engine.py``."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from support import PYTHON, kill_running, wait_gone

from ft_plugins.launch import leftovers
from ft_plugins.processes import alive

WORKER = """import subprocess, sys
child = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
sys.exit(int(sys.argv[2]))
"""


def _worker(tmp_path: Path, name: str, code: int) -> tuple[Any, int]:
    """A torchrun worker (torch's handler) that starts a child which does not watch it, then exits with ``code``."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    record = tmp_path / name
    extra = {"numa_options": None} if "numa_options" in inspect.signature(SubprocessHandler).parameters else {}
    handler = SubprocessHandler(PYTHON, ("-c", WORKER, str(record), code), {}, None, None, 0, **extra)
    handler.proc.wait(60)
    return handler, int(record.read_text())


@pytest.fixture
def children() -> Iterator[list[int]]:
    started: list[int] = []
    yield started
    kill_running(started)


def test_a_failed_workers_group_is_ended_after_torchs_close_and_a_well_ended_ones_left(
        tmp_path: Path, children: list[int]) -> None:
    (failed, failed_child), (ended, ended_child) = _worker(tmp_path, "failed", 3), _worker(tmp_path, "ended", 0)
    children += [failed_child, ended_child]
    assert alive(failed_child) and alive(ended_child)  # torch's own close signals neither: both exited
    closed: list[tuple] = []
    context = SimpleNamespace(subprocess_handlers={0: failed, 1: ended})
    assert leftovers.close(lambda *args, **kwargs: closed.append((args, kwargs)), context, (signal.SIGTERM,),
                           {"timeout": 5}) is None
    assert closed == [((signal.SIGTERM,), {"timeout": 5})], "torch's close runs first, as called"
    wait_gone([failed_child], timeout=10)
    assert alive(ended_child), "a worker that ended well keeps what it left running, as under torchrun"


def test_a_failed_worker_that_left_nothing_is_passed_over(tmp_path: Path) -> None:
    handler, child = _worker(tmp_path, "alone", 1)
    os.kill(child, signal.SIGKILL)
    wait_gone([child], timeout=10)
    leftovers.close(lambda: None, SimpleNamespace(subprocess_handlers={0: handler}), (), {})  # no ProcessLookupError


def test_the_torchrun_process_gets_it_with_or_without_ft_plugins_run() -> None:
    """``prepare_launcher`` (``ft-plugins run``'s bootstrap, or torch's ``run.py`` patched by ``ft-plugins patch``)
    installs it in torchrun, grace planned or not; not in msrun."""
    code = ("import wrapt, ft_plugins.hooks as h\n"
            "from torch.distributed.elastic.multiprocessing.api import PContext\n"
            "h.prepare_launcher(__import__('sys').argv[1])\n"
            "print(isinstance(PContext.__dict__['close'], wrapt.FunctionWrapper))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    said = {launcher: subprocess.run([PYTHON, "-c", code, launcher], capture_output=True, text=True,
                                     env={**env, "FT_PLUGINS": "none"}) for launcher in ("torchrun", "msrun")}
    assert [said[launcher].stdout.strip() for launcher in ("torchrun", "msrun")] == ["True", "False"], said
