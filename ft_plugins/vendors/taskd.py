"""Thin adapter over MindCluster's TaskD worker API (``taskd.api.taskd_worker_api``).

TaskD's functions return bool and log their own errors; this adapter adds what users got wrong
by hand: the real module versus the PyPI placeholder named ``taskd``, once-per-process start, and
never an exception into the training loop. The launcher side lives here too: where the installed
package keeps ``libtaskd.so`` (what users find with ``pip show taskd``), TaskD's torchrun patch made
to fit the installed torch, and the job's manager (master election, node counts as integers).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from ft_plugins.config import ConfigError
from ft_plugins.vendors import VendorUnavailable

log = logging.getLogger("ft_plugins.taskd")

WORKER_MODULE = "taskd.api.taskd_worker_api"
MANAGER_MODULE = "taskd.api.taskd_manager_api"
TORCHRUN_AGENT_PATCH = "taskd.python.adaptor.patch"
FRAMEWORKS = ("pt", "ms")
LIBRARY = ("python", "cython_api", "libs", "libtaskd.so")
LIBRARY_LOADER = "taskd.python.cython_api.cython_api"  # loads libtaskd.so on import; ``lib`` is None when it failed
LIBRARY_FIX = "reinstall the taskd wheel shipped with MindCluster, which carries libtaskd.so"
AGENT_NETWORK = "taskd.python.framework.agent.base_agent.agent_network"
MANAGER_PORT = 9601  # where TaskD's proxy looks for the manager, on MASTER_ADDR
AGENT_GIVES_UP_S = 180  # TaskD's INIT_NETWORK_TIMEOUT: then its agent raises and torchrun fails
PROFILING_DIR = "/user/cluster-info/profiling"  # bounded by the worker's disk limit
PROFILING_MIN_VERSION = "7.1.RC1"  # lightweight profiling (libmspti + libtaskd in LD_PRELOAD)


def load_worker_api() -> ModuleType:
    """Import TaskD's worker API, or raise VendorUnavailable saying what is installed instead."""
    if importlib.util.find_spec("taskd") is None:
        raise VendorUnavailable("TaskD is not installed (install the taskd wheel shipped with MindCluster)")
    try:
        module = importlib.import_module(WORKER_MODULE)
    except ImportError as exc:
        placeholder = importlib.import_module("taskd")
        where = getattr(placeholder, "__file__", None) or "unknown location"
        raise VendorUnavailable(
            f"the installed 'taskd' ({where}) has no {WORKER_MODULE}: it is the PyPI placeholder, "
            "not Ascend's TaskD; uninstall it and install the taskd wheel shipped with MindCluster"
            f" ({exc})"
        ) from None
    missing = [name for name in ("init_taskd_worker", "start_taskd_worker") if not hasattr(module, name)]
    if missing:
        raise VendorUnavailable(f"{WORKER_MODULE} lacks {', '.join(missing)}: unsupported TaskD version")
    loader = sys.modules.get(LIBRARY_LOADER)
    if loader is not None and getattr(loader, "lib", True) is None:  # TaskD imports fine and then fails at start
        path, why = library()
        raise VendorUnavailable(f"{why}: {LIBRARY_FIX}" if path is None else
                                f"TaskD could not load {path} in this process (see TaskD's log): {LIBRARY_FIX}")
    return module


class TaskdWorker:
    """Starts this process's TaskD worker exactly once; failures are logged, never raised."""

    def __init__(self, api: ModuleType, disk_limit_mb: int) -> None:
        self._api = api
        self._disk_limit_mb = disk_limit_mb
        self.started_rank: int | None = None
        self.attempted = False

    def start(self, rank: int, framework: str) -> bool:
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
        if self.attempted:
            return self.started_rank is not None
        self.attempted = True
        try:
            if not self._api.init_taskd_worker(rank, self._disk_limit_mb, framework):
                log.warning("taskd: init_taskd_worker(rank=%d) returned False; worker not started", rank)
                return False
            if not self._api.start_taskd_worker():
                log.warning("taskd: start_taskd_worker() returned False on rank %d", rank)
                return False
        except Exception as exc:  # a vendor failure must never stop training
            log.warning("taskd: worker start on rank %d failed: %s: %s", rank, type(exc).__name__, exc)
            return False
        self.started_rank = rank
        log.log(logging.INFO if rank == 0 else logging.DEBUG,  # rank 0 speaks for a healthy job
                "taskd: worker started (rank %d, framework %s, disk limit %d MB)",
                 rank, framework, self._disk_limit_mb)
        return True


def patch_torchrun_agent() -> list[str]:
    """Import TaskD's patch of torch's elastic agent; it must run inside the torchrun process itself,
    before the agent starts (what the vendor guide does with a ``sed`` into torch/distributed/run.py).
    Then make its ``launch_agent`` take what the installed torch passes; returns the parameters adapted."""
    from torch.distributed.launcher import api

    original = api.launch_agent
    try:
        importlib.import_module(TORCHRUN_AGENT_PATCH)
    except ImportError as exc:
        raise VendorUnavailable(f"{TORCHRUN_AGENT_PATCH} cannot be imported ({exc}); TaskD 7.0 or newer ships it") from None
    return fit_launch_agent(api, original)


