"""``ft-plugins doctor``: what would break fault tolerance on this node, each with its fix.

Every check returns OK, WARN or FAIL. A check never changes the node: TaskD's torchrun patch is
imported to compare signatures and torch's ``launch_agent`` is put back at once.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from packaging.version import InvalidVersion, Version

from ft_plugins.launch import BOOTSTRAP_DIR, environment, installation
from ft_plugins.vendors import VendorUnavailable, cann, mindio, taskd, versions

OK, WARN, FAIL = "OK", "WARN", "FAIL"
TASKD_SED_LINE = "import taskd.python.adaptor.patch"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


FRAMEWORKS = versions.SUPPORTED  # each installed one is shown against its supported range; absent is fine
PLACEHOLDERS = {"taskd": "0.0.0.1", "mindcluster": None}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _at_least(found: str, minimum: str) -> bool | None:
    try:
        return Version(found) >= Version(minimum)
    except InvalidVersion:
        return None


def check_install(env: Mapping[str, str]) -> Iterator[Check]:
    """Which ft_plugins this is, and that every module of it imports (a module missing is a FAIL naming it)."""
    found = installation.installation()
    yield Check("ft_plugins", OK if found.installed else WARN, found.describe(),
                "" if found.installed else "install the package: pip install --force-reinstall ft-plugins")
    imports = installation.import_every_module()
    for module, error in sorted(imports.broken.items()):
        yield Check("ft_plugins module", FAIL, f"{module} does not import: {error}",
                    "reinstall: pip install --force-reinstall --no-deps ft-plugins")
    waiting = sum(len(modules) for modules in imports.needs.values())
    frameworks = ", ".join(f"{name} ({len(modules)})" for name, modules in sorted(imports.needs.items()))
    yield Check("ft_plugins modules", FAIL if imports.broken else OK,
                f"{imports.count - len(imports.broken) - waiting} of {imports.count} import"
                + (f"; {waiting} need frameworks not installed here: {frameworks}" if waiting else ""))


def check_versions(env: Mapping[str, str]) -> Iterator[Check]:
    for framework in FRAMEWORKS:
        found = _version(framework.distribution)
        name = f"{framework.distribution} version"
        supported = f"supported: {framework.describe()}"
        standing = None if found is None else framework.standing(found)
        if found is None:
            yield Check(name, OK, f"not installed (needed for {framework.needed_for} only)")
        elif standing == versions.OLDER:
            yield Check(name, WARN, f"{found} is older than {framework.oldest}, needed for {framework.needed_for} "
                        f"({supported})", f"upgrade {framework.distribution} to {framework.oldest} or newer")
        elif standing == versions.NEWER:
            yield Check(name, WARN, f"{found} is newer than the newest release tested ({supported}): a hook whose "
                        "internals moved turns its feature off, saying so in one line",
                        f"use {framework.distribution} {framework.newest}.x, or read each feature's start-up line")
        else:
            unknown = " (version not understood)" if standing == versions.UNKNOWN else ""
            yield Check(name, OK, f"{found}{unknown} ({supported})")
    yield from _check_trainer_rng_load(env)
    root = taskd.package_dir()
    if root is not None and not taskd.is_placeholder(root):
        found = _version("taskd") or taskd.version(root)
        if found and _at_least(found, taskd.PROFILING_MIN_VERSION) is False:
            yield Check("TaskD version", WARN, f"{found}: lightweight profiling needs {taskd.PROFILING_MIN_VERSION}",
                        "install the taskd wheel of MindCluster 7.1.RC1 or newer")
        else:
            yield Check("TaskD version", OK, found or f"installed at {root} (version unknown)")
    home = cann.home(env)
    if home is None:
        yield Check("CANN version", WARN, "CANN not found (ASCEND_HOME_PATH unset, no standard install)",
                    "on an Ascend node: source <CANN>/set_env.sh")
    else:
        found = cann.version(home)
        if found is None or _at_least(found, cann.MIN_VERSION) is False:
            yield Check("CANN version", WARN, f"{home}: {found or 'version unknown'}; needs {cann.MIN_VERSION}",
                        f"install CANN {cann.MIN_VERSION} or newer")
        else:
            yield Check("CANN version", OK, f"{found} at {home}")


def _check_trainer_rng_load(env: Mapping[str, str]) -> Iterator[Check]:
    """transformers before 4.48 with torch 2.6 or newer: the Trainer's own resume fails loading its RNG files."""
    transformers, torch = _version("transformers"), _version("torch")
    if (transformers and torch and _at_least(transformers, versions.TRANSFORMERS_RNG_SAFE_LOAD) is False
            and _at_least(torch, versions.TORCH_WEIGHTS_ONLY) and env.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") != "1"):
        yield Check("transformers with torch", WARN,
                    f"transformers {transformers} loads the Trainer's RNG files with torch.load's default, which is "
                    f"weights_only since torch {versions.TORCH_WEIGHTS_ONLY} (installed: {torch}): its resume fails "
                    "(\"Unsupported global: GLOBAL numpy.core.multiarray._reconstruct\")",
                    f"set TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, or use transformers "
                    f"{versions.TRANSFORMERS_RNG_SAFE_LOAD} or newer")


def check_placeholders(env: Mapping[str, str]) -> Iterator[Check]:
    root = taskd.package_dir()
    if root is not None and taskd.is_placeholder(root):
        yield Check("taskd package", FAIL, f"{root} is the PyPI placeholder named taskd, not Ascend's TaskD",
                    "pip uninstall taskd; pip install the taskd wheel shipped with MindCluster")
    if _version("mindcluster") is not None:
        yield Check("mindcluster package", FAIL, "the PyPI package 'mindcluster' is a placeholder",
                    "pip uninstall mindcluster (MindCluster is installed on the cluster, not from PyPI)")


def check_preload(env: Mapping[str, str]) -> Iterator[Check]:
    entries = [entry for entry in env.get(environment.PRELOAD_VAR, "").replace(" ", ":").split(":") if entry]
    for entry in entries:
        if not os.path.exists(entry):
            yield Check("LD_PRELOAD entry", WARN, f"{entry} does not exist (the loader skips it with an error "
                        "in every process)", "remove it from LD_PRELOAD")
    if not taskd.installed():
        return
    resolved = {os.path.realpath(entry): entry for entry in entries}
    for label, (path, why) in (("libtaskd.so", taskd.library()), ("libmspti.so", cann.mspti_library(env))):
        if path is None and label == "libtaskd.so":
            yield Check(label, FAIL, f"{why}: TaskD's worker, agent and manager cannot start", taskd.LIBRARY_FIX)
            continue
        if path is None:
            yield Check(label, WARN, why, "needed for TaskD's lightweight profiling")
            continue
        given = resolved.get(str(path))
        if given is None:
            yield Check(label, WARN, f"{path} is not in LD_PRELOAD",
                        "launch with `ft-plugins run`, or eval \"$(ft-plugins env)\" in the start script")
        elif os.path.islink(given):
            yield Check(label, FAIL, f"LD_PRELOAD names it through the symlink {given}: TaskD refuses symlinks",
                        f"use the real path {path}")
        else:
            yield Check(label, OK, f"{given} in LD_PRELOAD")


@contextlib.contextmanager
def taskd_log_elsewhere() -> Iterator[None]:
    """TaskD's modules open their log on import, in ``./taskd_log`` unless TASKD_LOG_PATH says otherwise, and
    echo it on stdout: for doctor's probe both go to a temporary directory, removed after."""
    saved = {name: os.environ.get(name) for name in ("TASKD_LOG_PATH", "TASKD_LOG_STDOUT")}
    with tempfile.TemporaryDirectory(prefix="ft_plugins-doctor-") as scratch:
        os.environ.update(TASKD_LOG_PATH=os.path.join(scratch, "taskd_log"), TASKD_LOG_STDOUT="False")
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def check_launch_agent(env: Mapping[str, str]) -> Iterator[Check]:
    root = taskd.package_dir()
    if root is None or taskd.is_placeholder(root) or importlib.util.find_spec("torch") is None:
        return
    from torch.distributed.launcher import api

    run_py = Path(api.__file__).parent.parent / "run.py"
    sed_edited = TASKD_SED_LINE in run_py.read_text(errors="replace")
    original = api.launch_agent
    try:
        with taskd_log_elsewhere():
            importlib.import_module(taskd.TORCHRUN_AGENT_PATCH)
        gap = taskd.launch_agent_gap(api.launch_agent, original)
    except Exception as exc:
        yield Check("TaskD torchrun patch", WARN, f"{taskd.TORCHRUN_AGENT_PATCH} cannot be imported: {exc}",
                    "install the taskd wheel shipped with MindCluster")
        return
    finally:
        api.launch_agent = original
        sys.modules.pop(taskd.TORCHRUN_AGENT_PATCH, None)
    if not gap:
        yield Check("TaskD launch_agent", OK, "its signature matches this torch's")
    elif sed_edited:
        yield Check("TaskD launch_agent", FAIL, f"{run_py} imports TaskD's patch (the guide's sed), whose launch_agent "
                    f"lacks {', '.join(gap)} that this torch passes: torchrun fails with TypeError",
                    f"remove the line '{TASKD_SED_LINE}' from {run_py} and launch with `ft-plugins run`")
    else:
        yield Check("TaskD launch_agent", WARN, f"TaskD's launch_agent lacks {', '.join(gap)} that this torch passes",
                    "launch torchrun through `ft-plugins run`, which adapts it (never the guide's sed)")


def check_tft(env: Mapping[str, str]) -> Iterator[Check]:
    if mindio.TFT_VAR not in env:
        return
    try:
        mindio.tft_switches(env)
    except VendorUnavailable as exc:
        yield Check(mindio.TFT_VAR, FAIL, str(exc), f"write it as {mindio.TFT_VAR}={mindio.TFT_EXAMPLE}")
        return
    yield Check(mindio.TFT_VAR, OK, env[mindio.TFT_VAR])


def check_msrun_python(env: Mapping[str, str]) -> Iterator[Check]:
    if shutil.which("msrun", path=env.get("PATH", os.defpath)) is None:
        return
    warning = environment.msrun_python(env, taskd.package_dir() is not None)
    if warning:
        yield Check("msrun's python", FAIL, warning, "activate the environment that has ft_plugins before msrun")
    else:
        yield Check("msrun's python", OK, "the first `python` on PATH imports ft_plugins")


def check_manager(env: Mapping[str, str]) -> Iterator[Check]:
    if taskd.package_dir() is None and "MINDX_TASK_ID" not in env:
        return
    master, why = taskd.is_master(env)
    if not master:
        yield Check("TaskD manager", OK, f"not this pod's job ({why})")
        return
    try:
        config = taskd.manager_config(env)
    except Exception as exc:
        yield Check("TaskD manager", WARN, str(exc), "run inside the Ascend operator's pod, or pass the flags named")
        return
    gaps = taskd.manager_environment_gaps(env)
    if gaps:
        yield Check("TaskD manager", WARN, f"{config}; the environment lacks {'; '.join(gaps)}",
                    "these come from the Ascend operator and the job YAML (`ft-plugins k8s`)")
    else:
        yield Check("TaskD manager", OK, str(config))


def check_profiling_dir(env: Mapping[str, str]) -> Iterator[Check]:
    if taskd.package_dir() is None:
        return
    directory = Path(taskd.PROFILING_DIR)
    if not directory.is_dir():
        yield Check("profiling directory", WARN, f"{directory} does not exist",
                    "MindCluster mounts /user/cluster-info into the pod; check the job's volumes")
    elif not os.access(directory, os.W_OK | os.X_OK):
        yield Check("profiling directory", FAIL, f"{directory} is not writable by this user",
                    "fix the mount's permissions")
    else:
        yield Check("profiling directory", OK, f"{directory} writable")


def check_sitecustomize(env: Mapping[str, str]) -> Iterator[Check]:
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != BOOTSTRAP_DIR]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None:
        yield Check("sitecustomize", OK, f"{spec.origin} exists: `ft-plugins run` chain-loads it before ft_plugins starts")


