"""What a directory is: a repository or an installed package that a recipe can patch, and its version.

Each :class:`Target` names the package directory recipes are relative to and the files or folders
that identify its layout. ``DIR`` may be the repository (or site-packages) holding that package, or
the package directory itself. Versions are read from the package's own version file without
importing it, so detection works on copies and on packages whose dependencies are missing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ft_plugins.patch.errors import BadRequest, NotSuitable


def _assigned_strings(path: Path) -> dict[str, object]:
    """Top-level ``NAME = <literal>`` assignments of a Python file (empty when unreadable)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return {}
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def _dunder_version(*candidates: str) -> Callable[[Path], str | None]:
    def read(root: Path) -> str | None:
        for name in candidates:
            version = _assigned_strings(root / name).get("__version__")
            if isinstance(version, str):
                return version
        return None

    return read


def _megatron_version(root: Path) -> str | None:
    info = _assigned_strings(root / "core" / "package_info.py")
    parts = [info.get(key) for key in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(str(part) for part in parts) if all(isinstance(p, int) for p in parts) else None


def _no_version(root: Path) -> str | None:
    return None


def _top_level_functions(path: Path) -> set[str]:
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set()
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    package: str | None  # directory recipes are relative to when DIR holds it; None: DIR itself
    markers: tuple[tuple[str, ...], ...]  # every group must have one existing path
    read_version: Callable[[Path], str | None]
    defines: tuple[str, tuple[str, ...]] | None = None  # (file, functions it must define at top level)

    def matches(self, root: Path) -> bool:
        if not all(any((root / path).exists() for path in group) for group in self.markers):
            return False
        if self.defines is not None:
            file, functions = self.defines
            return set(functions) <= _top_level_functions(root / file)
        return True

    def root_in(self, directory: Path) -> Path | None:
        """The directory recipes of this target are relative to, if ``directory`` holds this target."""
        candidates = [directory / self.package] if self.package else []
        for candidate in (*candidates, directory):
            if candidate.is_dir() and self.matches(candidate):
                return candidate
        return None


# In auto-detection order: a MindSpeed-LLM checkout also holds megatron, a legacy one has no megatron/training/.
TARGETS: tuple[Target, ...] = (
    Target("mindspeed-llm", "MindSpeed-LLM / ModelLink training loop", "mindspeed_llm",
           (("training/training.py",),), _no_version),
    Target("megatron-legacy", "Megatron-LM legacy layout (megatron/training.py, optimizer/, mpu)", "megatron",
           (("training.py",), ("optimizer",), ("mpu", "core/parallel_state.py")), _megatron_version),
    Target("megatron-core", "Megatron-LM / megatron-core with megatron/training/", "megatron",
           (("training/training.py",), ("core/package_info.py",)), _megatron_version),
    Target("mindformers", "MindFormers trainer", "mindformers",
           (("trainer/base_trainer.py",),), _dunder_version("version.py", "__init__.py")),
    Target("torchrun", "torchrun launcher (torch.distributed.run)", "torch",
           (("distributed/run.py",),), _dunder_version("version.py", "__init__.py")),
    Target("resnet-pytorch", "ResNet-50 ImageNet example (main.py with main_worker)", None,
           (("main.py",),), _no_version, defines=("main.py", ("main_worker", "save_checkpoint"))),
)
BY_NAME = {target.name: target for target in TARGETS}


@dataclass(frozen=True)
class Detection:
    target: Target
    root: Path
    version: str | None
    others: tuple[str, ...] = ()  # other targets the directory also matches

    def describe(self) -> str:
        version = f" {self.version}" if self.version else ""
        also = f" (also looks like {', '.join(self.others)}: choose with --target)" if self.others else ""
        return f"{self.target.name}{version} at {self.root}: {self.target.description}{also}"


def detect(directory: Path, target: str = "auto") -> Detection:
    """Find the target in ``directory``; raises NotSuitable naming what was looked for."""
    directory = directory.resolve()
    if not directory.is_dir():
        raise NotSuitable(f"{directory} is not a directory: give the repository or package directory to patch")
    if target != "auto" and target not in BY_NAME:
        raise BadRequest(f"unknown target {target!r}; choose auto or one of {', '.join(BY_NAME)}")
    wanted = TARGETS if target == "auto" else (BY_NAME[target],)
    found = [(t, root) for t in wanted if (root := t.root_in(directory)) is not None]
    if not found:
        looked = "; ".join(_expected(t) for t in wanted)
        raise NotSuitable(f"{directory} does not look like a known layout (looked for {looked})")
    chosen, root = found[0]
    return Detection(chosen, root, chosen.read_version(root), tuple(t.name for t, _ in found[1:]))


def _expected(target: Target) -> str:
    paths = " + ".join("|".join(group) for group in target.markers)
    where = f"{target.package}/ or the package directory itself" if target.package else "the directory"
    return f"{target.name}: {paths} in {where}"
