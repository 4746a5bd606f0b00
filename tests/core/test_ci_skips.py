"""The CI guard against silent skips, shown on a test that skips: a failure under ``CI=true``, a skip without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ci, code, says", [("true", 1, "skipped in CI (CI=true), which must run every test: Skipped: no gcc"),
                                            ("", 0, "1 skipped")])
def test_a_skip_fails_the_run_in_ci_only(tmp_path: Path, ci: str, code: int, says: str) -> None:
    (tmp_path / "test_skipping.py").write_text("import pytest\n\n\ndef test_needs_gcc():\n    pytest.skip('no gcc')\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(TESTS)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "skips_fail_in_ci", "-p", "no:cacheprovider",
                             "-q", "-rA", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == code and says in result.stdout, result.stdout
