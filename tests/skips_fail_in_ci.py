"""Nothing skips silently in CI: with ``CI`` set (``.ci/run`` sets it), a skipped test is reported as a failure
naming the skip's reason, so a missing tool (gcc, a second interpreter) fails the run instead of thinning it.
Locally a skip stays a skip, listed by ``-ra``."""

from __future__ import annotations

import os
from typing import Any

import pytest

TRUE = ("1", "true", "yes", "on")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in TRUE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI={os.environ['CI']}), which must run every test: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped in CI (CI={os.environ['CI']}): {reason}"
