"""``ft-plugins doctor`` and ``ft-plugins --version`` say which ft_plugins this is, and a broken install is a
FAIL naming the module that does not import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import ft_plugins

from support import PYTHON

INSTALLED = Path(ft_plugins.__file__).resolve().parent


def _cli(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([PYTHON, "-m", "ft_plugins.cli", *args], capture_output=True, text=True, timeout=400,
                          env=env)


@pytest.fixture(scope="module")
def whole() -> list[dict[str, str]]:
    result = _cli("doctor", "--json")
    return json.loads(result.stdout)


def test_version_names_the_version_and_where_it_is_installed() -> None:
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ft-plugins {ft_plugins.__version__} at {INSTALLED} (installed)"


def test_doctor_says_which_ft_plugins_and_that_every_module_imports(whole: list[dict[str, str]]) -> None:
    checks = {check["name"]: check for check in whole if check["name"].startswith("ft_plugins")}
    assert checks["ft_plugins"]["status"] == "OK"
    assert checks["ft_plugins"]["detail"] == f"ft-plugins {ft_plugins.__version__} at {INSTALLED} (installed)"
    count = len([p for p in INSTALLED.rglob("*.py") if p.name != "__main__.py" and "bootstrap" not in p.parts])
    assert (checks["ft_plugins modules"]["status"], checks["ft_plugins modules"]["detail"]) == (
        "OK", f"{count} of {count} import")


def test_a_module_missing_from_the_install_is_a_fail_naming_it(tmp_path: Path) -> None:
    """The packaging slip users met: the wheel without ``ft_plugins/torch/hf/``."""
    shutil.copytree(INSTALLED, tmp_path / "ft_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(tmp_path / "ft_plugins" / "torch" / "hf")
    result = _cli("doctor", "--json", pythonpath=str(tmp_path))
    assert result.returncode == 1, result.stderr
    checks = json.loads(result.stdout)
    failed = {check["detail"] for check in checks if check["name"] == "ft_plugins module"}
    assert "ft_plugins.torch does not import: ModuleNotFoundError: No module named 'ft_plugins.torch.hf'" in failed
    assert all(check["status"] == "FAIL" for check in checks if check["name"].startswith("ft_plugins module"))
    summary = next(check for check in checks if check["name"] == "ft_plugins")
    assert summary["status"] == "WARN" and "imported from a source tree on sys.path, not the installed copy" in summary["detail"]
