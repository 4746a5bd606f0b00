"""The environment a launched command gets: bootstrap first on ``PYTHONPATH``, the feature selection,
the fault-injection spec, ``LD_PRELOAD`` built from the installed TaskD and CANN; and the warnings a
user needs before the job starts (flags that switch the bootstrap off, msrun's ``python``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ft_plugins import config
from ft_plugins.faults import parse_faults
from ft_plugins.features import declared_options
from ft_plugins.features.hangs import Bounds
from ft_plugins.launch import BOOTSTRAP_DIR, helper_env, without_bootstrap
from ft_plugins.vendors import cann, taskd

PRELOAD_VAR = "LD_PRELOAD"
# with the c10d rendezvous (--standalone too) torch 2.13 shares the launcher's store with the workers of
# every restart attempt without a per-attempt prefix, so restarted workers read the dead workers' gloo
# addresses; this gives each attempt its own store. Over the static rendezvous restarts are unreliable with or
# without it (measured: `connectFullMesh failed` or a hang), so there the user is told to switch.
FRESH_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
STATIC_RESTARTS = ("torchrun restarts workers over its static rendezvous, where restarted workers read the "
                   "dead workers' Gloo addresses and often fail (`connectFullMesh failed`) or hang: launch with "
                   "--standalone (one node) or --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
# torch's watchdog on an NCCL error or timeout: 3 (its default) ends the process, 2 aborts the communicators only,
# which the survivor's waiting collective then raises, as recover needs; 0 (what torch's abort API asks for) would
# leave a collective that times out waiting for ever where no loss is announced
NCCL_ERRORS_VAR, NCCL_ERRORS_FOR_RECOVER = "TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"
_PYTHON = re.compile(r"python[0-9.]*")
_BLOCKING_FLAGS = {"I": "-I (isolated mode) ignores PYTHONPATH", "E": "-E ignores PYTHON* variables",
                   "S": "-S skips the site module, so no sitecustomize runs"}
_FLAGS_WITH_VALUE = "WXcm"


@dataclass
class Plan:
    """What ``ft-plugins run`` changes, the child's whole environment, and what to warn about."""

    command: list[str]
    env: dict[str, str]
    changes: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def resolve(features: str | None, env: Mapping[str, str]) -> config.Config:
    """The feature selection a launched job will see; ConfigError for a bad list or variable."""
    return config.load(declared_options(), env=env, select=features)


def taskd_library(cfg: config.Config) -> tuple[Path | None, str | None]:
    """The job's ``libtaskd.so`` when TaskD will run; else None and, when that is a problem (asked for, or
    an installed TaskD whose library is missing or unloadable: TaskD stays off), why with the fix."""
    wanted = cfg.requested("taskd")
    if wanted is False:
        return None, None
    path, why_not = taskd.library()
    if path is None and (wanted or taskd.installed()):
        return None, f"{why_not}, so TaskD stays off ({taskd.LIBRARY_FIX})"
    return path, None


def preload(cfg: config.Config, env: Mapping[str, str],
            libtaskd: tuple[Path | None, str | None] | None = None) -> tuple[list[str], list[str]]:
    """Libraries the selected features need in ``LD_PRELOAD`` (libmspti, then libtaskd, as TaskD's guide
    orders them) and what is missing; ``libtaskd``: :func:`taskd_library`, when known. In ``auto`` mode an
    absent runtime is simply off, not missing."""
    path, problem = taskd_library(cfg) if libtaskd is None else libtaskd
    if path is None and problem is None:
        return [], []
    libraries, missing = [], [problem] if problem else []
    wanted_mstx = cfg.requested("mstx")
    if wanted_mstx is not False:
        mspti, why_no_mspti = cann.mspti_library(env)
        if mspti is not None:
            libraries.append(str(mspti))
        elif wanted_mstx:
            missing.append(why_no_mspti)
    if path is not None:
        libraries.append(str(path))
    return libraries, missing


def merge_preload(ours: Sequence[str], existing: str) -> str:
    """Ours first, then the user's entries; each library once (compared after resolving symlinks)."""
    merged: list[str] = []
    seen: set[str] = set()
    for entry in [*ours, *re.split(r"[:\s]+", existing)]:
        key = os.path.realpath(entry) if entry else ""
        if entry and key not in seen:
            seen.add(key)
            merged.append(entry)
    return ":".join(merged)


