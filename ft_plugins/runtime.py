"""Per-process activation: resolve the config, start each feature, say once what is on and why.

Framework adapters call :func:`activate` once and keep the returned :class:`Runtime`; it says
which features are on (``runtime.feature("mstx")``) and why each of the others is off.

Logs that scale with the job: rank 0 (or a single process) prints one summary line of every feature's
status; the other ranks print it at DEBUG only, unless their status differs from the one their launcher
published (``ft-plugins run`` exports it in ``FT_LAUNCHER_FEATURES``): then one line naming the rank and
the difference. A process says each status once, however many times it activates (a second ``enable()``,
several single-feature MindSpore callbacks). A configuration error is said once per process, with the rank.
"""

from __future__ import annotations

import logging
import os
from collections import namedtuple
from typing import Any, Mapping, Sequence, TypeVar

from ft_plugins import config as config_module
from ft_plugins import logs
from ft_plugins.features import FEATURES, Feature, declared_options
from ft_plugins.rank import env_rank
from ft_plugins.vendors import VendorUnavailable

log = logging.getLogger("ft_plugins")

F = TypeVar("F", bound=Feature)


class FeatureUnavailable(RuntimeError):
    """Strict mode: a requested feature could not start. Raised before training, never inside it."""


LAUNCHER_FEATURES_VAR = "FT_LAUNCHER_FEATURES"  # "taskd=on,mstx=off,...": what the launcher found


# collections' namedtuple, not typing.NamedTuple: that compiles each field's annotation when the class is made
class FeatureStatus(namedtuple("FeatureStatus", ("name", "enabled", "reason", "requested"), defaults=(False,))):
    __slots__ = ()
    name: str
    enabled: bool
    reason: str
    requested: bool  # asked for by name or ``all``; default False

    def describe(self) -> str:
        if self.enabled:
            return f"{self.name} enabled ({self.reason})"
        return f"{self.name} {'requested but disabled' if self.requested else 'disabled'}: {self.reason}"


class Runtime:
    """The features running in this process for one framework (``pt`` or ``ms``)."""

    def __init__(self, framework: str, config: config_module.Config) -> None:
        self.framework = framework
        self.config = config
        self.features: dict[str, Feature] = {}
        self.statuses: dict[str, FeatureStatus] = {}

    def feature(self, name: str) -> Feature | None:
        return self.features.get(name)

    def running(self, kind: type[F]) -> F | None:
        """The running instance of feature class ``kind``, typed for the glue that calls its methods."""
        found = self.features.get(kind.name)
        return found if isinstance(found, kind) else None

    def disable(self, name: str, reason: str) -> None:
        """Turn a started feature off after the fact, e.g. when its framework hook point is missing."""
        feature = self.features.pop(name, None)
        if feature is None:
            return
        feature.stop()
        self.statuses[name] = status = FeatureStatus(name, False, reason)
        if self.config.strict:
            raise FeatureUnavailable(f"{name}: {reason}")
        if (self.framework, status) not in _said:  # every rank decides the same: rank 0 says it
            _said.add((self.framework, status))
            log.log(logging.WARNING if env_rank() in (0, None) else logging.DEBUG, "%s", status.describe())

    def stop(self) -> None:
        for feature in self.features.values():
            feature.stop()
        self.features.clear()
        if _current.get(self.framework) is self:
            del _current[self.framework]

    def report(self) -> dict[str, dict[str, Any]]:
        """What each feature did, or why it is off: for end-of-run reports and ``--json`` output."""
        out: dict[str, dict[str, Any]] = {}
        for name, status in self.statuses.items():
            feature = self.features.get(name)
            out[name] = {
                "enabled": feature is not None,
                "reason": status.reason,
                "activity": feature.activity() if feature is not None else "",
            }
        return out


_current: dict[str, Runtime] = {}


def current(framework: str) -> Runtime | None:
    """The runtime last activated in this process for ``framework``, if still running."""
    return _current.get(framework)


