"""Launcher test support: real stub shared libraries, a fake TaskD package tree and CANN tree built per session,
a sitecustomize that ft_plugins' bootstrap must chain-load, and ``ft-plugins run`` as a child process."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from support import FAKES, PYTHON, finish

# Each stub library appends "<name> <pid>" to $FT_FAKE_PRELOAD_RECORD when the loader maps it.
STUB_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void loaded(void) {
    const char *path = getenv("FT_FAKE_PRELOAD_RECORD");
    FILE *out = path ? fopen(path, "a") : NULL;
    if (out) { fprintf(out, "%s %d\n", STUB_NAME, (int)getpid()); fclose(out); }
}
"""

# Chain-loaded by the bootstrap: one JSON line per process with what it saw while ft_plugins initialized.
CHAINED_SITECUSTOMIZE = """
import json, os, sys
path = os.environ.get("FT_TEST_CHAIN_RECORD")
if path:
    with open(path, "a") as out:
        out.write(json.dumps({"pid": os.getpid(), "orig_argv": sys.orig_argv,
                              "pythonpath": os.environ.get("PYTHONPATH", ""),
                              "inject": os.environ.get("FT_PLUGINS_INJECT_FAULT"),
                              "rank": os.environ.get("RANK"), "ms_role": os.environ.get("MS_ROLE")}) + "\\n")
"""


def build_stub(path: Path, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_suffix(".c")
    source.write_text(STUB_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DSTUB_NAME="{name}"', "-o", str(path), str(source)], check=True)
    source.unlink()
    return path


@dataclass(frozen=True)
class Vendors:
    """A site directory holding the fake taskd package with a real libtaskd.so, and a CANN tree."""

    site: Path
    libtaskd: Path
    cann: Path
    libmspti: Path
    chained: Path  # a directory holding a sitecustomize.py to be chain-loaded


@pytest.fixture(scope="session")
def vendors(tmp_path_factory: pytest.TempPathFactory) -> Vendors:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the stub shared libraries: scripts/setup.sh installs it (apt-get install gcc)")
    root = tmp_path_factory.mktemp("vendors")
    site = root / "site"
    shutil.copytree(FAKES / "taskd", site / "taskd", ignore=shutil.ignore_patterns("__pycache__"))
    libtaskd = build_stub(site / "taskd" / "python" / "cython_api" / "libs" / "libtaskd.so", "libtaskd.so")
    cann = root / "Ascend" / "ascend-toolkit" / "latest"
    libmspti = build_stub(cann / "lib64" / "libmspti.so", "libmspti.so")
    (cann / "x86_64-linux").mkdir()
    (cann / "x86_64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.2.RC1\n")
    chained = root / "chained"
    chained.mkdir()
    (chained / "sitecustomize.py").write_text(CHAINED_SITECUSTOMIZE)
    return Vendors(site, libtaskd, cann, libmspti, chained)


def launch_env(vendors: Vendors, workdir: Path, **overrides: str) -> dict[str, str]:
    """The environment of an ``ft-plugins run``: fake TaskD (with its library) before the other fakes,
    a sitecustomize to chain-load, CANN found through ASCEND_HOME_PATH, records in ``workdir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "LD_PRELOAD"))}
    paths = [str(vendors.chained), str(vendors.site), str(FAKES)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    env.update(FT_FAKE_RECORD=str(workdir / "calls.jsonl"), FT_FAKE_PRELOAD_RECORD=str(workdir / "preload.txt"),
               FT_TEST_CHAIN_RECORD=str(workdir / "chain.jsonl"), ASCEND_HOME_PATH=str(vendors.cann))
    env.update(overrides)
    return env


def ft_run(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``ft-plugins run ARGS`` in its own session; a hung job is killed whole on timeout, its workers too."""
    process = subprocess.Popen([PYTHON, "-m", "ft_plugins.cli", "run", *args], env=env, cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err = finish(process, timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def preloaded(workdir: Path) -> dict[int, set[str]]:
    """pid -> the stub libraries the loader mapped into that process."""
    out: dict[int, set[str]] = {}
    path = workdir / "preload.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, pid = line.split()
        out.setdefault(int(pid), set()).add(name)
    return out


# scripts/setup.sh builds the real TaskD here and writes the directory to put on PYTHONPATH into `pythonpath`
REAL_TASKD_BUILD = Path(sys.prefix) / "taskd"
TASKD_LIBRARY = ("taskd", "python", "cython_api", "libs", "libtaskd.so")


@pytest.fixture(scope="session")
def real_taskd() -> Path:
    """The directory holding the real MindCluster TaskD package, built by scripts/setup.sh; on no sys.path."""
    marker = REAL_TASKD_BUILD / "pythonpath"
    if not marker.is_file():
        pytest.fail(f"the real TaskD is not built ({marker} is missing): run scripts/setup.sh")
    root = Path(marker.read_text().strip())
    if not root.joinpath(*TASKD_LIBRARY).is_file():
        pytest.fail(f"{root.joinpath(*TASKD_LIBRARY)} is missing: rm -rf {REAL_TASKD_BUILD}; run scripts/setup.sh")
    missing = [name for name in ("grpc", "google.protobuf") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"the real TaskD needs {', '.join(missing)}: pip install -r scripts/requirements.txt")
    return root


def taskd_without_library(real_taskd: Path, root: Path) -> Path:
    """A copy of the real TaskD's Python side under ``root``, without libtaskd.so: an incomplete install."""
    shutil.copytree(real_taskd / "taskd", root / "taskd", ignore=shutil.ignore_patterns("go", "__pycache__", "libtaskd.so"))
    return root


_JOB_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "MINDX_TASK_ID", "MS_SCHED_HOST", "POD_IP")


def real_taskd_env(taskd_dir: Path, workdir: Path, **overrides: str) -> dict[str, str]:
    """The environment of an ``ft-plugins run`` with ``taskd_dir`` (the real TaskD, or a copy) first on
    PYTHONPATH, no fakes, no job variables from outside, TaskD's logs in ``workdir/taskd_log``."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES
           and not k.startswith(("FT_PLUGINS", "FT_FAKE", "LD_PRELOAD", "TASKD_", "MASTER_", "PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(taskd_dir), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    env.update(TASKD_LOG_PATH=str(workdir / "taskd_log"), **overrides)
    return env


@contextmanager
def taskd_ports() -> Iterator[None]:
    """TaskD's manager and proxy listen on fixed ports (9601, 9602): one real TaskD job per machine at a time."""
    with open(Path(tempfile.gettempdir()) / "ft_plugins-taskd-ports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
