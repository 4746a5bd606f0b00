"""``ft-plugins run -- msrun`` with 2 real MindSpore CPU workers and ``MS_ENABLE_TFT='{RSC:1}'``:
MindSpore's own process manager hands the workers to TaskD's agent (the fake agent API); ft_plugins
edits nothing in msrun and starts no second agent, while the workers are active and the scheduler not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch_support import Vendors, ft_run, launch_env, read_jsonl
from support import PYTHON, free_port

MSRUN = str(Path(PYTHON).with_name("msrun"))

SCRIPT = """
import json, os, sys
import mindspore  # the framework import that activates ft_plugins in a worker
from mindspore.communication import get_rank, init
from ft_plugins.launch import roles
role = os.environ.get("MS_ROLE", "none")

def report(rank):
    with open(os.path.join(sys.argv[1], f"{role}_{os.getpid()}.json"), "w") as out:
        json.dump({"ms_role": role, "role": roles.CURRENT.name if roles.CURRENT else None,
                   "active": bool(roles.CURRENT and roles.CURRENT.active), "rank": rank,
                   "launcher": os.environ.get("FT_LAUNCHER_FEATURES")}, out)

if role == "MS_SCHED":
    report(None)  # msrun does not wait for its scheduler once the agent returns
mindspore.set_device("CPU")
init()  # the cluster forms: scheduler and both workers
if role == "MS_WORKER":
    report(get_rank())
"""


@pytest.fixture(scope="module")
def msrun(vendors: Vendors, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("msrun")
    script = workdir / "job.py"
    script.write_text(SCRIPT)
    (workdir / "reports").mkdir()
    env = launch_env(vendors, workdir, MS_ENABLE_TFT="{RSC:1}", FT_PLUGINS_LOG="warning")
    result = ft_run(["--features", "taskd,resume", "--", MSRUN, "--worker_num=2", "--local_worker_num=2",
                     f"--master_port={free_port()}", f"--log_dir={workdir / 'logs'}", "--join=False", str(script),
                     str(workdir / "reports")], env, workdir, timeout=240)
    reports = [json.loads(p.read_text()) for p in sorted((workdir / "reports").glob("*.json"))]
    return result, read_jsonl(workdir / "calls.jsonl"), reports


def test_msrun_runs_both_workers_through_taskds_agent(msrun) -> None:
    result, records, reports = msrun
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["api"] for r in records if r["api"].startswith("agent saw")] == ["agent saw every worker complete"]
    assert sorted((r["ms_role"], r["rank"]) for r in reports) == [("MS_SCHED", None), ("MS_WORKER", 0), ("MS_WORKER", 1)]


def test_taskds_agent_started_once_by_mindspore_itself(msrun) -> None:
    _, records, _ = msrun
    agent = [r for r in records if r["api"] in ("init_taskd_agent", "register_func", "start_taskd_agent")]
    assert [(r["api"], r["args"], r["kwargs"]) for r in agent] == [
        ("init_taskd_agent", [], {"Framework": "MindSpore"}),
        ("register_func", ["KILL_WORKER"], {}), ("register_func", ["START_ALL_WORKER"], {}),
        ("register_func", ["START_WORKER_LIST"], {}), ("register_func", ["MONITOR"], {}),
        ("start_taskd_agent", ["MindSpore"], {}),
    ]
    assert len({r["pid"] for r in agent}) == 1  # all in msrun's own process
    assert not any(r["api"] == "taskd.python.adaptor.patch imported" for r in records)


def test_workers_active_scheduler_untouched(msrun) -> None:
    _, _, reports = msrun
    by_role = {(r["ms_role"], r["role"], r["active"]) for r in reports}
    assert by_role == {("MS_WORKER", "worker", True), ("MS_SCHED", "scheduler", False)}


def test_msrun_publishes_the_features_its_workers_compare_theirs_with(msrun) -> None:
    _, _, reports = msrun
    published = {r["launcher"] for r in reports if r["ms_role"] == "MS_WORKER"}
    assert len(published) == 1, published
    features = dict(item.split("=") for item in published.pop().split(","))
    assert features["taskd"] == features["resume"] == "on" and features["recover"] == "off"


def test_no_warning_about_msruns_python(msrun) -> None:
    result, _, _ = msrun
    assert "msrun starts workers" not in result.stderr
