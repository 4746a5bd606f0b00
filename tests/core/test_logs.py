"""The rank in ft_plugins' own log lines (a handler is added only when the application configured none)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


LAUNCHER_VARIABLES = ("RANK", "RANK_ID", "MS_NODE_ID", "WORLD_SIZE", "MS_WORKER_NUM")


@pytest.mark.parametrize("env, shown", [
    ({}, "rank 0"),  # a single-process job
    ({"MS_WORKER_NUM": "4", "MS_NODE_ID": "3"}, "rank 3"),  # an msrun worker
    ({"WORLD_SIZE": "2", "RANK": "1"}, "rank 1"),
    ({"WORLD_SIZE": "2"}, "rank ?"),  # several processes, this one's rank not known yet
])
def test_log_lines_name_the_rank(env: dict[str, str], shown: str) -> None:
    child = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    child.update(env)
    script = "import logging; from ft_plugins import logs; logs.setup('INFO'); logging.getLogger('ft_plugins').info('hi')"
    result = subprocess.run([sys.executable, "-c", script], env=child, capture_output=True, text=True, timeout=60)
    assert result.stderr.strip() == f"[ft_plugins {shown}] INFO hi"


def test_a_warm_spare_taking_over_a_rank_names_that_rank_after_megatron_configured_logging() -> None:
    """A spare makes its handler before it knows its rank; once it is rank 2, megatron's import meanwhile
    gave the root logger a handler, and its lines still carry the prefix, with the rank it now is."""
    child = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    child.update(WORLD_SIZE="4")
    script = ("import logging, os; from ft_plugins import logs; logs.setup('INFO'); "
              "logging.getLogger().addHandler(logging.StreamHandler()); os.environ['RANK'] = '2'; "
              "logs.setup('INFO'); logging.getLogger('ft_plugins.recover').warning('taken over')")
    result = subprocess.run([sys.executable, "-c", script], env=child, capture_output=True, text=True, timeout=60)
    assert result.stderr.splitlines() == ["[ft_plugins.recover rank 2] WARNING taken over"]


def _process(code: str, **env: str) -> subprocess.CompletedProcess:
    child = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("FT_")}
    child.update(env, FT_PLUGINS_MSTX_BACKEND="noop")
    return subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120)


ACTIVATE = "import ft_plugins.runtime as r; r.activate('pt'); r.activate('pt')"  # e.g. enable() called again


def test_rank_0_says_one_summary_once_the_other_ranks_nothing() -> None:
    zero = _process(ACTIVATE, RANK="0", WORLD_SIZE="2").stderr.splitlines()
    assert len(zero) == 1 and zero[0].startswith("[ft_plugins rank 0] INFO taskd ")
    assert all(f"{name} " in zero[0] for name in ("taskd", "mstx", "resume", "ttp", "recover", "hangs"))
    assert _process(ACTIVATE, RANK="1", WORLD_SIZE="2").stderr == ""


def test_a_rank_whose_features_differ_from_its_launchers_says_so_in_one_line() -> None:
    published = "taskd=off,mstx=on,resume=on,ttp=off,recover=off"  # what the launcher found
    result = _process(ACTIVATE, RANK="3", WORLD_SIZE="4", FT_PLUGINS="resume", FT_LAUNCHER_FEATURES=published)
    assert result.stderr.splitlines() == [
        "[ft_plugins rank 3] WARNING rank 3 differs from its launcher: mstx disabled: switched off (not in the "
        "selected features)"]


def test_a_configuration_error_is_said_once_per_process_with_the_rank() -> None:
    code = ("import ft_plugins.torch, ft_plugins.hooks as h\n"
            "for step in range(3):\n    with h.step_range(step): pass\n")
    result = _process(code, RANK="1", WORLD_SIZE="2", FT_PLUGINS="bogus")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 1: FT_PLUGINS='bogus': unknown feature 'bogus'")


def test_the_launcher_says_one_line_and_publishes_what_the_workers_compare() -> None:
    code = ("import os, ft_plugins.hooks as h\nh.prepare_launcher('torchrun')\n"
            "print(os.environ['FT_LAUNCHER_FEATURES'])")
    result = _process(code, FT_PLUGINS="resume")
    assert result.stderr.splitlines() == ["[ft_plugins rank 0] INFO torchrun launcher: workers start with resume"]
    assert result.stdout.split() == ["taskd=off,mstx=off,resume=on,ttp=off,recover=off,elastic=off,hangs=off"]


def test_features_command_prints_each_status_once() -> None:
    result = _process("from ft_plugins.cli import main; raise SystemExit(main(['features']))", FT_PLUGINS="resume")
    assert result.returncode == 0 and result.stderr == ""
    names = ["taskd", "mstx", "resume", "ttp", "recover", "elastic", "hangs"]
    assert [line.split()[0] for line in result.stdout.splitlines()] == names


def test_every_rank_raising_no_intact_checkpoint_names_what_was_skipped(tmp_path) -> None:
    (tmp_path / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"PK truncated")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")  # Megatron committed it
    code = ("from ft_plugins.checkpoint.errors import NoIntactCheckpoint\nfrom ft_plugins.features.resume import Resume\n"
            "feature = Resume('pt', {o.name: o.default for o in Resume.options}); feature.start()\n"
            f"try:\n    feature.choose({str(tmp_path)!r})\nexcept NoIntactCheckpoint as exc:\n"
            "    print(exc); print(exc.skipped[0][1])\n")
    rank1 = _process(code, RANK="1", WORLD_SIZE="2")
    assert rank1.stderr == ""  # rank 0 logs each skipped checkpoint's reason; the message names them anyway
    message, reason = rank1.stdout.splitlines()
    assert "none is intact (skipped iter_0000002: rank 0 logs why)" in message and "model_optim_rng.pt" in reason
    rank0 = _process(code, RANK="0", WORLD_SIZE="2")
    assert rank0.stderr.startswith("resume: skipped ")
