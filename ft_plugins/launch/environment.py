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
from typing import Mapping, Sequence

from ft_plugins import config
from ft_plugins.faults import parse_faults
from ft_plugins.features import declared_options
from ft_plugins.launch import BOOTSTRAP_DIR
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


def preload(cfg: config.Config, env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Libraries the selected features need in ``LD_PRELOAD`` (libmspti, then libtaskd, as TaskD's guide
    orders them) and what is missing. In ``auto`` mode an absent runtime is simply off, not missing."""
    wanted_taskd, wanted_mstx = cfg.requested("taskd"), cfg.requested("mstx")
    if wanted_taskd is False:
        return [], []
    libtaskd, why_not = taskd.library()
    if libtaskd is None and not wanted_taskd:
        return [], []
    libraries, missing = [], [] if libtaskd else [why_not]
    if wanted_mstx is not False:
        mspti, why_no_mspti = cann.mspti_library(env)
        if mspti is not None:
            libraries.append(str(mspti))
        elif wanted_mstx:
            missing.append(why_no_mspti)
    if libtaskd is not None:
        libraries.append(str(libtaskd))
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
    clean = dict(env, PYTHONPATH=without_bootstrap(env.get("PYTHONPATH", "")))
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


def without_bootstrap(value: str) -> str:
    return os.pathsep.join(p for p in value.split(os.pathsep) if p and os.path.abspath(p) != BOOTSTRAP_DIR)


def restart_rendezvous(command: Sequence[str]) -> str | None:
    """The rendezvous backend over which ``command``, torchrun, restarts workers (``--max-restarts`` > 0):
    ``c10d`` for ``--standalone``, else ``--rdzv-backend`` (torchrun's default: ``static``); None when
    ``command`` is no restarting torchrun. Only the launcher's own options count, those before the script."""
    if not command or not (os.path.basename(command[0]) == "torchrun"
                           or list(command[1:3]) == ["-m", "torch.distributed.run"]):
        return None
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
    restarts = options.get("--max-restarts", "0")
    if not (restarts.isdigit() and int(restarts) > 0):
        return None
    return "c10d" if "--standalone" in options else options.get("--rdzv-backend", "static")


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
    libraries, missing = preload(cfg, base)
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
    rendezvous = restart_rendezvous(command)
    if rendezvous == "static":
        warnings.append(STATIC_RESTARTS)
    elif rendezvous == "c10d" and FRESH_STORE_VAR not in base:
        changes[FRESH_STORE_VAR] = "1"
        notes.append(f"{FRESH_STORE_VAR}=1: each torchrun restart attempt gets a fresh rendezvous store, so "
                     "restarted workers never read the dead workers' addresses")
    return Plan(list(command), {**base, **changes}, changes, warnings, notes)


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
