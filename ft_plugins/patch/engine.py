"""Plan, write, check and revert a patch run; nothing is written unless every file can be patched.

Writes are atomic (temporary file + rename, file mode kept). Before the first write of a file its
original bytes go to ``<root>/.ft-plugins-patch/backup/`` and ``manifest.json`` records the
original and patched hashes, so ``revert`` restores every file byte for byte, and refuses (again
without writing) when a patched file was changed afterwards.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ft_plugins.patch.codemod import FileResult, hooks_used, patch_source
from ft_plugins.patch.errors import BadRequest, NotSuitable, PatchError
from ft_plugins.patch.recipes import Edit, Recipe, load_recipes, recipe_dir
from ft_plugins.patch.targets import TARGETS, Detection

STATE_DIR = ".ft-plugins-patch"
MANIFEST = "manifest.json"


@dataclass
class FilePlan:
    relpath: str
    path: Path
    result: FileResult

    @property
    def changed(self) -> bool:
        return self.result.patched != self.result.original


@dataclass
class Plan:
    detection: Detection
    recipes: list[Recipe]
    edits: list[Edit]  # selected and applicable
    files: list[FilePlan]
    skipped: list[str] = field(default_factory=list)  # why selected edits cannot be applied here

    @property
    def missing(self) -> list[str]:
        """Edits not in the files yet (what a write would add)."""
        present = {edit_id for plan in self.files for edit_id in plan.result.present}
        return [edit.id for edit in self.edits if edit.id not in present]

    def diff(self) -> str:
        chunks = []
        for plan in self.files:
            if plan.changed:
                chunks.extend(difflib.unified_diff(
                    plan.result.original.decode("utf-8", "replace").splitlines(keepends=True),
                    plan.result.patched.decode("utf-8", "replace").splitlines(keepends=True),
                    f"a/{plan.relpath}", f"b/{plan.relpath}"))
        return "".join(chunks)


def known_features() -> list[str]:
    """Feature names recipes use, plus the registry's: what ``--features`` accepts."""
    from ft_plugins.features import FEATURES

    names = set(FEATURES)
    for target in TARGETS:
        names.update(edit.feature for recipe in load_recipes(target.name) for edit in recipe.edits)
    return sorted(names)


def make_plan(detection: Detection, features: Sequence[str] | None = None) -> Plan:
    """Choose recipes and compute every file's new content; raises PatchError, writes nothing."""
    if features is not None:
        unknown = sorted(set(features) - set(known_features()))
        if unknown:
            raise BadRequest(f"unknown feature(s) {', '.join(unknown)} in --features; "
                             f"choose from {', '.join(known_features())}")
    every = load_recipes(detection.target.name)
    recipes = [recipe for recipe in every if recipe.covers(detection.version)]
    if not recipes:
        ranges = ", ".join(str(recipe.versions) for recipe in every) or "none"
        raise NotSuitable(f"no recipe covers {detection.describe()} (recipe versions: {ranges}; "
                          f"recipes in {recipe_dir() / detection.target.name})")
    import ft_plugins.hooks as hooks

    edits, skipped = [], []
    for recipe in recipes:
        for edit in recipe.edits:
            if features is not None and edit.feature not in features:
                continue
            absent = sorted(name for name in hooks_used(edit) if not hasattr(hooks, name))
            if absent:
                skipped.append(f"{edit.id} ({edit.feature}) skipped: it calls ft_plugins.hooks."
                               f"{', '.join(absent)}, which this ft_plugins version does not have")
                continue
            edits.append(edit)
    if not edits:
        raise NotSuitable(f"nothing to patch in {detection.describe()} for the selected features"
                          + (": " + "; ".join(skipped) if skipped else ""))
    manifest = _read_manifest(detection.root)
    files = []
    for relpath in dict.fromkeys(edit.file for edit in edits):
        path = detection.root / relpath
        try:
            source = path.read_bytes()
        except OSError as exc:
            raise NotSuitable(f"{path}: cannot read ({exc.strerror}); the layout of "
                              f"{detection.target.name} expects it; nothing written") from None
        result = patch_source(source, [edit for edit in edits if edit.file == relpath], str(path))
        if result.present and relpath not in manifest["files"] and result.patched != source:
            raise NotSuitable(f"{path} already has ft-plugins edits but no backup in {detection.root / STATE_DIR}: "
                              "restore the original file first; nothing written")
        files.append(FilePlan(relpath, path, result))
    return Plan(detection, recipes, edits, files, skipped)


def apply(plan: Plan) -> list[str]:
    """Write the planned changes; returns the relative paths written (empty: already patched)."""
    changed = [file for file in plan.files if file.changed]
    if not changed:
        return []
    root = plan.detection.root
    manifest = _read_manifest(root)
    manifest["target"] = plan.detection.target.name
    try:
        for file in changed:
            entry = manifest["files"].get(file.relpath)
            if entry is None:
                _write_atomic(root / STATE_DIR / "backup" / file.relpath, file.result.original, file.path)
                entry = manifest["files"][file.relpath] = {"original": _sha(file.result.original)}
            entry["patched"] = _sha(file.result.patched)
        _write_manifest(root, manifest)  # before the files, so a run cut short can still be reverted
        for file in changed:
            _write_atomic(file.path, file.result.patched, file.path)
    except OSError as exc:
        raise PatchError(f"cannot write {exc.filename} ({exc.strerror}); files already written are "
                         f"restored by ft-plugins patch --revert {root}") from None
    return [file.relpath for file in changed]


def revert(directory: Path, target: str = "auto") -> list[str]:
    """Restore every patched file of the target(s) in ``directory``; refuses without writing if one changed."""
    directory = directory.resolve()
    roots = {root for t in TARGETS if target in ("auto", t.name) and (root := t.root_in(directory))}
    restores: list[tuple[Path, bytes]] = []
    done_roots = []
    for root in sorted(roots):
        manifest = _read_manifest(root)
        if not manifest["files"]:
            continue
        done_roots.append(root)
        for relpath, entry in manifest["files"].items():
            path = root / relpath
            current = _sha(path.read_bytes()) if path.exists() else None
            if current == entry["original"]:
                continue
            if current != entry.get("patched"):
                raise NotSuitable(f"{path} was changed after it was patched: reverting would lose those "
                                  f"changes; its original is {root / STATE_DIR / 'backup' / relpath}; "
                                  "nothing written")
            backup = (root / STATE_DIR / "backup" / relpath).read_bytes()
            if _sha(backup) != entry["original"]:
                raise PatchError(f"backup of {path} does not match its recorded hash; nothing written")
            restores.append((path, backup))
    for path, original in restores:
        _write_atomic(path, original, path)
    for root in done_roots:
        shutil.rmtree(root / STATE_DIR)
    return [str(path) for path, _ in restores]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(root: Path) -> dict:
    path = root / STATE_DIR / MANIFEST
    if not path.exists():
        return {"format": 1, "files": {}}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PatchError(f"{path} is unreadable ({exc}); restore it or the backups beside it by hand") from None


def _write_manifest(root: Path, manifest: dict) -> None:
    path = root / STATE_DIR / MANIFEST
    _write_atomic(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(), None)


def _write_atomic(path: Path, data: bytes, mode_from: Path | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.ft-plugins-tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode_from is not None and mode_from.exists():
            shutil.copymode(mode_from, temporary)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
