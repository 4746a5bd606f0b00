"""The MindFormers start-up hook (the installed ``ft-plugins-mindformers.pth``, run by every interpreter at
start) never fails unheard: where it cannot do its work, one line on stderr names the error, and the process
goes on."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import ft_plugins

from support import PYTHON

INSTALLED_HOOK = Path(ft_plugins.__file__).resolve().parent.parent / "ft-plugins-mindformers.pth"
FAKE_REGISTRY = '''
class MindFormerModuleType:
    CALLBACK = "callback"


class MindFormerRegister:
    registry = {}

    @classmethod
    def register(cls, module_type):
        return lambda klass: cls.registry.setdefault(module_type, {}).setdefault(klass.__name__, klass)
'''


def _python(code: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "PYTHONPATH"))}
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**clean, "PYTHONPATH": pythonpath})


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_the_hook_is_installed_at_the_top_of_site_packages() -> None:
    assert INSTALLED_HOOK.is_file() and INSTALLED_HOOK.read_text().startswith("import ")


def test_a_working_hook_says_nothing() -> None:
    result = _python("import sys; print('ft_plugins.mindspore' in sys.modules, 'mindspore' in sys.modules)")
    assert (result.returncode, result.stdout, result.stderr) == (0, "True False\n", "")


def test_a_broken_install_is_one_line_naming_the_error_and_the_process_goes_on(tmp_path: Path) -> None:
    broken = tmp_path / "ft_plugins"
    broken.mkdir()
    (broken / "__init__.py").write_text("")  # the package without its mindspore part, found first
    result = _python("print('went on')", pythonpath=str(tmp_path))
    assert (result.returncode, result.stdout) == (0, "went on\n"), result.stderr
    (line,) = _said(result.stderr)
    assert line.startswith("ft_plugins: the MindFormers start-up hook (ft-plugins-mindformers.pth) failed: "
                           "ModuleNotFoundError: No module named 'ft_plugins.mindspore'")
    assert "FaultTolerance" in line and "ft-plugins doctor" in line


def test_a_registration_that_fails_inside_mindformers_import_is_one_line(tmp_path: Path) -> None:
    registry = tmp_path / "mindformers" / "tools"
    registry.mkdir(parents=True)
    (registry.parent / "__init__.py").write_text("")
    (registry / "__init__.py").write_text("")
    (registry / "register.py").write_text(FAKE_REGISTRY)
    code = textwrap.dedent("""
        import sys
        sys.modules["ft_plugins.mindspore.callbacks"] = None  # as when a module of the install is missing
        import mindformers.tools.register as registry
        print(sorted(registry.MindFormerRegister.registry.get("callback", {})))
    """)
    result = _python(code, pythonpath=str(tmp_path))
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr
    (line,) = _said(result.stderr)
    assert line.startswith("ft_plugins: could not register its callbacks with MindFormers: ModuleNotFoundError")
    assert "ft_plugins.mindspore.callbacks" in line
