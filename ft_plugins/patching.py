"""Reversible monkeypatching that reaches every reference, as MindSpeed's patch manager does.

A :class:`Patch` names a function by module and attribute. Applying it wraps the function with
``wrapt`` and rebinds every module global that held the original object, so copies made with
``from megatron.training.training import train_step`` are patched too. Patches for modules not
imported yet are applied by a post-import hook, so import order does not matter. ``remove()``
puts back the original objects exactly. Inside :func:`rebinding_once`, every patch set removed or
applied shares one pass over the modules' globals. A patch set may be deferred: its patches are made when
the first module they patch is imported, so glue needed only with its framework is imported only with it.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from types import ModuleType
from collections import namedtuple
from typing import Any, Callable, Iterator

import wrapt

log = logging.getLogger("ft_plugins")

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


# collections' namedtuple, not typing.NamedTuple: that compiles each field's annotation when the class is made
class Patch(namedtuple("Patch", ("module", "attribute", "wrapper", "required"), defaults=(True,))):
    """``attribute`` is a module global, or ``Class.method`` (wrapped on the class, for every instance)."""

    __slots__ = ()
    module: str
    attribute: str
    wrapper: Wrapper
    required: bool  # default True


class MissingSymbol(LookupError):
    """A patch target does not exist in the imported module (the framework moved it)."""


class PatchSet:
    """A group of patches applied and removed together (one feature's hooks into one framework).

    ``on_missing(patch_set, error)`` is called when a target module turns out to lack a symbol;
    the set is then removed whole, so a feature is never half-applied. ``patches`` may be a function that
    makes them (``modules``: those they patch): it is called when the first of them is imported.
    """

    def __init__(self, name: str, patches: tuple[Patch, ...] | Callable[[], tuple[Patch, ...]],
                 on_missing: Callable[["PatchSet", MissingSymbol], None], modules: tuple[str, ...] = ()) -> None:
        if callable(patches) and not modules:
            raise ValueError(f"patch set {name!r}: deferred patches need the modules they patch")
        self.name = name
        self._make = patches if callable(patches) else None
        self._patches = None if callable(patches) else patches
        self.modules = modules or _modules_of(self._patches or ())
        self._on_missing = on_missing
        self._active = False
        self._wrapped: dict[int, tuple[Any, Any]] = {}  # id(wrapper) -> (wrapper, original)
        self._methods: list[tuple[type, str, Any]] = []  # (class, name, original) of Class.method patches

    @property
    def applied(self) -> bool:
        return bool(self._wrapped or self._methods)

    def apply(self) -> None:
        if self._active:
            return
        self._active = True
        for module_name in self.modules:
            when_imported(module_name, self._module_ready)

    @property
    def patches(self) -> tuple[Patch, ...]:
        """Every patch of the set, made now if it was deferred."""
        if self._patches is None and self._make is not None:
            self._patches = tuple(self._make())
            self._hook_undeclared(self._patches)
        return self._patches or ()

    def _hook_undeclared(self, made: tuple[Patch, ...]) -> None:
        """A made patch whose module the set did not declare is still applied when that module is imported."""
        undeclared = tuple(name for name in _modules_of(made) if name not in self.modules)
        self.modules += undeclared
        for module_name in undeclared if self._active else ():
            when_imported(module_name, self._module_ready)

    def remove(self) -> None:
        """Put the originals back everywhere, including references taken after patching."""
        self._active = False
        _rebind(self._wrapped)
        self._wrapped.clear()
        for owner, name, original in reversed(self._methods):
            setattr(owner, name, original)
        self._methods.clear()

    def _module_ready(self, module: ModuleType) -> None:
        if not self._active:
            return
        patches = [patch for patch in self.patches if patch.module == module.__name__]
        missing = [patch.attribute for patch in patches if patch.required and _lookup(module, patch.attribute) is None]
        if missing:
            error = MissingSymbol(f"{module.__name__}.{', '.join(missing)} is missing")
            self.remove()
            self._on_missing(self, error)
            return
        replacements: dict[int, tuple[Any, Any]] = {}
        for patch in patches:
            if "." in patch.attribute:
                self._wrap_method(module, patch)
                continue
            original = _settled(getattr(module, patch.attribute, None))
            if original is None or id(original) in self._wrapped:
                continue  # optional and absent, or already our wrapper (imported after patching)
            wrapper = wrapt.FunctionWrapper(original, patch.wrapper)
            replacements[id(original)] = (original, wrapper)
            self._wrapped[id(wrapper)] = (wrapper, original)
        _rebind(replacements, module.__name__ if module.__name__ in _importing else None)

    def _wrap_method(self, module: ModuleType, patch: Patch) -> None:
        class_name, name = patch.attribute.rsplit(".", 1)
        owner = _lookup(module, class_name)
        original = vars(owner).get(name) if isinstance(owner, type) else None
        if original is None or any(o is owner and n == name for o, n, _ in self._methods):
            return  # optional and absent (or inherited), or wrapped already
        self._methods.append((owner, name, original))
        setattr(owner, name, wrapt.FunctionWrapper(original, patch.wrapper))


def _modules_of(patches: tuple[Patch, ...]) -> tuple[str, ...]:
    """The modules ``patches`` patch, each once, in their order."""
    return tuple(dict.fromkeys(patch.module for patch in patches))


def _lookup(module: ModuleType, dotted: str) -> Any:
    found: Any = module
    for part in dotted.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


Replacements = dict[int, tuple[Any, Any]]  # id(old) -> (old, new)
_pending: Replacements | None = None  # inside rebinding_once: the replacements its one pass will make
_importing: set[str] = set()  # modules whose post-import hooks are running


@contextmanager
def rebinding_once() -> Iterator[None]:
    """Patch sets removed and applied inside share one pass over every module's globals, made on leaving. With
    torch and megatron imported a pass reads ~80,000 globals: a reconfiguration (``enable()`` again, as a warm
    spare does when it takes over a rank) made 17 passes, 1 s of the take-over."""
    global _pending
    if _pending is not None:  # nested: the outermost makes the pass
        yield
        return
    _pending = {}
    try:
        yield
    finally:
        replacements, _pending = _pending, None
        _scan(replacements)


def _settled(value: Any) -> Any:
    """What a global holding ``value`` will hold once the pending pass is made."""
    hit = _pending.get(id(value)) if _pending else None
    return hit[1] if hit is not None and hit[0] is value else value


def _rebind(replacements: Replacements, imported: str | None = None) -> None:
    """Replace each global that *is* ``old`` by ``new``, in every imported module: now, or composed into the
    pending pass (an old wrapper put back and its original wrapped anew ends as the new wrapper). ``imported``:
    the module that defines the ``old`` objects has just been imported (see :func:`_scan`)."""
    if _pending is None:
        _scan(replacements, imported)
        return
    for key, (old, new) in list(_pending.items()):
        hit = replacements.get(id(new))
        if hit is not None and hit[0] is new:
            _pending[key] = (old, hit[1])
    for key, value in replacements.items():
        _pending.setdefault(key, value)


def _scan(replacements: Replacements, imported: str | None = None) -> None:
    """In every imported module, replace each global that *is* ``old`` by ``new``. Right after ``imported`` was
    imported, only the modules that started importing since it did (``sys.modules`` keeps that order) can
    hold a copy of what it defines: it ran only then; copies taken later get the new objects. With torch
    imported, a whole pass takes ~50 ms, and a worker made one for each megatron module ft_plugins hooks."""
    if not replacements:
        return
    modules = list(sys.modules.items())
    if imported is not None:
        names = [name for name, _ in modules]
        modules = modules[names.index(imported):] if imported in names else modules
    for _, module in modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value:
                namespace[name] = hit[1]


_hooked: dict[str, list[Callable[[ModuleType], None]]] = {}
_finishing: set[str] = set()  # hooked modules still being imported when hooked: run once their import ends


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` now if imported, else right after the module is first imported. A module
    still being imported (a hook registered from inside its import: transformers 5's ``trainer_utils``
    imports torch, whose import activates the glue, before it defines ``get_last_checkpoint``) counts as
    imported once its import has ended."""
    callbacks = _hooked.get(module_name)
    if callbacks is None:
        callbacks = _hooked[module_name] = []
        # fires at once, with nothing registered yet, for a module already in sys.modules
        wrapt.register_post_import_hook(lambda module: _run_hooks(module_name, module), module_name)
    if callback not in callbacks:
        callbacks.append(callback)
    module = sys.modules.get(module_name)
    if module is not None and _being_imported(module):
        _finishing.add(module_name)
        if not any(isinstance(finder, _ImportsEnded) for finder in sys.meta_path):
            sys.meta_path.insert(0, _ImportsEnded())
    elif module is not None:
        callback(module)


def _run_hooks(module_name: str, module: ModuleType) -> None:
    _finishing.discard(module_name)
    _importing.add(module_name)
    try:
        for registered in list(_hooked[module_name]):
            registered(module)
    finally:
        _importing.discard(module_name)


def _being_imported(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _ImportsEnded:
    """A meta path finder that finds nothing: asked at every import of a module not imported yet, it runs the
    hooks of each module in ``_finishing`` whose import has ended (one ending in failure is dropped)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        for module_name in list(_finishing):
            module = sys.modules.get(module_name)
            if module is None:
                _finishing.discard(module_name)
            elif not _being_imported(module):
                _run_hooks(module_name, module)
        return None
