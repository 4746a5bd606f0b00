"""MindSpore side: fault tolerance as MindSpore callbacks, and as a MindFormers YAML ``callbacks:`` entry.

``from ft_plugins.mindspore import FaultTolerance`` gives the callbacks (loaded on first use).
Importing this package also registers them in MindFormers' callback registry: now if MindFormers
is loaded, else the moment its registry module is. The start-up hook ``ft-plugins-mindformers.pth``
installed with the package imports this module in every Python process, which is how
``- type: FaultTolerance`` works in a YAML with no MindFormers source edit and no import in the
training script. Because of that hook, importing this package must stay nearly free: no MindSpore,
no wrapt, no logging until MindFormers is actually imported.
"""

from __future__ import annotations

import sys

CALLBACKS = ("FaultTolerance", "TaskdWorkerCallback", "StepRangesCallback", "TtpCallback", "ResumeCallback",
             "HangsCallback")
REGISTRY_MODULE = "mindformers.tools.register"

__all__ = [*CALLBACKS, "register_with_mindformers"]


def __getattr__(name: str) -> object:
    if name in CALLBACKS:
        from ft_plugins.mindspore import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register(registry_module: object) -> None:
    """Put the callbacks in MindFormers' callback registry, leaving any same-named MindFormers class alone."""
    import logging

    log = logging.getLogger("ft_plugins.mindspore")
    try:
        from ft_plugins.mindspore import callbacks

        register, module_type = registry_module.MindFormerRegister, registry_module.MindFormerModuleType
        for name in CALLBACKS:
            cls = getattr(callbacks, name)
            existing = register.registry.get(module_type.CALLBACK, {}).get(name)
            if existing is not None and existing is not cls:
                log.warning("MindFormers already has a callback named %s (%s.%s); ft_plugins' is not registered",
                            name, existing.__module__, existing.__qualname__)
                continue
            register.register(module_type.CALLBACK)(cls)
        from ft_plugins.mindspore.mindformers import guard_resume

        guard_resume()
    except Exception as exc:  # runs inside MindFormers' import: never break it, never go unheard
        _say_registration_failed(exc)


def _say_registration_failed(exc: Exception) -> None:
    """One line on stderr, not a log record: MindFormers' logging, set up by then, may send ft_plugins'
    records only to its log files, and a YAML ``- type: FaultTolerance`` entry would then fail unexplained."""
    sys.stderr.write(f"ft_plugins: could not register its callbacks with MindFormers: {type(exc).__name__}: {exc}; "
                     "a YAML `- type: FaultTolerance` entry will not be found (check the install: ft-plugins doctor)\n")


def _explain_fatal_tft_switch() -> None:
    """MindSpore aborts at import on some malformed ``MS_ENABLE_TFT`` values; say why before it does."""
    import os

    from ft_plugins.vendors.mindio import import_blocker

    message = import_blocker(os.environ)
    if message:
        import logging

        logging.getLogger("ft_plugins.mindspore").error("%s", message)


class _ImportWatch:
    """A ``sys.meta_path`` finder that loads nothing itself. On ``mindspore``: explain a fatal
    ``MS_ENABLE_TFT``. On MindFormers' registry module: let it load as usual, then register, then retire.

    What wrapt's post-import hooks do, without importing wrapt (and inspect, ast) into every process.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name == "mindspore":
            _explain_fatal_tft_switch()
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)  # the parent package is loaded: this asks the remaining finders
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not a module we can follow: the callbacks then need an explicit import
        load = loader.exec_module

        def load_then_register(module: object) -> None:
            load(module)
            _register(module)

        loader.exec_module = load_then_register
        return spec


def register_with_mindformers() -> None:
    """Register the callbacks with MindFormers now if its registry is loaded, else when it is (idempotent)."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None:
        _register(module)
    elif not any(isinstance(finder, _ImportWatch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatch())


register_with_mindformers()