def warn_without_manager(bound_s: int) -> bool:
    """TaskD's agent starts no worker until a manager answers it and gives up only after
    ``AGENT_GIVES_UP_S``, logging "waiting for message manager" every second; when the torchrun agent
    has found none within ``bound_s``, say once what is missing. Call after :func:`patch_torchrun_agent`;
    False when this TaskD has no agent network to watch."""
    from torch.distributed.elastic.agent.server import api

    try:
        network = importlib.import_module(AGENT_NETWORK)
    except ImportError:
        return False
    invoke_run = api.SimpleElasticAgent._invoke_run

    @functools.wraps(invoke_run)
    def _invoke_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        threading.Thread(target=_await_manager, args=(network.get_msg_network_instance, bound_s),
                         name="ft_plugins-taskd-manager", daemon=True).start()
        return invoke_run(self, *args, **kwargs)

    api.SimpleElasticAgent._invoke_run = _invoke_run
    return True


def _await_manager(connected: Any, bound_s: int) -> None:
    deadline = time.monotonic() + bound_s
    while connected() is None:
        if time.monotonic() >= deadline:
            where = os.environ.get("MASTER_ADDR", "127.0.0.1")
            log.warning("taskd: no TaskD manager answered this node's agent within %d s (it looks for one at "
                        "%s:%d); no worker starts until one does, and after %d s torchrun fails: start it "
                        "with `ft-plugins run --manager` on the master node (or `ft-plugins manager`)",
                        bound_s, where, MANAGER_PORT, AGENT_GIVES_UP_S)
            return
        time.sleep(0.5)


def launch_agent_gap(replacement: Any, original: Any) -> dict[str, Any]:
    """Parameters torch's own ``launch_agent`` has and TaskD's replacement lacks, with their defaults."""
    theirs = inspect.signature(replacement).parameters
    if any(param.kind is param.VAR_KEYWORD for param in theirs.values()):
        return {}
    return {name: param.default for name, param in inspect.signature(original).parameters.items()
            if name not in theirs}


def fit_launch_agent(api: ModuleType, original: Any) -> list[str]:
    """TaskD's ``launch_agent(config, entrypoint, args)`` was written for torch 2.7; torch 2.13's
    ``elastic_launch`` also passes ``health_check_server=`` and torchrun dies with TypeError. Wrap the
    replacement: parameters left at torch's defaults are dropped (the replacement calls torch's own,
    which supplies them); one given a value goes straight to torch's own, with a warning."""
    replacement = api.launch_agent
    gap = {} if replacement is original else launch_agent_gap(replacement, original)
    if not gap:
        return []

    @functools.wraps(replacement)
    def launch_agent(config: Any, entrypoint: Any, args: Any, **kwargs: Any) -> Any:
        passed = {name: kwargs.pop(name) for name in gap if name in kwargs}
        given = [name for name, value in passed.items() if value is not gap[name]]
        if given:
            log.warning("taskd: TaskD's launch_agent cannot take %s; torch's own launch_agent runs instead "
                        "(TaskD's max_restarts default not applied)", ", ".join(given))
            return original(config, entrypoint, args, **passed, **kwargs)
        return replacement(config, entrypoint, args, **kwargs)

    api.launch_agent = launch_agent
    return sorted(gap)


def package_dir() -> Path | None:
    """Where the installed ``taskd`` package lives, found without importing it."""
    spec = importlib.util.find_spec("taskd")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def is_placeholder(root: Path) -> bool:
    """The PyPI package named ``taskd`` has no ``taskd/api``: it is not Ascend's TaskD."""
    return not (root / "api").is_dir()


def installed() -> bool:
    """Whether Ascend's TaskD (not the placeholder) is importable, found without importing it."""
    root = package_dir()
    return root is not None and not is_placeholder(root)


_LOAD_PROBE = ("import ctypes, os, sys\ntry:\n    ctypes.CDLL(sys.argv[1], mode=os.RTLD_LAZY | os.RTLD_LOCAL)\n"
               "except OSError as exc:\n    print(exc)\n")


def load_error(path: Path) -> str | None:
    """Why the dynamic loader refuses ``path`` as TaskD loads it, or None. Tried in a child process: the
    launch-side commands keep libtaskd's Go runtime out of themselves."""
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    result = subprocess.run([sys.executable, "-I", "-c", _LOAD_PROBE, str(path)], env=env, capture_output=True,
                            text=True, timeout=60)
    if result.returncode == 0 and not result.stdout.strip():
        return None
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines[-1].replace(f"{path}: ", "") if lines else f"the loading process exited with {result.returncode}"


def library() -> tuple[Path | None, str]:
    """The installed TaskD's ``libtaskd.so`` (symlinks resolved: TaskD refuses one) if the loader takes it,
    or None and why (the worker, the agent and the manager all need it)."""
    root = package_dir()
    if root is None:
        return None, "TaskD is not installed (install the taskd wheel shipped with MindCluster)"
    if is_placeholder(root):
        return None, f"the 'taskd' at {root} is the PyPI placeholder, not Ascend's TaskD: uninstall it"
    path = root.joinpath(*LIBRARY)
    if not path.is_file():
        return None, f"{path} is missing"
    error = load_error(path)
    if error is not None:
        return None, f"{path} cannot be loaded ({error})"
    return Path(os.path.realpath(path)), "found"


