"""``ft-plugins run`` around plain Python commands: roles of spawned children and helpers, interpreter
flags that switch the bootstrap off, a Python without ft_plugins, exit codes, signals, the manager
beside the command, dry runs and bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_support import Vendors, ft_run, launch_env, read_jsonl
from support import PYTHON

from ft_plugins.launch import BOOTSTRAP_DIR, environment, roles
from ft_plugins.processes import alive

SPAWNING = """
import json, multiprocessing, os, sys

def report(queue):
    import torch  # noqa: F401  (would activate ft_plugins in an active process)
    from ft_plugins.launch import roles
    queue.put({"role": roles.CURRENT.name if roles.CURRENT else None, "glue": "ft_plugins.torch" in sys.modules})

if __name__ == "__main__":
    import torch  # noqa: F401
    from ft_plugins.launch import roles
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=report, args=(queue,))
    child.start()
    child_report = queue.get(timeout=120)
    child.join()
    print(json.dumps({"parent": {"role": roles.CURRENT.name, "glue": "ft_plugins.torch" in sys.modules,
                                 "pythonpath": os.environ["PYTHONPATH"]}, "child": child_report}))
"""


@pytest.fixture(scope="module")
def spawning(vendors: Vendors, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    workdir = tmp_path_factory.mktemp("spawning")
    script = workdir / "spawning.py"
    script.write_text(SPAWNING)
    env = launch_env(vendors, workdir, FT_PLUGINS_LOG="warning")
    return ft_run(["--features", "resume", "--", PYTHON, str(script)], env, workdir, timeout=180), workdir


def test_plain_python_is_active_and_its_spawned_child_is_not(spawning) -> None:
    import json

    result, _ = spawning
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["parent"] == {"role": "python", "glue": True, "pythonpath": report["parent"]["pythonpath"]}
    assert report["parent"]["pythonpath"].split(os.pathsep)[0] == BOOTSTRAP_DIR  # restored for its children
    assert report["child"] == {"role": "helper", "glue": False}


def test_helpers_of_the_run_are_recognised(spawning) -> None:
    _, workdir = spawning
    commands = [entry["orig_argv"] for entry in read_jsonl(workdir / "chain.jsonl")
                if "ft_plugins.cli" not in entry["orig_argv"]]
    kinds = sorted(roles.detect(argv, {}).name for argv in commands)
    assert kinds.count("python") == 1 and kinds.count("helper") >= 2, commands  # spawn child + resource tracker
    assert any("resource_tracker" in " ".join(argv) for argv in commands)


@pytest.mark.parametrize("flag", ["-I", "-E", "-S", "-uIs"])
def test_interpreter_flags_that_switch_the_bootstrap_off_are_warned(vendors: Vendors, tmp_path: Path, flag: str) -> None:
    code = "import sys; print('ran', 'ft_plugins.launch.roles' in sys.modules)"
    result = ft_run(["--", PYTHON, flag, "-c", code], launch_env(vendors, tmp_path), tmp_path)
    assert result.returncode == 0
    assert result.stdout.split() == ["ran", "False"]
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "ft_plugins cannot reach" in warnings[0], result.stderr
    letter = next(letter for letter in "IES" if letter in flag)
    assert f"-{letter}" in warnings[0]


def test_flags_after_the_script_are_not_the_interpreters() -> None:
    assert environment.blocking_flags([PYTHON, "train.py", "-I"]) == []
    assert environment.blocking_flags([PYTHON, "-Werror::SyntaxWarning", "-c", "pass"]) == []
    assert environment.blocking_flags(["torchrun", "-I"]) == []


def test_a_python_without_ft_plugins_runs_the_command_with_one_warning(tmp_path: Path) -> None:
    system_python = Path("/usr/bin/python3")
    if not system_python.exists():
        pytest.skip("needs a second interpreter without ft_plugins")
    script = tmp_path / "job.py"
    script.write_text("import subprocess, sys\nprint('job ran')\n"
                      "subprocess.run([sys.executable, '-c', 'print(\"child ran\")'], check=True)\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}  # no PYTHONPATH: ft_plugins only where the CLI is
    launcher = "import sys; from ft_plugins.cli import main; sys.exit(main())"
    result = subprocess.run([PYTHON, "-c", launcher, "run", "--", str(system_python), str(script)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["child", "job", "ran", "ran"]
    warnings = [line for line in result.stderr.splitlines() if "cannot import ft_plugins" in line]
    assert len(warnings) == 1, result.stderr


def test_exit_code_of_the_command_is_returned(vendors: Vendors, tmp_path: Path) -> None:
    result = ft_run(["--", PYTHON, "-c", "import sys; sys.exit(7)"], launch_env(vendors, tmp_path), tmp_path)
    assert result.returncode == 7
    missing = ft_run(["--", "no-such-launcher"], launch_env(vendors, tmp_path), tmp_path)
    assert missing.returncode == 127 and "cannot start 'no-such-launcher'" in missing.stderr


def test_inject_fault_is_validated_and_exported(vendors: Vendors, tmp_path: Path) -> None:
    code = "import os; print(os.environ['FT_PLUGINS_INJECT_FAULT'])"
    good = ft_run(["--inject-fault", "rank=1,step=3,kind=kill", "--", PYTHON, "-c", code],
                  launch_env(vendors, tmp_path), tmp_path)
    assert good.returncode == 0 and good.stdout.strip() == "rank=1,step=3,kind=kill"
    bad = ft_run(["--inject-fault", "rank=1,kind=boom", "--", PYTHON, "-c", code], launch_env(vendors, tmp_path), tmp_path)
    assert bad.returncode == 2 and "--inject-fault" in bad.stderr and "lacks step" in bad.stderr
    assert bad.stdout == ""


def test_bad_feature_list_is_a_usage_error(vendors: Vendors, tmp_path: Path) -> None:
    result = ft_run(["--features", "taskd,bogus", "--", PYTHON, "-c", "print('ran')"], launch_env(vendors, tmp_path), tmp_path)
    assert result.returncode == 2 and "unknown feature 'bogus'" in result.stderr and "ran" not in result.stdout


def test_grace_is_for_the_launchers_that_sigkill_their_workers(vendors: Vendors, tmp_path: Path) -> None:
    """--grace is the time between the launcher's SIGTERM and its SIGKILL: for another command it is refused,
    not ignored."""
    result = ft_run(["--grace", "5", "--", PYTHON, "-c", "print('ran')"], env=launch_env(vendors, tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "--grace 5: give seconds >= 0, for torchrun or msrun" in result.stderr
    assert "ran" not in result.stdout


def test_dry_run_prints_the_environment_changes_and_the_command(vendors: Vendors, tmp_path: Path) -> None:
    user_lib = "/opt/user/libextra.so"
    env = launch_env(vendors, tmp_path, LD_PRELOAD=f"{vendors.libtaskd} {user_lib}")
    result = ft_run(["--features", "taskd,mstx", "--dry-run", "--", "torchrun", "--nproc-per-node", "8", "train.py"],
                    env, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "torchrun --nproc-per-node 8 train.py"
    assert "export FT_PLUGINS=taskd,mstx" in lines
    assert f"export PYTHONPATH={BOOTSTRAP_DIR}:" in result.stdout
    assert f"export LD_PRELOAD={vendors.libmspti}:{vendors.libtaskd}:{user_lib}" in lines  # once each, user's kept
    assert not (tmp_path / "calls.jsonl").exists()  # nothing ran


def test_missing_libraries_get_one_warning_naming_them(vendors: Vendors, tmp_path: Path) -> None:
    env = launch_env(vendors, tmp_path, ASCEND_HOME_PATH=str(tmp_path / "nowhere"), HOME=str(tmp_path))
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(vendors.site) + os.pathsep, "")  # the fakes' taskd: no library
    result = ft_run(["--features", "taskd,mstx", "--dry-run", "--", "python", "x.py"], env, tmp_path)
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "python/cython_api/libs/libtaskd.so is missing" in warnings[0] and "CANN not found" in warnings[0]
    assert "LD_PRELOAD" not in result.stdout


def test_merge_preload_keeps_the_users_entries_once() -> None:
    assert environment.merge_preload(["/a/libmspti.so", "/b/libtaskd.so"], "/b/libtaskd.so:/c/x.so /a/libmspti.so") == \
        "/a/libmspti.so:/b/libtaskd.so:/c/x.so"
    assert environment.merge_preload(["/b/libtaskd.so"], "") == "/b/libtaskd.so"


MANAGED = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
Path(sys.argv[1]).write_text("ready")
time.sleep(120)
sys.exit(0)
"""


