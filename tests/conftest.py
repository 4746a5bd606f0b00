"""Fixtures shared by every test area."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import vendor_modules_isolated

pytest_plugins = ("skips_fail_in_ci",)

# The modules whose real multi-process runs take longest, longest first: they start first, so that a
# parallel run (``scripts/test.sh`` runs two pytest workers, one module each at a time) does not end
# with one of them running alone while the other worker idles.
LONGEST_FIRST = (
    "ttp/test_recover.py", "hf/test_trainer_ttp.py", "ttp/test_replicated_dump.py", "checkpoint/test_megatron.py",
    "ttp/test_model_parallel.py", "ttp/test_builtin_engine.py", "mindspore/test_msrun.py", "hf/test_trainer_runs.py",
    "launch/test_real_taskd.py", "ttp/test_auto_restart.py", "torch_plugin/test_replica_option.py",
    "torch_plugin/test_replicated_zero.py", "patch/test_patched_runs.py", "hf/test_accelerate_runs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first, every module's tests in their own order (the sort is stable)."""
    tests = Path(__file__).resolve().parent
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def module(item: pytest.Item) -> int:
        path = Path(str(item.path))
        return rank.get(path.relative_to(tests).as_posix() if path.is_relative_to(tests) else "", len(rank))

    items.sort(key=module)


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