def version(root: Path) -> str | None:
    """``__version__`` from the package's ``version.py`` (TaskD's wheel may carry no dist-info), read not imported."""
    source = root / "version.py"
    if not source.is_file():
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", source.read_text(errors="replace"), re.M)
    return found.group(1) if found else None


def is_master(env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this pod hosts the job's manager: ``MS_SCHED_HOST == POD_IP`` under msrun, ``RANK == 0``
    (the pod rank the Ascend operator sets) under torchrun; the reason, for the log."""
    if env.get("MS_SCHED_HOST"):
        host, pod = env["MS_SCHED_HOST"], env.get("POD_IP", "")
        if host == pod:
            return True, f"MS_SCHED_HOST == POD_IP ({pod})"
        return False, f"MS_SCHED_HOST={host} is not this pod (POD_IP={pod or 'unset'})"
    rank = env.get("RANK")
    if rank is None:
        return True, "no RANK or MS_SCHED_HOST: a single-pod job"
    if rank.strip() == "0":
        return True, "RANK=0"
    return False, f"RANK={rank}: the manager runs on the pod with RANK=0"


def _whole(env: Mapping[str, str], var: str) -> int:
    raw = env[var]
    if not raw.strip().isdigit() or int(raw) <= 0:
        raise ConfigError(f"{var}={raw!r} is not a whole number greater than 0")
    return int(raw)


MANAGER_FLAGS = {"job_id": "pass --job-id (MINDX_TASK_ID is unset)",
                 "node_nums": "pass --nodes (WORLD_SIZE/LOCAL_WORLD_SIZE and MS_WORKER_NUM/MS_LOCAL_WORKER are unset)",
                 "proc_per_node": "pass --procs-per-node (LOCAL_WORLD_SIZE and MS_LOCAL_WORKER are unset)"}


def manager_config(env: Mapping[str, str], job_id: str | None = None, nodes: int | None = None,
                   procs_per_node: int | None = None, launched: tuple[int | None, int | None] = (None, None),
                   fixes: Mapping[str, str] = MANAGER_FLAGS) -> dict[str, Any]:
    """``init_taskd_manager``'s config: flags win, else the operator's variables, else the counts the
    launcher was given (``launched``); counts as integers (TaskD's Go side rejects strings with only a
    log line). ConfigError says what is missing with its fix from ``fixes``."""
    derived_nodes, derived_procs = launched
    for total_var, local_var in (("MS_WORKER_NUM", "MS_LOCAL_WORKER"), ("WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        if total_var in env and local_var in env:
            total, local = _whole(env, total_var), _whole(env, local_var)
            if total % local:
                raise ConfigError(f"{total_var}={total} is not a multiple of {local_var}={local}; "
                                  "pass --nodes and --procs-per-node")
            derived_nodes, derived_procs = total // local, local
            break
    config = {"job_id": job_id or env.get("MINDX_TASK_ID"), "node_nums": nodes or derived_nodes,
              "proc_per_node": procs_per_node or derived_procs}
    missing = [fixes[key] for key, value in config.items() if not value]
    if missing:
        raise ConfigError("TaskD manager config incomplete: " + "; ".join(missing))
    return config


def manager_environment_gaps(env: Mapping[str, str]) -> list[str]:
    """What the manager's environment lacks: the cluster address, and what the MindIO controller it
    starts (unless TASKD_PROCESS_ENABLE=off) needs."""
    gaps = []
    if not env.get("MINDX_SERVER_IP") and env.get("LOCAL_PROXY_ENABLE") != "on":
        gaps.append("MINDX_SERVER_IP (set by the Ascend operator; or LOCAL_PROXY_ENABLE=on)")
    if env.get("TASKD_PROCESS_ENABLE") != "off":
        if not (env.get("WORLD_SIZE") or env.get("MS_WORKER_NUM")):
            gaps.append("WORLD_SIZE or MS_WORKER_NUM (for the MindIO controller)")
        gaps += [f"{var} (for the MindIO controller; or TASKD_PROCESS_ENABLE=off)"
                 for var in ("POD_IP", "TTP_PORT") if not env.get(var)]
    return gaps


def run_manager(config: Mapping[str, Any]) -> bool:
    """Initialise and start TaskD's manager; ``start_taskd_manager`` does not return while it runs."""
    try:
        api = importlib.import_module(MANAGER_MODULE)
    except ImportError as exc:
        raise VendorUnavailable(f"{MANAGER_MODULE} cannot be imported ({exc}); install the taskd wheel shipped "
                                "with MindCluster") from None
    if not api.init_taskd_manager(dict(config)):
        log.error("taskd: init_taskd_manager(%s) returned False; see TaskD's manager log", dict(config))
        return False
    return bool(api.start_taskd_manager())