def check_hangs(env: Mapping[str, str]) -> Iterator[Check]:
    """The hang bounds a job launched from this environment would get."""
    from ft_plugins.config import ConfigError
    from ft_plugins.features.hangs import Bounds

    try:
        cfg = environment.resolve(None, env)
    except ConfigError as exc:
        yield Check("hangs", FAIL, str(exc), "fix the variable named")
        return
    bounds = Bounds(cfg.options["hangs"]).describe()
    if cfg.requested("hangs") is True:
        yield Check("hangs", OK, f"watched under `ft-plugins run -- torchrun` or `-- msrun`; bounds: {bounds}")
    else:
        yield Check("hangs", OK, f"not watched (FT_PLUGINS=hangs,... or all turns it on); its bounds would be: {bounds}")


CHECKS: tuple[Callable[[Mapping[str, str]], Iterator[Check]], ...] = (
    check_install, check_versions, check_placeholders, check_preload, check_launch_agent, check_tft, check_msrun_python,
    check_manager, check_profiling_dir, check_sitecustomize, check_hangs,
)


def check_grace(save_dir: str | None) -> Check:
    """Whether a dump of the job saving into ``save_dir`` fits in the launcher's grace, by what its saves measured."""
    from ft_plugins import grace

    found = grace.measured(save_dir)
    if found is None:
        where = f"no write measured in {save_dir} yet" if save_dir else "no --save DIR given"
        return Check("dump grace", OK, f"{where}: the dump time is estimated once the job's first save or dump "
                                       "recorded its write speed")
    needed, planned = grace.needed(found), grace.grace_for(found, grace.TORCHRUN_GRACE)
    detail = (f"{grace.describe(found)}; `ft-plugins run` gives the workers {planned:g} s after SIGTERM, "
              f"plain torchrun {grace.TORCHRUN_GRACE:g} s")
    if needed <= grace.TORCHRUN_GRACE:
        return Check("dump grace", OK, detail)
    return Check("dump grace", WARN, detail, f"launch with `ft-plugins run -- torchrun ...`; on Kubernetes "
                                             f"`ft-plugins k8s --save {save_dir}` sets terminationGracePeriodSeconds")


def run_checks(env: Mapping[str, str] | None = None, save_dir: str | None = None) -> list[Check]:
    env = os.environ if env is None else env
    return [*(check for make in CHECKS for check in make(env)), check_grace(save_dir)]


def as_json(checks: list[Check]) -> list[dict[str, str]]:
    return [asdict(check) for check in checks]
