"""The real MindCluster TaskD (built by scripts/setup.sh from the vendored source, on PYTHONPATH only here):
its manager beside the job, the proxy and agent inside torchrun's process, the workers inside Megatron's
ranks, all over gRPC on localhost. One real Megatron job shared by the end-to-end assertions; each defect
the real TaskD showed has a run of its own (an incomplete install, an agent with no manager, doctor)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch_support import TASKD_LIBRARY, ft_run, real_taskd_env, taskd_ports, taskd_without_library
from support import MEGATRON_EXAMPLE, PYTHON, TORCHRUN, free_port

from ft_plugins.launch import environment
from ft_plugins.vendors import taskd

ITERS = 4
GLOO_JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} reduced {int(total.item())}", flush=True)
dist.destroy_process_group()
"""


@dataclass
class RealRun:
    returncode: int
    output: str
    stderr: str
    workdir: Path

    def taskd_log(self, name: str) -> str:
        path = self.workdir / "taskd_log" / name
        assert path.is_file(), sorted(p.name for p in path.parent.iterdir())
        return path.read_text(errors="replace")


@pytest.fixture(scope="module")
def job(real_taskd: Path, tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    """``ft-plugins run --manager -- torchrun --nnodes 1 --nproc-per-node 2 --master-addr --master-port``, as
    torchrun is normally used: no WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR or MASTER_PORT in the environment."""
    workdir = tmp_path_factory.mktemp("real_taskd")
    env = real_taskd_env(real_taskd, workdir, MINDX_TASK_ID="ft-e2e", LOCAL_PROXY_ENABLE="on",
                         TASKD_PROCESS_ENABLE="off")
    with taskd_ports():
        result = ft_run(["--manager", "--", TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                         "127.0.0.1", "--master-port", str(free_port()), str(MEGATRON_EXAMPLE), "--no-ft-plugins-import",
                         "--train-iters", str(ITERS), "--ft-report-dir", str(workdir / "reports")], env, workdir,
                        timeout=600)
    return RealRun(result.returncode, result.stdout + result.stderr, result.stderr, workdir)


def test_megatron_trains_to_the_end_under_the_real_taskd(job: RealRun) -> None:
    assert job.returncode == 0, job.output[-4000:]
    assert f"iteration        {ITERS}/       {ITERS}" in job.output
    assert "no TaskD manager answered" not in job.output


def test_both_real_workers_joined_through_the_agent(job: RealRun) -> None:
    assert "path join success, role=Agent" in job.taskd_log("agent-0.log")
    for rank in (0, 1):
        assert "path join success, role=Worker" in job.taskd_log(f"taskd-worker-{rank}.log")
        report = json.loads((job.workdir / "reports" / f"rank_{rank}.json").read_text())
        assert report["taskd"]["activity"] == f"worker started on rank {rank}", report


def test_run_hands_torchruns_own_options_to_taskd(job: RealRun) -> None:
    assert re.search(r"MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=\d+ from torchrun's options", job.stderr), job.stderr[-3000:]
    assert '{"job_id": "ft-e2e", "node_nums": 1, "proc_per_node": 2}' in job.stderr  # from --nnodes / --nproc-per-node
    assert "successfully init taskd manager" in job.taskd_log("taskd.log")


def test_the_manager_stopped_with_the_command(job: RealRun) -> None:
    found = re.search(r"\s(\d+)\s+manager\.py:\d+\s+successfully init taskd manager", job.taskd_log("taskd.log"))
    assert found, "TaskD's log names no manager process"
    with pytest.raises(ProcessLookupError):
        os.kill(int(found.group(1)), 0)


def test_without_its_library_taskd_stays_off_and_torchrun_trains(real_taskd: Path, tmp_path: Path) -> None:
    """TaskD installed, libtaskd.so missing: TaskD's torchrun adaptor was imported anyway and torchrun died
    with AttributeError before any worker; now one warning naming the file, and every process says why."""
    incomplete = taskd_without_library(real_taskd, tmp_path / "site")
    script = tmp_path / "job.py"
    script.write_text(GLOO_JOB)
    result = ft_run(["--", TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                     str(free_port()), str(script)], real_taskd_env(incomplete, tmp_path), tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert sorted(re.findall(r"rank \d+ reduced \d+", result.stdout)) == \
        ["rank 0 reduced 2", "rank 1 reduced 2"]  # two ranks' lines can share one line of output
    library = incomplete.joinpath(*TASKD_LIBRARY)
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower() and "ft-plugins run" in line]
    assert len(warnings) == 1 and f"{library} is missing" in warnings[0] and taskd.LIBRARY_FIX in warnings[0], warnings
    assert f"[ft_plugins rank 0] INFO taskd disabled: {library} is missing" in output  # rank 0 speaks for the job
    assert "elastic agent patched" not in output and "AttributeError" not in output


def test_an_unloadable_library_is_named_before_the_job(real_taskd: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, isolated_vendor_modules) -> None:
    broken = taskd_without_library(real_taskd, tmp_path)
    library = broken.joinpath(*TASKD_LIBRARY)
    library.write_bytes(b"not a shared object")
    monkeypatch.syspath_prepend(str(broken))
    path, why = taskd.library()
    assert path is None and why.startswith(f"{library} cannot be loaded (")
    plan = environment.plan(["torchrun", "--nproc-per-node", "2", "train.py"], env={"PATH": os.environ["PATH"]})
    assert len(plan.warnings) == 1 and str(library) in plan.warnings[0] and taskd.LIBRARY_FIX in plan.warnings[0]
    assert environment.PRELOAD_VAR not in plan.changes and "MASTER_PORT" not in plan.changes


def test_doctor_fails_on_the_real_taskd_without_its_library(real_taskd: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    incomplete = taskd_without_library(real_taskd, tmp_path / "site")
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "doctor", "--json"], env=real_taskd_env(incomplete, tmp_path),
                            cwd=cwd, capture_output=True, text=True, timeout=180)
    checks = {check["name"]: check for check in json.loads(result.stdout)}  # TaskD's log kept off stdout
    assert result.returncode == 1 and checks["libtaskd.so"]["status"] == "FAIL"
    assert checks["libtaskd.so"]["detail"].startswith(f"{incomplete.joinpath(*TASKD_LIBRARY)} is missing")
    assert checks["libtaskd.so"]["fix"] == taskd.LIBRARY_FIX
    version = re.search(r"__version__ = '(.+)'", (real_taskd / "taskd" / "version.py").read_text()).group(1)
    assert checks["TaskD version"]["detail"].startswith(version)  # no dist-info: read from taskd/version.py
    assert "health_check_server" in checks["TaskD launch_agent"]["detail"]  # TaskD's patch was imported
    assert list(cwd.iterdir()) == [] and not (tmp_path / "taskd_log").exists()  # its ./taskd_log went elsewhere