def blocking_flags(command: Sequence[str]) -> list[str]:
    """Interpreter flags in ``command`` that keep the bootstrap from running, explained."""
    if not command or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return []
    found = []
    for arg in command[1:]:
        if not arg.startswith("-") or arg.startswith("--") or arg == "-":
            break
        for letter in arg[1:]:
            if letter in _BLOCKING_FLAGS:
                found.append(_BLOCKING_FLAGS[letter])
            if letter in _FLAGS_WITH_VALUE:
                break
        if arg[1:2] in ("c", "m"):
            break
    return found


def probe_interpreter(python: str, env: Mapping[str, str], modules: Sequence[str]) -> tuple[str, list[str]]:
    """(its ``sys.executable``, the ``modules`` it cannot find), asked in a child without the bootstrap."""
    code = ("import importlib.util, sys; print(sys.executable); "
            f"print(','.join(m for m in {tuple(modules)!r} if importlib.util.find_spec(m) is None))")
    clean = helper_env(env)
    # from /: `-c` puts the working directory on sys.path, a worker's `python SCRIPT` does not
    result = subprocess.run([python, "-c", code], env=clean, cwd=os.sep, capture_output=True, text=True, timeout=60)
    lines = result.stdout.splitlines() + ["", ""]
    if result.returncode != 0:
        return python, list(modules)
    return lines[0], [name for name in lines[1].split(",") if name]


def msrun_python(env: Mapping[str, str], taskd_on: bool) -> str | None:
    """msrun starts every worker as ``python SCRIPT`` with the first ``python`` on PATH: can it import
    ft_plugins (and taskd, when that feature is on)? The warning, or None."""
    python = shutil.which("python", path=env.get("PATH", os.defpath))
    if python is None:
        return "msrun starts workers as `python SCRIPT`, but no `python` is on PATH"
    modules = ("ft_plugins", "taskd") if taskd_on else ("ft_plugins",)
    executable, missing = probe_interpreter(python, env, modules)
    if not missing:
        return None
    return (f"msrun starts workers with `python` = {executable}, which cannot import {', '.join(missing)}: "
            "put the environment holding them first on PATH")


def is_torchrun(command: Sequence[str]) -> bool:
    return bool(command) and (os.path.basename(command[0]) == "torchrun"
                              or list(command[1:3]) == ["-m", "torch.distributed.run"])


def launcher_options(command: Sequence[str]) -> dict[str, str]:
    """The launcher's own options in ``command``, those before the script, named with dashes
    (``--nproc_per_node=2`` gives ``{"--nproc-per-node": "2"}``; a flag alone gives "")."""
    options: dict[str, str] = {}
    arguments = list(command[1:])
    for index, arg in enumerate(arguments):
        if arg.endswith(".py"):
            break
        name, equals, value = arg.partition("=")
        name = name.replace("_", "-")
        if not equals and index + 1 < len(arguments) and not arguments[index + 1].startswith("-"):
            value = arguments[index + 1]
        options[name] = value
    return options


def torchrun_option(options: Mapping[str, str], env: Mapping[str, str], name: str, default: str = "") -> str:
    """One torchrun option as torchrun sees it: the flag, else its ``PET_`` variable, else ``default``."""
    return options.get(name) or env.get("PET_" + name[2:].upper().replace("-", "_")) or default


def restart_rendezvous(command: Sequence[str]) -> str | None:
    """The rendezvous backend over which ``command``, torchrun, restarts workers (``--max-restarts`` > 0):
    ``c10d`` for ``--standalone``, else ``--rdzv-backend`` (torchrun's default: ``static``); None when
    ``command`` is no restarting torchrun. Only the launcher's own options count, those before the script."""
    if not is_torchrun(command):
        return None
    options = launcher_options(command)
    restarts = options.get("--max-restarts", "0")
    if not (restarts.isdigit() and int(restarts) > 0):
        return None
    return "c10d" if "--standalone" in options else options.get("--rdzv-backend", "static")


def _whole(value: str) -> int | None:
    return int(value) if value.isdigit() and int(value) > 0 else None


