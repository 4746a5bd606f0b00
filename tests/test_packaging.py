"""What users install is what the tests test: the sdist and the wheel hold every file of the package, and
the ft_plugins the tests (and the processes they start) import is an installed one, never the tree."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from support import PYTHON, REPO

PACKAGE, RECIPES = REPO / "ft_plugins", REPO / "patches"
STARTUP_HOOK = "ft-plugins-mindformers.pth"


def _files(root: Path) -> set[str]:
    """Every file below ``root`` that ships (bytecode caches never do), relative to ``root``."""
    return {path.relative_to(root).as_posix() for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def shipped_from_the_tree() -> set[str]:
    """The names an installed ft_plugins must hold, as the tree says: every module and data file of the
    package, every patch recipe (as ``ft_plugins.patches``), and the start-up hook at the top."""
    return ({f"ft_plugins/{name}" for name in _files(PACKAGE)}
            | {f"ft_plugins/patches/{name}" for name in _files(RECIPES)} | {STARTUP_HOOK})


# what a clean checkout does not hold: an earlier build's egg-info would feed its file list to the sdist
NOT_CHECKED_OUT = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "output")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, and the wheel built from it, as ``python -m build`` makes them from a clean checkout."""
    source, out = tmp_path_factory.mktemp("checkout") / "ft_plugins", tmp_path_factory.mktemp("dist")
    shutil.copytree(REPO, source, ignore=NOT_CHECKED_OUT)
    build = subprocess.run([PYTHON, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,), (sdist,) = out.glob("ft_plugins-*.whl"), out.glob("ft_plugins-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_the_wheel_holds_every_module_recipe_and_the_startup_hook(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert sorted(shipped_from_the_tree() - names) == []
    assert "ft_plugins/launch/bootstrap/sitecustomize.py" in names and "sitecustomize.py" not in names
    assert not [name for name in names if name.split("/")[0] in ("tests", "examples", "benchmarks", "scripts")]
    assert "ft-plugins = ft_plugins.cli:main" in entry_points


def test_the_sdist_holds_every_file_the_wheel_is_built_from(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    tree = {f"ft_plugins/{name}" for name in _files(PACKAGE)} | {f"patches/{name}" for name in _files(RECIPES)}
    assert sorted(tree - names) == []
    assert {"pyproject.toml", "setup.py", "README.md"} <= names


def test_one_version_for_the_package_and_its_metadata(built: dict[str, Path]) -> None:
    import ft_plugins

    assert built["wheel"].name.startswith(f"ft_plugins-{ft_plugins.__version__}-")
    assert importlib.metadata.version("ft-plugins") == ft_plugins.__version__


def test_the_installed_package_is_a_whole_install_and_not_the_tree() -> None:
    import ft_plugins

    installed = {str(path) for path in importlib.metadata.files("ft-plugins") or ()}
    assert sorted(shipped_from_the_tree() - installed) == []
    assert Path(ft_plugins.__file__).resolve().parent != PACKAGE


def test_a_process_the_tests_start_imports_the_installed_package() -> None:
    """A ``python -c`` child puts its working directory first on its path: the tests run outside the tree."""
    child = subprocess.run([PYTHON, "-c", "import ft_plugins; print(ft_plugins.__file__)"], capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert child.returncode == 0, child.stderr
    assert Path(child.stdout.strip()).resolve().parent != PACKAGE, child.stdout
    assert Path.cwd().resolve() != REPO


TREE_ON_PATH = re.compile(r"(PYTHONPATH|sys\.path).*\bREPO\b|\bREPO\b.*(PYTHONPATH|sys\.path)")


def test_no_test_puts_the_tree_on_a_python_path() -> None:
    offenders = [f"{path.relative_to(REPO)}:{number}" for path in (REPO / "tests").rglob("*.py")
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if TREE_ON_PATH.search(line) and path.resolve() != Path(__file__).resolve()]
    assert offenders == []

