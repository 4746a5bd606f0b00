"""What a process started under ``ft-plugins run`` is, and what ft_plugins does in it.

| role | recognised by | ft_plugins |
| --- | --- | --- |
| ``torchrun`` | the torchrun script, ``-m torch.distributed.run`` / ``.launch`` | the launcher side of the features (TaskD's agent patch, fitted to this torch) |
| ``msrun`` | the msrun script, ``-m mindspore.parallel.cluster.run`` | publishes the features its workers start with (MindSpore's process manager starts TaskD's agent itself) |
| ``scheduler`` | ``MS_ROLE=MS_SCHED`` (msrun's scheduler runs the training script too) | nothing |
| ``helper`` | multiprocessing's spawn, forkserver and resource-tracker children | nothing: their parent is active |
| ``worker`` | ``TORCHELASTIC_RUN_ID`` (torchrun) or ``MS_ROLE=MS_WORKER`` (msrun) | active, as ``import ft_plugins.torch`` / ``ft_plugins.mindspore`` do, on the import of its launcher's framework (an msrun worker's import of torch, which MindFormers makes, activates nothing) |
| ``python`` | anything else | active on the import of either framework |
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

log = logging.getLogger("ft_plugins.launch")

LAUNCHERS = {"torchrun": ("torchrun", ("torch.distributed.run", "torch.distributed.launch")),
             "msrun": ("msrun", ("mindspore.parallel.cluster.run",))}
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
FRAMEWORK_GLUE = {"torch": "ft_plugins.torch", "mindspore": "ft_plugins.mindspore"}


@dataclass(frozen=True)
class Role:
    name: str
    reason: str
    framework: str = ""  # the one framework whose import activates ft_plugins here; "": either

    def activates(self, framework: str) -> bool:
        return self.active and self.framework in ("", framework)

    @property
    def active(self) -> bool:
        """Whether training features run in this process."""
        return self.name in ("worker", "python")


CURRENT: Role | None = None  # this process's role, once the bootstrap decided it


def entry(orig_argv: Sequence[str]) -> tuple[str, str]:
    """What the interpreter runs: ``("-m", module)``, ``("-c", code)``, ``("script", path)`` or ``("", "")``."""
    args = list(orig_argv[1:])
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in ("-m", "-c"):
            return arg, args[index + 1] if index + 1 < len(args) else ""
        if arg[:2] in ("-m", "-c") and not arg.startswith("--"):
            return arg[:2], arg[2:]
        if arg in _OPTIONS_WITH_VALUE:
            index += 2
            continue
        if arg.startswith("-") and arg != "-":
            index += 1
            continue
        return "script", arg
    return "", ""


def detect(orig_argv: Sequence[str], env: Mapping[str, str]) -> Role:
    kind, target = entry(orig_argv)
    if "--multiprocessing-fork" in orig_argv or (kind == "-c" and "multiprocessing" in target):
        return Role("helper", "a multiprocessing child or helper")
    for name, (script, modules) in LAUNCHERS.items():
        if (kind == "script" and os.path.basename(target) == script) or (kind == "-m" and target in modules):
            return Role(name, f"the {name} launcher")
    ms_role = env.get("MS_ROLE", "")
    if ms_role == "MS_SCHED":
        return Role("scheduler", "msrun's scheduler (MS_ROLE=MS_SCHED)")
    if ms_role == "MS_WORKER":
        return Role("worker", "an msrun worker (MS_ROLE=MS_WORKER)", "mindspore")
    if env.get("TORCHELASTIC_RUN_ID"):
        return Role("worker", "a torchrun worker (TORCHELASTIC_RUN_ID)", "torch")
    return Role("python", "a Python process")


def boot() -> Role:
    """Called by the bootstrap ``sitecustomize``: decide the role and act on it."""
    global CURRENT
    CURRENT = role = detect(getattr(sys, "orig_argv", sys.argv), os.environ)
    if role.name in LAUNCHERS:
        from ft_plugins import hooks

        hooks.prepare_launcher(role.name)
    elif role.active:
        from ft_plugins.attempts import keep_attempts_apart
        from ft_plugins.patching import when_imported
        from ft_plugins.recovery import defer_collection

        defer_collection(os.environ)
        when_imported("torch.distributed.rendezvous", keep_attempts_apart)
        for framework, glue in FRAMEWORK_GLUE.items():
            if role.activates(framework):
                when_imported(framework, lambda _module, glue=glue: _activate(glue))
    return role


def _activate(glue: str) -> None:
    """Import the framework glue, which activates the configured features. A failure is logged and
    the framework's import goes on, unless ``FT_PLUGINS_STRICT=1`` asked to stop before training."""
    from ft_plugins.config import strict_requested

    try:
        __import__(glue)
    except Exception as exc:
        if strict_requested(os.environ):
            raise
        log.error("ft_plugins: %s could not be activated: %s: %s", glue, type(exc).__name__, exc)