def launcher_counts(command: Sequence[str], env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(nodes, processes per node) the launcher in ``command`` is told, where whole numbers: torchrun's
    ``--nnodes`` (one count, not MIN:MAX) and ``--nproc-per-node``, msrun's ``--worker_num`` and
    ``--local_worker_num``; each launcher's defaults where a flag is absent."""
    options = launcher_options(command)
    if is_torchrun(command):
        low, _, high = torchrun_option(options, env, "--nnodes", "1").partition(":")
        return _whole(low) if high in ("", low) else None, _whole(torchrun_option(options, env, "--nproc-per-node", "1"))
    if is_msrun(command):
        total, local = _whole(options.get("--worker-num", "8")), _whole(options.get("--local-worker-num", "8"))
        if total and local and total % local == 0:
            return total // local, local
    return None, None


TASKD_NEEDS_STATIC = ("TaskD's agent in torchrun works over the static rendezvous only (over c10d, --standalone and "
                      "one node without --master-port included, it fails: 'DynamicRendezvousHandler' object has no "
                      "attribute 'rank') and hands its own MASTER_ADDR/MASTER_PORT to the workers: launch torchrun "
                      "with --master-addr and --master-port")


def taskd_master(command: Sequence[str], env: Mapping[str, str]) -> dict[str, str] | None:
    """MASTER_ADDR and MASTER_PORT for TaskD's patched agent, which gives the workers its own (torch's agent
    takes them from the rendezvous): the static rendezvous' --master-addr/--master-port (or its
    --rdzv-endpoint). None when torchrun will not use the static rendezvous, where TaskD's agent fails."""
    options = launcher_options(command)
    if "--standalone" in options or torchrun_option(options, env, "--rdzv-backend", "static") != "static":
        return None
    endpoint = torchrun_option(options, env, "--rdzv-endpoint")
    if not endpoint:
        port = torchrun_option(options, env, "--master-port")
        if not port and torchrun_option(options, env, "--nnodes", "1").rpartition(":")[2] != "1":
            port = "29500"  # torchrun's default beyond one node; one node without a port goes to c10d instead
        endpoint = f"{torchrun_option(options, env, '--master-addr', '127.0.0.1')}:{port}" if port else ""
    host, _, port = endpoint.rpartition(":")
    if not host or _whole(port) is None:
        return None
    return {"MASTER_ADDR": host.strip("[]"), "MASTER_PORT": port}


def is_msrun(command: Sequence[str]) -> bool:
    return bool(command) and (os.path.basename(command[0]) == "msrun"
                              or list(command[1:3]) == ["-m", "mindspore.parallel.cluster.run"])


def plan(command: Sequence[str], features: str | None = None, inject_fault: str | None = None,
         env: Mapping[str, str] | None = None) -> Plan:
    """The launch of ``command`` under ft_plugins; ConfigError (exit 2) for a bad selection or spec."""
    base = dict(os.environ if env is None else env)
    cfg = resolve(features, base)
    changes: dict[str, str] = {}
    if features is not None:
        changes[config.SELECT_VAR] = features
    if inject_fault is not None:
        parse_faults(inject_fault, source="--inject-fault")
        changes[config.INJECT_VAR] = inject_fault
    changes["PYTHONPATH"] = os.pathsep.join(filter(None, [BOOTSTRAP_DIR, without_bootstrap(base.get("PYTHONPATH", ""))]))
    libtaskd = taskd_library(cfg)
    libraries, missing = preload(cfg, base, libtaskd)
    warnings = [f"LD_PRELOAD lacks what the selected features need: {'; '.join(missing)}"] if missing else []
    if libraries:
        merged = merge_preload(libraries, base.get(PRELOAD_VAR, ""))
        if merged != base.get(PRELOAD_VAR):
            changes[PRELOAD_VAR] = merged
    warnings += [f"{flag}: ft_plugins cannot reach `{command[0]}`; drop the flag, or import ft_plugins in the script"
                 for flag in blocking_flags(command)]
    if is_msrun(command):
        wanted = cfg.requested("taskd")
        warning = msrun_python(base, wanted is True or (wanted is None and taskd.package_dir() is not None))
        if warning:
            warnings.append(warning)
    notes = []
    taskd_agent = libtaskd[0] is not None and is_torchrun(command)
    if taskd_agent:
        master = taskd_master(command, base)
        if master is None:
            warnings.append(TASKD_NEEDS_STATIC)
        elif any(base.get(name) != value for name, value in master.items()):
            changes.update(master)
            notes.append(f"MASTER_ADDR={master['MASTER_ADDR']} MASTER_PORT={master['MASTER_PORT']} from torchrun's "
                         "options: TaskD's agent hands these to the workers")
    # under TaskD its agent restarts workers on its manager's command, and only over the static rendezvous
    rendezvous = None if taskd_agent else restart_rendezvous(command)
    if rendezvous == "static":
        warnings.append(STATIC_RESTARTS)
    elif rendezvous == "c10d" and cfg.requested("recover"):
        notes.append("recover with torchrun's restarts: a lost rank is replaced in place, a failure that cannot be "
                     "repaired in place restarts the whole job; the workers keep the agent's store (recover's "
                     "protocol lives there), each attempt's process groups under a prefix of their own")
    elif rendezvous == "c10d" and FRESH_STORE_VAR not in base:
        changes[FRESH_STORE_VAR] = "1"
        notes.append(f"{FRESH_STORE_VAR}=1: each torchrun restart attempt gets a fresh rendezvous store, so "
                     "restarted workers never read the dead workers' addresses")
    if cfg.requested("recover") and is_torchrun(command) and NCCL_ERRORS_VAR not in base:
        changes[NCCL_ERRORS_VAR] = NCCL_ERRORS_FOR_RECOVER
        notes.append(f"{NCCL_ERRORS_VAR}={NCCL_ERRORS_FOR_RECOVER} for recover: on an NCCL error or timeout torch's "
                     "watchdog aborts the communicators and leaves the survivor alive to repair (by default it ends "
                     "the process); not verified on NCCL here")
    notes += hang_watch(command, cfg)
    return Plan(list(command), {**base, **changes}, changes, warnings, notes)


def hang_watch(command: Sequence[str], cfg: config.Config) -> list[str]:
    """The start-up line on hang watching: with which bounds, or why not."""
    if cfg.requested("hangs") is not True:
        return []
    launcher = "torchrun" if is_torchrun(command) else "msrun" if is_msrun(command) else ""
    if not launcher:
        return ["hangs: watched under torchrun or msrun only; this launcher's ranks are not watched"]
    return [f"hangs watched by {launcher}: {Bounds(cfg.options['hangs']).describe()}"]


HCCL_OP_RETRY = "L0:0, L1:1, L2:1"  # HCCL re-runs a failed communication op (MindCluster's guides)
# set by the Ascend operator from the job YAML (`ft-plugins k8s`): shown, never exported
OPERATOR_MANAGED = {
    "pt": (("MINDX_TASK_ID", "the job id"), ("PROCESS_RECOVER", "on, from recover-strategy"),
           ("HIGH_AVAILABILITY", "from recover-strategy (dump, recover, retry)"),
           ("WORLD_SIZE", "processes in the job"), ("RANK", "the pod's rank")),
    "ms": (("MINDX_TASK_ID", "the job id"), ("MS_ENABLE_TFT", "from recover-strategy, e.g. {TTP:1}"),
           ("MINDIO_FOR_MINDSPORE", "1 with MindIO"), ("MS_WORKER_NUM", "processes in the job"),
           ("MS_SCHED_HOST", "the master pod")),
}


def export_lines(features: str | None, framework: str, env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Shell lines exporting what the features need and the operator does not inject; warnings."""
    import shlex

    cfg = resolve(features, env)
    quoted = shlex.quote
    lines = [f"export {config.SELECT_VAR}={quoted(features or env.get(config.SELECT_VAR, 'auto'))}"]
    libraries, missing = preload(cfg, env)
    warnings = [f"LD_PRELOAD lacks what the selected features need: {'; '.join(missing)}"] if missing else []
    if libraries:
        lines.append(f"export {PRELOAD_VAR}={quoted(merge_preload(libraries, env.get(PRELOAD_VAR, '')))}")
    if libraries or cfg.requested("taskd"):
        recovering = env.get("PROCESS_RECOVER") == "on" or bool(env.get("HIGH_AVAILABILITY"))
        lines.append("# on when the job's recover-strategy asks for process recovery, else off (TaskD's guide)")
        lines.append(f"export TASKD_PROCESS_ENABLE={'on' if recovering else 'off'}")
    if cfg.requested("ttp") is not False:
        lines.append(f"export HCCL_OP_RETRY_ENABLE={quoted(HCCL_OP_RETRY)}")
    if framework == "ms":
        cache = env.get("MS_COMPILER_CACHE_PATH") or os.path.join(os.getcwd(), "compile_cache")
        lines.append("# graph compile cache: a restarted job skips compilation (put it on a shared directory)")
        lines += ["export MS_COMPILER_CACHE_ENABLE=1", f"export MS_COMPILER_CACHE_PATH={quoted(cache)}"]
    lines.append("# set by the Ascend operator from the job YAML (use `ft-plugins k8s JOB.yaml`), not here:")
    lines += [f"# export {name}=...  ({meaning})" for name, meaning in OPERATOR_MANAGED[framework]]
    return lines, warnings