def test_an_agent_without_a_manager_gets_one_warning_naming_it(real_taskd: Path, tmp_path: Path) -> None:
    """No manager anywhere: TaskD's agent logs "waiting for message manager" every second for 180 s, starts
    no worker, then torchrun fails; after the configured bound ft_plugins says once what is missing."""
    script = tmp_path / "job.py"
    script.write_text(GLOO_JOB)
    env = real_taskd_env(real_taskd, tmp_path, FT_PLUGINS_TASKD_MANAGER_WAIT_S="2")
    command = [PYTHON, "-m", "ft_plugins.cli", "run", "--", TORCHRUN, "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(script)]
    with taskd_ports():
        process = subprocess.Popen(command, env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        stop = threading.Timer(150, os.killpg, (process.pid, signal.SIGKILL))  # before TaskD's own 180 s
        stop.start()
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "no TaskD manager answered" in line:
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        stop.cancel()
    warnings = [line for line in lines if "no TaskD manager answered" in line]
    assert len(warnings) == 1, "".join(lines[-40:])
    assert "within 2 s" in warnings[0] and "ft-plugins run --manager" in warnings[0]
    assert any("waiting for message manager" in line for line in lines)  # TaskD's agent really waited
    assert not any("reduced" in line for line in lines)  # and started no worker
