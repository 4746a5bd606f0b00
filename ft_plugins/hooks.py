"""The calls ``ft-plugins patch`` writes into source files that monkeypatching cannot reach.

Each call is safe anywhere: it activates the configured features on first use (same
``FT_PLUGINS`` configuration as ``import ft_plugins.torch``), does nothing for features that
are off, and never raises into the training loop.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from ft_plugins import events
from ft_plugins.config import ConfigError
from ft_plugins.features.hangs import Hangs
from ft_plugins.features.mstx import Mstx
from ft_plugins.features.recover import Recover
from ft_plugins.features.resume import Resume
from ft_plugins.features.taskd import Taskd
from ft_plugins.rank import global_rank
from ft_plugins.runtime import F, Runtime, activate, configuration_error, current, publish_features

log = logging.getLogger("ft_plugins")


def _runtime(framework: str) -> Runtime | None:
    runtime = current(framework)
    if runtime is not None:
        return runtime
    try:
        return activate(framework)
    except ConfigError as exc:  # said once per process, however many hook calls ask again
        configuration_error(exc)
        return None


def _running(kind: type[F], framework: str) -> F | None:
    runtime = _runtime(framework)
    return runtime.running(kind) if runtime is not None else None


def start_taskd_worker(rank: int | None = None, framework: str = "pt") -> bool:
    """Start this process's TaskD worker once, with the global rank (default: :func:`ft_plugins.rank.global_rank`,
    which asks a framework only when the process imported it: this hook must not import one). Never raises:
    a worker that cannot start is logged, training goes on."""
    try:
        taskd = _running(Taskd, framework)
        return taskd is not None and taskd.start_worker(global_rank() if rank is None else rank)
    except Exception as exc:  # a source patch has no place to catch it: the training loop must not die here
        log.error("taskd: worker not started: %s: %s", type(exc).__name__, exc)
        return False


class _Range:
    __slots__ = ("_mstx", "_message", "_handle")

    def __init__(self, mstx: Mstx | None, message: str) -> None:
        self._mstx = mstx
        self._message = message
        self._handle: Any = None

    def __enter__(self) -> "_Range":
        if self._mstx is not None:
            self._handle = self._mstx.begin(self._message)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._mstx is not None:
            self._mstx.end(self._handle)


class _StepRange(_Range):
    __slots__ = ()

    def __enter__(self) -> "_StepRange":
        if self._mstx is not None:
            self._handle = self._mstx.begin_step(int(self._message))
        return self


def step_range(iteration: int, framework: str = "pt") -> _Range:
    """``with step_range(n):`` around one training step: the ``step {n}`` range on the device stream."""
    return _StepRange(_running(Mstx, framework), str(iteration))


def named_range(name: str, framework: str = "pt") -> _Range:
    """``with named_range("save_checkpoint"):``; names in use: dataloader, save_checkpoint, forward.
    A kind switched off by its option (``FT_PLUGINS_MSTX_SAVE_CHECKPOINT=off``) emits nothing."""
    mstx = _running(Mstx, framework)
    return _Range(mstx if mstx is not None and mstx.emits(name) else None, name)


def prepare_launcher(launcher: str) -> bool:
    """In the launcher process (``torchrun`` or ``msrun``), before it starts workers: the launcher side of
    the features, i.e. TaskD's elastic-agent patch for process recovery, ``recover``'s agent that
    restarts only a failed worker (torchrun), ``hangs``' watchdog, and the feature list its
    workers compare theirs with. Never raises."""
    framework = "ms" if launcher == "msrun" else "pt"
    events.start("launcher")
    runtime = current(framework)
    if runtime is None:
        try:
            runtime = activate(framework, announce=False)  # the workers say it; this process says one line
        except ConfigError as exc:
            configuration_error(exc)
            return False
    publish_features(runtime)  # a worker whose features differ from these says so
    taskd = runtime.running(Taskd)
    agent = taskd is not None and taskd.prepare_launcher(launcher)
    prepared = agent
    recovering = runtime.running(Recover)
    if launcher == "torchrun" and recovering is not None:
        from ft_plugins.launch import recover

        prepared = recover.install(recovering.settings["spares"]) or prepared
    from ft_plugins.launch import failures, leftovers, shutdown

    if launcher == "torchrun":
        leftovers.install()  # what a failed worker started never outlives the stop
        failures.install()  # the job's events name the workers that failed, not those stopped after them
    shutdown.install(launcher)  # the grace ``ft-plugins run`` planned, for the stop after a worker died too
    hangs = runtime.running(Hangs)
    if hangs is not None:  # after recover's: it ends a hung rank before recover looks
        from ft_plugins.launch import msrun_watch, watchdog

        prepared = (msrun_watch if launcher == "msrun" else watchdog).install(hangs.settings) or prepared
    on = [name for name, status in runtime.statuses.items() if status.enabled]
    log.info("%s launcher: workers start with %s%s", launcher, ", ".join(on) or "no feature on",
             "; TaskD's agent patched for process recovery" if agent else "")
    return prepared


def newest_intact_checkpoint(directory: str, format: str = "auto", framework: str = "pt") -> str | None:
    """Path of the newest intact checkpoint in ``directory`` (None: there is none), logging every
    skipped one with its reason. Uses the ``resume`` options when that feature is on, its defaults
    otherwise: the caller asked for a checkpoint explicitly. Raises NoIntactCheckpoint (before
    training) when checkpoints exist but none is intact, unless FT_PLUGINS_RESUME_ALLOW_SCRATCH=1."""
    feature = _running(Resume, framework)
    if feature is None:
        feature = Resume(framework, {option.name: option.default for option in Resume.options})
        feature.start()
    if not os.path.isdir(directory):
        log.info("resume: %s is not a checkpoint directory; left to the caller", directory)
        return None
    return feature.choose(directory, format).path


def megatron_load_checkpoint(load_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``load_checkpoint`` made to load the newest intact iteration (all ranks agreeing);
    returned unchanged when the ``resume`` feature is off."""
    feature = _running(Resume, "pt")
    if feature is None:
        return load_checkpoint
    from ft_plugins.torch.megatron.resume import MegatronResume

    return MegatronResume(feature).wrap_load(load_checkpoint)