def activate(
    framework: str,
    features: str | Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    announce: bool = True,
) -> Runtime:
    """Start the configured features and say what is on (``announce``: see the module's docstring); raises
    ConfigError for bad config, FeatureUnavailable in strict mode."""
    cfg = config_module.load(declared_options(), env=env, select=features, overrides=options)
    logs.setup(cfg.log_level)
    runtime = Runtime(framework, cfg)
    for name, feature_cls in FEATURES.items():
        wanted = cfg.requested(name)
        if wanted is False:
            how = "FT_PLUGINS=none" if cfg.selection == "none" else "not in the selected features"
            runtime.statuses[name] = FeatureStatus(name, False, f"switched off ({how})")
            continue
        feature = feature_cls(framework, cfg.options[name])
        feature.requested = bool(wanted)
        try:
            _check_requirements(feature_cls, runtime)
            found = feature.start()
        except VendorUnavailable as exc:
            if wanted and cfg.strict:
                raise FeatureUnavailable(f"{name} was requested but is unavailable: {exc}") from None
            runtime.statuses[name] = FeatureStatus(name, False, str(exc), bool(wanted))
            continue
        runtime.features[name] = feature
        runtime.statuses[name] = FeatureStatus(name, True, found, bool(wanted))
    _current[framework] = runtime
    if announce:
        _announce(runtime)
    return runtime


def _check_requirements(feature_cls: type[Feature], runtime: Runtime) -> None:
    """VendorUnavailable naming the first feature ``feature_cls`` works on top of that is not running."""
    for needed in feature_cls.requires:
        if needed not in runtime.features:
            status = runtime.statuses.get(needed)
            why = status.reason if status is not None else "not started"
            raise VendorUnavailable(f"it needs {needed}, which is off ({why}): FT_PLUGINS={feature_cls.name},{needed}")


_said: set[tuple[str, FeatureStatus]] = set()  # (framework, status) this process has logged


def _announce(runtime: Runtime) -> None:
    """One line for what this process has not said yet: the summary on rank 0, a difference elsewhere."""
    new = [status for status in runtime.statuses.values() if (runtime.framework, status) not in _said]
    if not new:
        return
    _said.update((runtime.framework, status) for status in new)
    summary = "; ".join(status.describe() for status in new)
    rank = env_rank()
    if rank in (0, None):
        warn = any(status.requested and not status.enabled for status in new)
        log.log(logging.WARNING if warn else logging.INFO, "%s", summary)
        return
    launcher = launcher_features()
    differ = [status for status in new if status.name in launcher and launcher[status.name] != status.enabled]
    if differ:
        log.warning("rank %d differs from its launcher: %s", rank, "; ".join(status.describe() for status in differ))
    log.debug("%s", summary)


def launcher_features(env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """What the launcher published (``{feature: on}``); empty when it published nothing readable."""
    raw = (os.environ if env is None else env).get(LAUNCHER_FEATURES_VAR, "")
    pairs = (item.partition("=") for item in raw.split(",") if "=" in item)
    return {name.strip(): value.strip() == "on" for name, _, value in pairs}


def publish_features(runtime: Runtime) -> str:
    """Export this (launcher) process's feature statuses to the processes it starts; returns the value."""
    value = ",".join(f"{name}={'on' if status.enabled else 'off'}" for name, status in runtime.statuses.items())
    os.environ[LAUNCHER_FEATURES_VAR] = value
    return value


_config_errors: set[str] = set()


def forget_what_was_said() -> None:
    """Start the once-per-process log memory over, as a fresh process would (tests run many in one)."""
    _said.clear()
    _config_errors.clear()


def configuration_error(error: config_module.ConfigError) -> None:
    """Say a configuration error once per process, with the rank (every hook call would repeat it)."""
    message = str(error)
    if message in _config_errors:
        return
    _config_errors.add(message)
    rank = env_rank()
    log.error("rank %s: %s; ft_plugins is off in this process", "?" if rank is None else rank, message)
