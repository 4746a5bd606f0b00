"""Fixtures shared by every test area."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from support import vendor_modules_isolated

pytest_plugins = ("skips_fail_in_ci",)
# the checks that need a GPU (tests/gpu/README.md): collected only where asked for, on a machine that has one
collect_ignore = [] if os.environ.get("GPU_CHECKS") == "1" else ["gpu"]

# Modules that share a session-scoped run (their reference run) go to one pytest worker, so that the
# run is made once (``scripts/test.sh`` runs two workers); every other module is a group of its own, its
# module-scoped runs made once too.
SHARING = {
    "megatron-4-ranks": ("torch_megatron/test_recover.py", "torch_megatron/test_mindio_recover.py",
                         "torch_megatron/test_model_parallel.py", "torch_megatron/test_hangs_4_ranks.py",
                         "torch_megatron/test_blocking_backend.py"),
    "megatron-2-ranks": ("torch_megatron/test_builtin_engine.py", "torch_megatron/test_mindio_engine.py",
                         "torch_megatron/test_auto_restart.py", "torch_megatron/test_one_decision.py",
                         "torch_megatron/test_recover_flags.py", "torch_megatron/test_hangs.py",
                         "torch_megatron/test_dump_grace.py"),
    "hf-trainer": ("hf/test_trainer_ttp.py", "hf/test_trainer_runs.py", "hf/test_trainer_hooks.py"),
}
# The groups whose real multi-process runs take longest, longest first: they start first, so that the
# run does not end with one of them running alone while the other worker idles.
LONGEST_FIRST = (
    "torch_megatron/test_megatron_newest_suite.py", "torch_megatron/test_megatron_lm_refs.py",
    "torch_megatron/test_elastic.py", "megatron-4-ranks", "hf-trainer", "megatron-2-ranks",
    "torch_megatron/test_pipeline_recover.py",
    "torch_megatron/test_mixed_precision_recover.py", "torch_megatron/test_replicated_dump.py",
    "torch_megatron/test_torch_dist.py", "torch_megatron/test_rampup_recover.py", "torch_megatron/test_moe_recover.py",
    "hf/test_transformers_5.py",
    "checkpoint/test_megatron.py",
    "mindspore/test_msrun.py", "mindspore/test_mindspore_newer.py", "mindspore/test_mindformers_releases.py",
    "mindspore/test_mindformers_hang.py", "mindspore/test_msrun_nodes.py",
    "launch/test_real_taskd.py",
    "torch_megatron/test_replica_option.py", "torch_megatron/test_report_ranks.py", "hf/test_trainer_ttp_replace.py",
    "torch_megatron/test_overlapped_dump.py",
    "torch_plugin/test_replicated_zero.py", "patch/test_patched_runs.py", "hf/test_accelerate_runs.py",
    "torch_megatron/test_megatron_runs.py",
)
_GROUP = {module: group for group, modules in SHARING.items() for module in modules}
_TESTS = Path(__file__).resolve().parent
_TREE = _TESTS.parent
_SCRATCH_CWD = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The tests test what users install: the ft_plugins installed from its wheel (``scripts/setup.sh``),
    never the tree. The tree comes off ``sys.path`` here; once collected, the tests, and every process they
    start, run in a scratch directory (a ``python -c`` child would otherwise put the current directory, the
    tree, first on its path)."""
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _TREE]
    if missing := named_but_missing():
        raise pytest.UsageError(f"tests/conftest.py names test modules that do not exist: {', '.join(missing)}: "
                                "update SHARING and LONGEST_FIRST to where they moved")
    import ft_plugins

    where = Path(ft_plugins.__file__).resolve().parent
    if where == _TREE / "ft_plugins":
        raise pytest.UsageError(
            f"ft_plugins was imported from the source tree ({where}), not from an installed wheel: the tests "
            "test what users install. Run `bash scripts/setup.sh` (it builds and installs the wheel), or "
            "`pip install --force-reinstall --no-deps .` into this environment, not `pip install -e .`")


def pytest_collection_finish(session: pytest.Session) -> None:
    """After collection (a pytest-xdist worker collects the paths it is given from where it started)."""
    scratch = tempfile.mkdtemp(prefix="ft-plugins-tests-")
    os.chdir(scratch)
    session.config.stash[_SCRATCH_CWD] = scratch


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = config.stash.get(_SCRATCH_CWD, None)
    if scratch:
        os.chdir(config.invocation_params.dir)
        shutil.rmtree(scratch, ignore_errors=True)


def named_but_missing() -> list[str]:
    """The modules SHARING and LONGEST_FIRST name that are not there: a moved module would silently lose its
    group (its reference run made twice) and its place in the order."""
    named = [module for modules in SHARING.values() for module in modules]
    named += [name for name in LONGEST_FIRST if name not in SHARING]
    return [name for name in named if not (_TESTS / name).is_file()]


def _group(path: str) -> str:
    """The worker group of the module at ``path`` (a path, or a test id's file part, from the root)."""
    module = Path(path).resolve()
    name = module.relative_to(_TESTS).as_posix() if module.is_relative_to(_TESTS) else str(module)
    return _GROUP.get(name, name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest groups first, every module's tests in their own order (the sort is stable)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(str(item.path)), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist hands out whole groups, in the collection's order."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(str(config.rootpath / nodeid.split("::", 1)[0]))

    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.fixture(autouse=True)
def fresh_log_memory():
    """Each test starts as a fresh process: ft_plugins says each status and configuration error once per process."""
    from ft_plugins.runtime import forget_what_was_said

    forget_what_was_said()


@pytest.fixture(autouse=True)
def signals_given_back():
    """A test that takes SIGTERM or SIGINT (MindIO's stand-in ignores them, as MindIO does) gives them back:
    every process a later test starts would inherit the ignored signal."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def store_server() -> Any:
    """A TCPStore server standing in for torchrun's agent store (clients: ``support.agent_store_client``)."""
    from torch.distributed import TCPStore

    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


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


@pytest.fixture(autouse=True, scope="module")
def no_events_left_behind() -> Any:
    """The job's events are a process's: a module whose in-process training began them (MindSpore's ``Model.train``
    keeps them beside its checkpoints) would leave later modules' Megatron glue hooking their steps. Ended after
    each module, with the job's name the record set in the environment."""
    from ft_plugins import events
    from ft_plugins.config import EVENTS_JOB_VAR

    recorder, job = events._recorder, os.environ.get(EVENTS_JOB_VAR)
    yield
    if events._recorder is not recorder:
        if events._recorder is not None and events._recorder.pid == os.getpid():
            os.close(events._recorder.fd)
        events._recorder = recorder
    if job is None:
        os.environ.pop(EVENTS_JOB_VAR, None)
    else:
        os.environ[EVENTS_JOB_VAR] = job