def test_manager_beside_the_command_signals_forwarded_and_exit_code_returned(vendors: Vendors, tmp_path: Path) -> None:
    script, ready = tmp_path / "job.py", tmp_path / "ready"
    script.write_text(MANAGED)
    env = launch_env(vendors, tmp_path, MINDX_TASK_ID="job-7", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", RANK="0")
    process = subprocess.Popen([PYTHON, "-m", "ft_plugins.cli", "run", "--manager", "--", PYTHON, str(script), str(ready)],
                               env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and any(r["api"] == "start_taskd_manager" for r in read_jsonl(tmp_path / "calls.jsonl"))):
            assert time.monotonic() < deadline and process.poll() is None, "job or manager did not start"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 5  # the command's own exit code, after its SIGTERM handler ran
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    records = read_jsonl(tmp_path / "calls.jsonl")
    init = next(r for r in records if r["api"] == "init_taskd_manager")
    assert init["kwargs"] == {"job_id": "job-7", "node_nums": 2, "proc_per_node": 8}
    manager_pid = init["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(manager_pid, 0)  # stopped with the command


def test_manager_is_not_started_off_the_master(vendors: Vendors, tmp_path: Path) -> None:
    env = launch_env(vendors, tmp_path, MINDX_TASK_ID="job-7", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", RANK="1")
    result = ft_run(["--manager", "--", PYTHON, "-c", "print('ran')"], env, tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ran"
    assert "no TaskD manager on this pod: RANK=1" in result.stderr
    assert not any(r["api"].endswith("taskd_manager") for r in read_jsonl(tmp_path / "calls.jsonl"))


def test_manager_config_error_stops_before_the_command(vendors: Vendors, tmp_path: Path) -> None:
    env = launch_env(vendors, tmp_path, RANK="0", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8")
    result = ft_run(["--manager", "--", PYTHON, "-c", "print('ran')"], env, tmp_path)
    assert result.returncode == 2 and "set MINDX_TASK_ID (the Ascend operator sets it)" in result.stderr
    assert "ran" not in result.stdout


def test_an_msrun_worker_that_imports_torch_stays_a_mindspore_worker(vendors: Vendors, tmp_path: Path) -> None:
    """MindFormers imports torch: in an msrun worker that import activates no torch glue (its features would
    say they are watched by torchrun, and take SIGTERM over beside MindSpore's)."""
    import json

    script = tmp_path / "worker.py"
    script.write_text("import json, sys\nimport torch  # noqa: F401\nfrom ft_plugins.launch import roles\n"
                      "print(json.dumps([roles.CURRENT.name, 'ft_plugins.torch' in sys.modules]))\n")
    for extra, expected in (({"MS_ROLE": "MS_WORKER"}, ["worker", False]), ({}, ["python", True])):
        env = launch_env(vendors, tmp_path, FT_PLUGINS_LOG="warning", **extra)
        result = ft_run(["--features", "resume", "--", PYTHON, str(script)], env, tmp_path, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == expected, extra


def test_role_detection_of_launchers_and_workers() -> None:
    assert roles.detect([PYTHON, "/venv/bin/torchrun", "--nproc-per-node", "2", "x.py"], {}).name == "torchrun"
    assert roles.detect([PYTHON, "-m", "torch.distributed.run", "x.py"], {}).name == "torchrun"
    assert roles.detect([PYTHON, "/venv/bin/msrun", "--worker_num=2", "x.py"], {}).name == "msrun"
    assert roles.detect(["python", "x.py"], {"MS_ROLE": "MS_SCHED"}).name == "scheduler"
    msrun_worker = roles.detect(["python", "x.py"], {"MS_ROLE": "MS_WORKER"})
    torchrun_worker = roles.detect(["python", "-u", "x.py"], {"TORCHELASTIC_RUN_ID": "1", "RANK": "0"})
    plain = roles.detect(["python", "-W", "ignore", "x.py"], {})
    assert (msrun_worker.name, torchrun_worker.name, plain.name) == ("worker", "worker", "python")
    assert [[role.activates(framework) for framework in ("torch", "mindspore")]
            for role in (msrun_worker, torchrun_worker, plain)] == [[False, True], [True, False], [True, True]]
    spawn = [sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
             "--multiprocessing-fork"]
    assert roles.detect(spawn, {"TORCHELASTIC_RUN_ID": "1"}).name == "helper"


def test_a_failing_sitecustomize_never_stops_the_command_and_bad_config_stops_before_it(vendors: Vendors,
                                                                                       tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text("raise RuntimeError('site set-up broke')\n")
    env = launch_env(vendors, tmp_path)
    env["PYTHONPATH"] = f"{broken}{os.pathsep}{env['PYTHONPATH']}"
    code = "import torch; from ft_plugins.launch import roles; print('ran', roles.CURRENT.name)"
    result = ft_run(["--", PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0 and result.stdout.split() == ["ran", "python"], result.stderr
    assert f"error in {broken / 'sitecustomize.py'}: RuntimeError: site set-up broke" in result.stderr
    refused = ft_run(["--", PYTHON, "-c", code], dict(env, FT_PLUGINS_MSTX_BACKEND="gpu"), tmp_path)
    assert refused.returncode == 2 and "FT_PLUGINS_MSTX_BACKEND='gpu' is not valid" in refused.stderr
    assert "ran" not in refused.stdout


@pytest.mark.parametrize(("command", "fresh", "static"), [
    (["torchrun", "--standalone", "--max-restarts", "1", "train.py"], True, False),
    (["torchrun", "--rdzv_backend=c10d", "--rdzv-endpoint", "h:1", "--max_restarts=2", "train.py"], True, False),
    ([PYTHON, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1", "train.py"], True, False),
    (["torchrun", "--standalone", "--max-restarts", "0", "train.py"], False, False),
    (["torchrun", "--max-restarts", "1", "train.py"], False, True),  # torchrun's default rendezvous
    (["torchrun", "--rdzv-backend", "static", "--max-restarts=1", "--nnodes", "2", "train.py"], False, True),
    (["torchrun", "--max-restarts", "0", "train.py"], False, False),
    (["torchrun", "--standalone", "train.py", "--max-restarts", "3"], False, False),  # the script's own argument
    (["python", "train.py", "--standalone", "--max-restarts", "3"], False, False),
])
def test_torchrun_restarts_over_c10d_get_a_fresh_store_and_over_static_a_warning(
        command: list[str], fresh: bool, static: bool) -> None:
    plan = environment.plan(command, env={"PATH": os.environ["PATH"]})
    assert (plan.changes.get(environment.FRESH_STORE_VAR) == "1") is fresh
    assert bool(plan.notes) is fresh
    assert (environment.STATIC_RESTARTS in plan.warnings) is static
    if static:
        assert "--standalone" in environment.STATIC_RESTARTS and "--rdzv-backend c10d" in environment.STATIC_RESTARTS


@pytest.mark.parametrize("features", ["ttp,recover", "all"])
def test_recover_with_restarts_keeps_the_agents_store_and_says_how_the_two_combine(features: str) -> None:
    plan = environment.plan(["torchrun", "--standalone", "--max-restarts", "3", "train.py"], features=features,
                            env={"PATH": os.environ["PATH"]})
    assert environment.FRESH_STORE_VAR not in plan.changes
    combined = [note for note in plan.notes if note.startswith("recover with torchrun's restarts:")]
    assert len(combined) == 1, plan.notes  # beside it, under `all`, the hang watch's own note
    assert combined[0].startswith("recover with torchrun's restarts: a lost rank is replaced in place, a failure "
                                  "that cannot be repaired in place restarts the whole job")


@pytest.mark.parametrize("features, env, value", [
    ("ttp,recover", {}, "2"), ("all", {}, "2"),
    ("ttp", {}, None),  # no survivor to keep alive: the watchdog's own end of the process stands
    ("ttp,recover", {environment.NCCL_ERRORS_VAR: "3"}, "3"),  # the user's own choice wins
])
def test_recover_keeps_a_survivor_of_an_nccl_error_alive_to_repair(
        features: str, env: dict[str, str], value: str | None) -> None:
    plan = environment.plan(["torchrun", "--nproc-per-node", "8", "train.py"], features=features,
                            env={"PATH": os.environ["PATH"], **env})
    assert plan.env.get(environment.NCCL_ERRORS_VAR) == value
    said = [note for note in plan.notes if note.startswith(environment.NCCL_ERRORS_VAR)]
    assert len(said) == (environment.NCCL_ERRORS_VAR in plan.changes) == (not env and value is not None), plan.notes


def test_each_restart_attempt_gets_its_own_store_prefix_on_the_agents_store() -> None:
    from ft_plugins.attempts import attempt_prefix

    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert attempt_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "0"}) is None  # nothing before it to collide with
    assert attempt_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "2"}) == "ft_plugins/attempt2/"
    assert attempt_prefix({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "2"}) is None


def test_a_store_setting_the_user_made_wins() -> None:
    plan = environment.plan(["torchrun", "--standalone", "--max-restarts", "1", "train.py"],
                            env={"PATH": os.environ["PATH"], environment.FRESH_STORE_VAR: "0"})
    assert environment.FRESH_STORE_VAR not in plan.changes and plan.env[environment.FRESH_STORE_VAR] == "0"


@pytest.mark.parametrize(("command", "counts"), [
    (["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "train.py"], (2, 4)),
    (["torchrun", "--nnodes=1:1", "--nproc_per_node=8", "train.py", "--nnodes", "9"], (1, 8)),
    (["torchrun", "train.py"], (1, 1)),  # torchrun's defaults
    (["torchrun", "--nnodes", "1:4", "--nproc-per-node", "gpu", "train.py"], (None, None)),  # elastic, not a count
    (["msrun", "--worker_num=16", "--local_worker_num=8", "train.py"], (2, 8)),
    (["msrun", "--worker_num=12", "--local_worker_num=8", "train.py"], (None, None)),
    (["python", "train.py", "--nnodes", "2"], (None, None)),
])
def test_node_and_process_counts_from_the_launchers_flags(command: list[str], counts: tuple) -> None:
    assert environment.launcher_counts(command, {}) == counts


@pytest.mark.parametrize(("command", "env", "master"), [
    (["torchrun", "--master-addr", "10.0.0.1", "--master-port", "29614", "t.py"], {}, ("10.0.0.1", "29614")),
    (["torchrun", "--master_port=29614", "t.py"], {}, ("127.0.0.1", "29614")),
    (["torchrun", "t.py"], {"PET_MASTER_PORT": "2000", "PET_MASTER_ADDR": "h"}, ("h", "2000")),  # torchrun reads PET_*
    (["torchrun", "--nnodes", "2", "--master-addr", "h", "t.py"], {}, ("h", "29500")),  # its default beyond one node
    (["torchrun", "--rdzv-endpoint", "node0:3000", "t.py"], {}, ("node0", "3000")),  # static, its endpoint given
    (["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:3000", "t.py"], {}, None),  # TaskD fails there
    (["torchrun", "--nproc-per-node", "2", "t.py"], {}, None),  # one node, no port: torchrun goes to c10d
    (["torchrun", "--standalone", "--master-port", "29614", "t.py"], {}, None),
])
def test_master_address_for_taskd_from_torchruns_flags(command: list[str], env: dict, master: tuple | None) -> None:
    found = environment.taskd_master(command, env)
    assert (found and (found["MASTER_ADDR"], found["MASTER_PORT"])) == master


def test_run_gives_taskd_the_master_address_and_the_manager_the_launchers_counts(vendors: Vendors, tmp_path: Path) -> None:
    env = launch_env(vendors, tmp_path, MINDX_TASK_ID="job-3")
    torchrun = ft_run(["--manager", "--dry-run", "--", "torchrun", "--nnodes", "2", "--nproc-per-node", "4",
                       "--master-addr", "10.0.0.1", "--master-port", "29614", "train.py"], env, tmp_path)
    assert torchrun.returncode == 0, torchrun.stderr
    assert "export MASTER_ADDR=10.0.0.1" in torchrun.stdout and "export MASTER_PORT=29614" in torchrun.stdout
    assert "manager --job-id job-3 --nodes 2 --procs-per-node 4 &" in torchrun.stdout
    msrun = ft_run(["--manager", "--dry-run", "--", "msrun", "--worker_num=8", "--local_worker_num=4", "train.py"],
                   dict(env, WORLD_SIZE="16", LOCAL_WORLD_SIZE="8"), tmp_path)
    assert "--nodes 2 --procs-per-node 8 &" in msrun.stdout  # the operator's variables win over the flags
    assert "MASTER_PORT" not in msrun.stdout
    standalone = ft_run(["--dry-run", "--", "torchrun", "--standalone", "--max-restarts", "1", "train.py"], env, tmp_path)
    assert environment.TASKD_NEEDS_STATIC in standalone.stderr and "MASTER_PORT" not in standalone.stdout
    assert environment.FRESH_STORE_VAR not in standalone.stdout  # no c10d advice or set-up for TaskD's agent


# msrun's process handling as in mindspore 2.7.2's process_entity/_api.py, reduced: the worker in a session of
# its own, no SIGTERM handler, SIGINT SIGKILLs the worker's process group. The worker records its dying gasp.
MSRUN_LIKE = """#!{python}
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", {worker!r}, sys.argv[1]], start_new_session=True)
signal.signal(signal.SIGINT, lambda *_: (os.killpg(worker.pid, signal.SIGKILL), sys.exit(0)))
sys.exit(worker.wait())
"""
WORKER = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1], "gasp").write_text("SIGTERM"), os._exit(143)))
Path(sys.argv[1], f"worker_{os.getpid()}").write_text("")
time.sleep(120)
"""


@pytest.mark.parametrize("under_ft_plugins", [True, False])
def test_ctrl_c_gives_msruns_workers_their_dying_gasp(vendors: Vendors, tmp_path: Path, under_ft_plugins: bool) -> None:
    """SIGINT to the process group of the command, as a terminal's Ctrl+C sends it: under ft-plugins run the
    worker gets SIGTERM and its handler runs; msrun alone SIGKILLs it (the negative control)."""
    launcher = tmp_path / "bin" / "msrun"
    launcher.parent.mkdir()
    launcher.write_text(MSRUN_LIKE.format(python=PYTHON, worker=WORKER))
    launcher.chmod(0o755)
    prefix = [PYTHON, "-m", "ft_plugins.cli", "run", "--grace", "10", "--"] if under_ft_plugins else []
    process = subprocess.Popen([*prefix, str(launcher), str(tmp_path)], env=launch_env(vendors, tmp_path),
                               cwd=tmp_path, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("worker_*")):
            assert time.monotonic() < deadline and process.poll() is None, "the worker did not start"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    worker = int(next(tmp_path.glob("worker_*")).name.split("_")[1])
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:  # msrun alone: its SIGKILL is not waited for
        time.sleep(0.1)
    assert not alive(worker)
    if under_ft_plugins:
        assert returncode == 128 + signal.SIGINT and (tmp_path / "gasp").read_text() == "SIGTERM"
    else:
        assert returncode == 0 and not (tmp_path / "gasp").exists()
