"""Configuration from the environment: which features to turn on, and their options.

``FT_PLUGINS`` selects features: ``auto`` (default: every feature whose runtime is present),
``all``, ``none`` or a comma list of feature names. ``FT_PLUGINS_<FEATURE>_<OPTION>`` sets one
option of one feature; ``FT_PLUGINS_STRICT=1`` turns "feature unavailable" warnings into errors;
``FT_PLUGINS_LOG`` sets the log level of ft_plugins' own messages; ``FT_PLUGINS_EVENTS_DIR`` where the
job's events go (``off``: nowhere), for ``ft-plugins report``; ``FT_PLUGINS_GRACE_MAX`` the most seconds a
launcher's grace before SIGKILL estimated from the job's writes reaches (:mod:`ft_plugins.grace`).
Every malformed value raises :class:`ConfigError` naming the variable and what it accepts.
"""

from __future__ import annotations

import math
import os
from collections import namedtuple
from typing import Any, Callable, Mapping, Sequence

SELECT_VAR = "FT_PLUGINS"
STRICT_VAR = "FT_PLUGINS_STRICT"
LOG_VAR = "FT_PLUGINS_LOG"
INJECT_VAR = "FT_PLUGINS_INJECT_FAULT"  # fire drills: parsed by ft_plugins.faults
RECOVERY_VAR = "FT_PLUGINS_RECOVERY"  # set by recover's launcher side for its workers: ft_plugins.recovery
ROUND_VAR = "FT_PLUGINS_ROUND"  # the same, for each set of workers: torchrun's rendezvous round
PROGRESS_VAR = "FT_PLUGINS_PROGRESS"  # set by the launcher that watches for hangs: ft_plugins.progress
EVENTS_VAR = "FT_PLUGINS_EVENTS_DIR"  # where every process writes its events: ft_plugins.events
EVENTS_JOB_VAR = "FT_PLUGINS_EVENTS_JOB"  # the job's name in them, set by ft-plugins run for its workers
GRACE_VAR = "FT_PLUGINS_GRACE"  # seconds from SIGTERM to SIGKILL ft-plugins run arranged: ft_plugins.grace
GRACE_FOLLOWS_VAR = "FT_PLUGINS_GRACE_FOLLOWS"  # the save directory whose recorded writes raise that grace
GRACE_MAX_VAR = "FT_PLUGINS_GRACE_MAX"  # the most seconds a grace estimated from the writes reaches
GRACE_MAX = 600.0  # a file system stalled during one save must not hold every later stop (and pod) for an hour
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"  # torchrun's restart attempt a worker belongs to (0: the first)
LOG_LEVELS = ("debug", "info", "warning", "error")
PREFIX = "FT_PLUGINS_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """A configuration value that ft_plugins cannot use; the message names the variable and the fix."""


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE[:-1])}")


def strict_requested(env: Mapping[str, str]) -> bool:
    """``FT_PLUGINS_STRICT`` as a bool; a malformed value counts as off (``load`` reports it)."""
    try:
        return parse_bool(env.get(STRICT_VAR, "0"))
    except ValueError:
        return False


def parse_positive_int(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError("expected a whole number") from None
    if value <= 0:
        raise ValueError("expected a number greater than 0")
    return value


def parse_seconds(raw: str) -> float:
    value = float(raw)
    if value <= 0:
        raise ValueError("expected a number of seconds greater than 0")
    return value


def parse_seconds_or_off(raw: str) -> float:
    """Seconds >= 0, where 0 turns the wait it bounds off."""
    value = float(raw)
    if not value >= 0:  # NaN too
        raise ValueError("expected a number of seconds >= 0 (0: off)")
    return value


def grace_max(env: Mapping[str, str]) -> float:
    """``FT_PLUGINS_GRACE_MAX`` in seconds (:data:`GRACE_MAX` when unset); ConfigError naming it when malformed."""
    raw = env.get(GRACE_MAX_VAR)
    if raw is None:
        return GRACE_MAX
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{GRACE_MAX_VAR}={raw!r} is not valid: give the most seconds an estimated grace before "
                          f"SIGKILL may reach, a number greater than 0 (default {GRACE_MAX:g})")
    return value


def parse_count(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("expected a whole number >= 0")
    return value


# collections' namedtuple, not typing.NamedTuple: that compiles each field's annotation when the class is made
# (import time: every training process makes these); the annotations below only document the fields
class Option(namedtuple("Option", ("name", "default", "help", "parse", "choices"), defaults=(str, ()))):
    """One per-feature option, settable as ``FT_PLUGINS_<FEATURE>_<NAME>`` or as a keyword."""

    __slots__ = ()
    name: str
    default: Any
    help: str
    parse: Callable[[str], Any]  # default str
    choices: tuple[str, ...]  # default ()

    def convert(self, raw: Any, source: str) -> Any:
        """Turn a raw value (env string or keyword) into the option's type, or raise ConfigError."""
        if not isinstance(raw, str):
            raw = str(raw).lower() if isinstance(raw, bool) else str(raw)
        if self.choices:
            value = raw.strip().lower()
            if value not in self.choices:
                raise ConfigError(
                    f"{source}={raw!r} is not valid: expected one of {', '.join(self.choices)}"
                )
            return value
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}={raw!r} is not valid: {exc} ({self.help})") from None


