"""Per-process activation: resolve the config, start each feature, log one line per feature.

Framework adapters call :func:`activate` once and keep the returned :class:`Runtime`; it says
which features are on (``runtime.feature("mstx")``) and why each of the others is off.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple, Sequence, TypeVar

from ft_plugins import config as config_module
from ft_plugins import logs
from ft_plugins.features import FEATURES, Feature, declared_options
from ft_plugins.vendors import VendorUnavailable

log = logging.getLogger("ft_plugins")

F = TypeVar("F", bound=Feature)


class FeatureUnavailable(RuntimeError):
    """Strict mode: a requested feature could not start. Raised before training, never inside it."""


class FeatureStatus(NamedTuple):
    name: str
    enabled: bool
    reason: str


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
        self.statuses[name] = FeatureStatus(name, False, reason)
        if self.config.strict:
            raise FeatureUnavailable(f"{name}: {reason}")
        log.warning("%s disabled: %s", name, reason)

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
) -> Runtime:
    """Start the configured features; raises ConfigError for bad config, FeatureUnavailable in strict mode."""
    cfg = config_module.load(declared_options(), env=env, select=features, overrides=options)
    logs.setup(cfg.log_level)
    runtime = Runtime(framework, cfg)
    for name, feature_cls in FEATURES.items():
        wanted = cfg.requested(name)
        if wanted is False:
            how = "FT_PLUGINS=none" if cfg.selection == "none" else "not in the selected features"
            _record(runtime, FeatureStatus(name, False, f"switched off ({how})"))
            continue
        feature = feature_cls(framework, cfg.options[name])
        feature.requested = bool(wanted)
        try:
            found = feature.start()
        except VendorUnavailable as exc:
            if wanted and cfg.strict:
                raise FeatureUnavailable(f"{name} was requested but is unavailable: {exc}") from None
            _record(runtime, FeatureStatus(name, False, str(exc)), warn=bool(wanted))
            continue
        runtime.features[name] = feature
        _record(runtime, FeatureStatus(name, True, found))
    _current[framework] = runtime
    return runtime


def _record(runtime: Runtime, status: FeatureStatus, warn: bool = False) -> None:
    runtime.statuses[status.name] = status
    if status.enabled:
        log.info("%s enabled (%s)", status.name, status.reason)
    elif warn:
        log.warning("%s requested but disabled: %s", status.name, status.reason)
    else:
        log.info("%s disabled: %s", status.name, status.reason)
