"""Fixtures shared by every test area."""

from __future__ import annotations

import os

import pytest

from support import vendor_modules_isolated

pytest_plugins = ("skips_fail_in_ci",)


@pytest.fixture(autouse=True)
def fresh_log_memory():
    """Each test starts as a fresh process: ft_plugins says each status and configuration error once per process."""
    from ft_plugins.runtime import forget_what_was_said

    forget_what_was_said()


@pytest.fixture
def isolated_vendor_modules():
    """Start without vendor modules (fakes or placeholders) and leave none behind for later tests."""
    with vendor_modules_isolated():
        yield


@pytest.fixture
def no_ft_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear FT_PLUGINS* variables for in-process tests."""
    for name in list(os.environ):
        if name.startswith("FT_PLUGINS"):
            monkeypatch.delenv(name)