class Config(namedtuple("Config", ("selection", "listed", "strict", "log_level", "options"),
                        defaults=(frozenset(), False, "info", {}))):
    """The resolved selection and options. ``selection`` is ``auto``, ``all``, ``none`` or ``list``."""

    __slots__ = ()
    selection: str
    listed: frozenset[str]  # default empty
    strict: bool  # default False
    log_level: str  # default "info"
    options: Mapping[str, Mapping[str, Any]]  # default {}, read-only: load() always passes its own

    def requested(self, feature: str) -> bool | None:
        """True: the user asked for it; False: switched off; None: on if its runtime is present."""
        if self.selection == "auto":
            return None
        if self.selection == "all":
            return True
        if self.selection == "none":
            return False
        return feature in self.listed

    def option(self, feature: str, name: str) -> Any:
        return self.options[feature][name]


def _parse_selection(raw: str, known: Sequence[str], source: str) -> tuple[str, frozenset[str]]:
    value = raw.strip().lower()
    if value in ("", "auto"):
        return "auto", frozenset()
    if value in ("all", "none"):
        return value, frozenset()
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(
            f"{source}={raw!r}: unknown feature {', '.join(map(repr, unknown)) or '(empty list)'}; "
            f"use auto, all, none or a comma list of: {', '.join(known)}"
        )
    return "list", frozenset(names)


def load(
    features: Mapping[str, Sequence[Option]],
    env: Mapping[str, str] | None = None,
    select: str | Sequence[str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Resolve the configuration for ``features`` (name -> options).

    ``select`` and ``overrides`` (feature -> option -> value) come from code, e.g.
    ``ft_plugins.torch.enable(features=...)``, and win over the environment.
    Unknown ``FT_PLUGINS_*`` variables are errors, so a typo never silently does nothing.
    """
    env = os.environ if env is None else env
    known = list(features)
    if select is None:
        selection, listed = _parse_selection(env.get(SELECT_VAR, "auto"), known, SELECT_VAR)
    else:
        raw = select if isinstance(select, str) else ",".join(select)
        selection, listed = _parse_selection(raw, known, "features")
    try:
        strict = parse_bool(env.get(STRICT_VAR, "0"))
    except ValueError as exc:
        raise ConfigError(f"{STRICT_VAR}={env[STRICT_VAR]!r} is not valid: {exc}") from None
    grace_max(env)  # read by the launchers (ft_plugins.grace); a malformed value stops the job's start here
    log_level = Option("log", "info", "log level", choices=LOG_LEVELS).convert(env.get(LOG_VAR, "info"), LOG_VAR)

    by_var = {
        f"{PREFIX}{name.upper()}_{option.name.upper()}": (name, option)
        for name, options in features.items()
        for option in options
    }
    values: dict[str, dict[str, Any]] = {
        name: {option.name: option.default for option in options} for name, options in features.items()
    }
    for var, raw in env.items():
        if not var.startswith(PREFIX) or var in (STRICT_VAR, LOG_VAR, INJECT_VAR, RECOVERY_VAR, ROUND_VAR, PROGRESS_VAR,
                                                 EVENTS_VAR, EVENTS_JOB_VAR, GRACE_VAR, GRACE_FOLLOWS_VAR,
                                                 GRACE_MAX_VAR):
            continue
        if var not in by_var:
            accepted = ", ".join(sorted(by_var)) or "none"
            raise ConfigError(
                f"{var} is not a known ft_plugins variable; accepted: {STRICT_VAR}, {LOG_VAR}, {INJECT_VAR}, "
                f"{EVENTS_VAR}, {GRACE_MAX_VAR}, {accepted}"
            )
        name, option = by_var[var]
        values[name][option.name] = option.convert(raw, var)
    for name, given in (overrides or {}).items():
        if name not in features:
            raise ConfigError(f"options given for unknown feature {name!r}; known: {', '.join(known)}")
        declared = {option.name: option for option in features[name]}
        for key, raw in given.items():
            if key not in declared:
                raise ConfigError(
                    f"unknown option {key!r} for feature {name!r}; known: {', '.join(declared) or 'none'}"
                )
            values[name][key] = declared[key].convert(raw, f"{name}.{key}")
    return Config(selection=selection, listed=listed, strict=strict, log_level=log_level, options=values)
