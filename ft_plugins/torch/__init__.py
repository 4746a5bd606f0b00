"""PyTorch side: ``import ft_plugins.torch`` turns on the configured features for Megatron / MindSpeed-LLM
and for the Hugging Face Trainer and Accelerate.

Importing this module calls :func:`enable` with the environment's configuration (``FT_PLUGINS``
and friends). Hooks into megatron, transformers and accelerate are applied now for those imported,
otherwise the moment they are. Nothing here raises into training: a bad configuration or a missing vendor runtime is
logged and the affected features stay off, unless ``FT_PLUGINS_STRICT=1``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ft_plugins import events
from ft_plugins.config import STRICT_VAR, ConfigError, parse_bool
from ft_plugins.patching import rebinding_once
from ft_plugins.runtime import Runtime, activate, configuration_error
from ft_plugins.torch import forks

FRAMEWORK = "pt"

_runtime: Runtime | None = None
_integrations: list[Any] = []


def enable(
    features: str | Sequence[str] | None = None, **options: Mapping[str, Any]
) -> Runtime:
    """Activate features for this process; a repeated call reconfigures (old hooks removed first).

    ``features``: ``"auto"``, ``"all"``, ``"none"``, a comma string or a list; default: ``FT_PLUGINS``.
    ``options``: per feature, e.g. ``enable("mstx", mstx={"backend": "noop"})``.
    Raises ConfigError for bad values and FeatureUnavailable in strict mode.
    """
    global _runtime
    from ft_plugins.torch.hf import HFIntegration
    from ft_plugins.torch.megatron import MegatronIntegration

    with rebinding_once():
        disable()
        runtime = activate(FRAMEWORK, features=features, options=options)
        events.start("worker")
        forks.guard(bool(runtime.features))
        _runtime = runtime
        _integrations[:] = [MegatronIntegration(runtime), HFIntegration(runtime)]
        for integration in _integrations:
            integration.apply()
    return runtime


def disable() -> None:
    """Remove every hook and stop the features; the frameworks' functions are the originals again."""
    global _runtime
    with rebinding_once():
        for integration in reversed(_integrations):
            integration.remove()
    _integrations.clear()
    forks.guard(False)
    if _runtime is not None:
        _runtime.stop()
    _runtime = None


def runtime() -> Runtime | None:
    """The active runtime (features on, statuses, report), or None when disabled."""
    return _runtime


def __getattr__(name: str) -> Any:
    """``ReplicatedZeroOptimizer`` and ``FaultToleranceCallback`` (imports transformers) on first use."""
    if name == "ReplicatedZeroOptimizer":
        from ft_plugins.torch.replicated import ReplicatedZeroOptimizer

        return ReplicatedZeroOptimizer
    if name == "FaultToleranceCallback":
        from ft_plugins.torch.hf.callback import FaultToleranceCallback

        return FaultToleranceCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _enable_from_environment() -> None:
    import os

    try:
        enable()
    except ConfigError as exc:
        configuration_error(exc)
        try:
            strict = parse_bool(os.environ.get(STRICT_VAR, "0"))
        except ValueError:
            strict = False
        if strict:
            raise


_enable_from_environment()
