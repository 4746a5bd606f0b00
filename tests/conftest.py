"""Fixtures shared by every test area."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def no_ft_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear FT_PLUGINS* variables for in-process tests."""
    for name in list(os.environ):
        if name.startswith("FT_PLUGINS"):
            monkeypatch.delenv(name)
