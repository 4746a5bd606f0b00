"""Reversible patches reach every copy of a patched function, including copies taken while its module was being
imported, and a module's post-import patching reads only the modules imported since it began."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator

import pytest

from ft_plugins import patching
from ft_plugins.patching import Patch, PatchSet


class Watched(ModuleType):
    """A module that records whether a pass over the modules' globals read it."""

    read = False

    def __getattribute__(self, name: str) -> Any:
        if name == "__dict__":
            type(self).read = True
        return super().__getattribute__(name)


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``target`` defines ``step`` and, while it is imported, imports ``copier`` (which copies ``step`` by name);
    ``late`` copies it after the import."""
    (tmp_path / "ftp_target.py").write_text("def step():\n    return 'original'\n\nimport ftp_copier  # noqa\n")
    (tmp_path / "ftp_copier.py").write_text("from ftp_target import step\n")
    (tmp_path / "ftp_late.py").write_text("from ftp_target import step\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("ftp_target", "ftp_copier", "ftp_late", "ftp_watched", "ftp_partial", "ftp_activate", "ftp_next"):
        sys.modules.pop(name, None)


def _wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> str:
    return f"patched {wrapped(*args, **kwargs)}"


def test_a_module_imported_after_patching_has_every_copy_patched_and_restored(package: Path) -> None:
    sys.modules["ftp_watched"] = Watched("ftp_watched")  # imported before the target: it cannot hold a copy
    Watched.read = False
    patches = PatchSet("test", (Patch("ftp_target", "step", _wrapper),), lambda *_: None)
    patches.apply()
    import ftp_copier
    import ftp_late
    import ftp_target

    assert ftp_target.step() == ftp_copier.step() == ftp_late.step() == "patched original"
    assert not Watched.read, "the post-import pass read a module imported before the target"
    patches.remove()
    assert ftp_target.step() == ftp_copier.step() == ftp_late.step() == "original"
    assert Watched.read  # removing reads every module: a copy may be anywhere by then


def test_a_set_applied_from_inside_the_import_of_its_module_waits_for_that_import_to_end(
        package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5's ``trainer_utils`` imports torch before it defines ``get_last_checkpoint``, and under
    ``ft-plugins run`` torch's import activates the glue: the set is applied once that import has ended (at the
    next import of anything), never refused as missing on the half-imported module."""
    (package / "ftp_partial.py").write_text("import ftp_activate  # noqa\n\n\ndef step():\n    return 'original'\n")
    (package / "ftp_activate.py").write_text("import ftp_hooks\n\nftp_hooks.activate()\n")
    (package / "ftp_next.py").write_text("")
    missing: list[Exception] = []
    patches = PatchSet("test", (Patch("ftp_partial", "step", _wrapper),), lambda _set, error: missing.append(error))
    monkeypatch.setitem(sys.modules, "ftp_hooks", SimpleNamespace(activate=patches.apply))
    import ftp_partial
    import ftp_next  # noqa: F401  (any import after it)

    assert not missing and ftp_partial.step() == "patched original"
    patches.remove()
    assert ftp_partial.step() == "original"


def test_patching_an_imported_module_reads_every_module(package: Path) -> None:
    import ftp_copier
    import ftp_target

    sys.modules["ftp_watched"] = Watched("ftp_watched")
    Watched.read = False
    patches = PatchSet("test", (Patch("ftp_target", "step", _wrapper),), lambda *_: None)
    patches.apply()
    try:
        assert ftp_copier.step() == "patched original" and Watched.read
    finally:
        patches.remove()
    assert ftp_target.step() == "original"


def test_inside_rebinding_once_removal_and_patching_compose_into_one_pass(package: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import ftp_copier
    import ftp_target

    original = ftp_target.step
    first = PatchSet("first", (Patch("ftp_target", "step", _wrapper),), lambda *_: None)
    first.apply()
    passes: list[int] = []
    scan = patching._scan
    monkeypatch.setattr(patching, "_scan", lambda replacements, imported=None: (passes.append(1), scan(replacements)))
    second = PatchSet("second", (Patch("ftp_target", "step", _wrapper),), lambda *_: None)
    with patching.rebinding_once():
        first.remove()
        second.apply()
    assert passes == [1]
    assert ftp_copier.step is ftp_target.step and ftp_target.step.__wrapped__ is original  # wrapped once
    second.remove()
    assert ftp_copier.step is original



def test_a_deferred_set_is_made_when_its_first_module_is_imported(package: Path) -> None:
    """Its glue is imported with the framework, not at ``apply``; it patches as an eager set does, a module it
    did not declare included. (Modules of their own: a module's post-import hook runs once per process.)"""
    (package / "ftp_first.py").write_text("def step():\n    return 'original'\n\nimport ftp_first_copier  # noqa\n")
    (package / "ftp_first_copier.py").write_text("from ftp_first import step\n")
    (package / "ftp_undeclared.py").write_text("def run():\n    return 'original'\n")
    made: list[str] = []

    def make() -> tuple[Patch, ...]:
        made.append("made")
        return Patch("ftp_first", "step", _wrapper), Patch("ftp_undeclared", "run", _wrapper)

    patches = PatchSet("test", make, lambda *_: None, modules=("ftp_first",))
    patches.apply()
    assert made == []
    try:
        import ftp_first
        import ftp_first_copier

        assert made == ["made"] and ftp_first.step() == ftp_first_copier.step() == "patched original"
        import ftp_undeclared

        assert ftp_undeclared.run() == "patched original" and made == ["made"]
        patches.remove()
        assert ftp_first.step() == ftp_first_copier.step() == ftp_undeclared.run() == "original"
    finally:
        for name in ("ftp_first", "ftp_first_copier", "ftp_undeclared"):
            sys.modules.pop(name, None)
