"""Which ft_plugins this is, and whether it is whole: its version, where it is installed, and every module of
it imported. A module left out of an install (a packaging slip) shows only when something imports it, deep
in a training job; this finds it up front. The imports run in a child process with every feature off, so
that the asking process activates nothing and loads no framework.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import ft_plugins

DISTRIBUTION = "ft-plugins"
IMPORT_BOUND_S = 300  # MindSpore, transformers and megatron load in the child where they are installed
# Every module below the package, each imported, and each failure sorted: a top-level name other than
# ft_plugins missing is a framework this node does not have (not a fault of the install).
_SWEEP = """
import importlib, json, pkgutil, ft_plugins
broken, needs, count = {}, {}, 0
found = pkgutil.walk_packages(ft_plugins.__path__, "ft_plugins.", onerror=lambda name: None)  # failures: below
names = ["ft_plugins", *(module.name for module in found)]
for name in names:
    if name.rsplit(".", 1)[-1] == "__main__":
        continue
    count += 1
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing.split(".")[0] == "ft_plugins":
            broken[name] = f"{type(error).__name__}: {error}"
        else:
            needs.setdefault(missing.split(".")[0], []).append(name)
    except Exception as error:
        broken[name] = f"{type(error).__name__}: {error}"
print(json.dumps({"count": count, "broken": broken, "needs": needs}))
"""


@dataclass(frozen=True)
class Installation:
    """Where the imported ft_plugins comes from; ``installed`` when it is the copy its distribution installed."""

    version: str
    package_dir: Path
    how: str
    installed: bool

    def describe(self) -> str:
        return f"ft-plugins {self.version} at {self.package_dir} ({self.how})"


@dataclass(frozen=True)
class Imports:
    """The result of importing every module: how many, those broken, and those that need a framework not
    installed here (by the framework's name)."""

    count: int = 0
    broken: dict[str, str] = field(default_factory=dict)
    needs: dict[str, list[str]] = field(default_factory=dict)


def installation() -> Installation:
    here = Path(ft_plugins.__file__).resolve().parent
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return Installation(ft_plugins.__version__, here, "not installed: imported from a source tree", False)
    if json.loads(distribution.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
        how, installed = "editable install of a source tree", True
    elif Path(str(distribution.locate_file("ft_plugins"))).resolve() != here:
        where = distribution.locate_file("ft_plugins")
        how, installed = f"imported from a source tree on sys.path, not the installed copy at {where}", False
    elif distribution.version != ft_plugins.__version__:
        how, installed = f"a stale install: its metadata says {distribution.version}", False
    else:
        how, installed = "installed", True
    return Installation(ft_plugins.__version__, here, how, installed)


def import_every_module() -> Imports:
    """Import every module of the package in a fresh interpreter (every feature off, nothing logged)."""
    env = {**os.environ, "FT_PLUGINS": "none", "FT_PLUGINS_LOG": "error"}
    try:
        child = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True, env=env,
                               timeout=IMPORT_BOUND_S, cwd=Path(ft_plugins.__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return Imports(broken={"ft_plugins": f"importing its modules took over {IMPORT_BOUND_S} s"})
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return Imports(broken={"ft_plugins": f"the import check itself failed: {last}"})
    found = json.loads(child.stdout.strip().splitlines()[-1])
    return Imports(found["count"], found["broken"], found["needs"])
