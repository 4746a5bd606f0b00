"""``ft-plugins run -- torchrun --nproc-per-node 2`` on the real megatron ``pretrain()`` with no
ft_plugins import in the entry script; one run shared by every assertion, plus the negative control:
TaskD's 3-parameter ``launch_agent`` imported into torchrun without ft_plugins makes it fail on torch 2.13."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch_support import Vendors, ft_run, launch_env, preloaded, read_jsonl
from support import MEGATRON_EXAMPLE, TORCHRUN, free_port

from ft_plugins.launch import BOOTSTRAP_DIR, roles

ITERS = 4
FAULT = "rank=7,step=1000,kind=exception"  # a rank this job does not have: reaches workers, never fires


@dataclass
class TorchrunRun:
    returncode: int
    output: str
    workdir: Path
    records: list[dict]
    chain: list[dict]
    preload: dict[int, set[str]]

    def pids(self, api: str) -> list[int]:
        return [record["pid"] for record in self.records if record["api"] == api]


@pytest.fixture(scope="module")
def run(vendors: Vendors, tmp_path_factory: pytest.TempPathFactory) -> TorchrunRun:
    workdir = tmp_path_factory.mktemp("torchrun")
    env = launch_env(vendors, workdir)
    result = ft_run(["--features", "taskd,mstx,resume", "--inject-fault", FAULT, "--",
                     TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(MEGATRON_EXAMPLE),
                     "--no-ft-plugins-import", "--train-iters", str(ITERS), "--save", str(workdir / "ckpt"),
                     "--save-interval", "2", "--ft-report-dir", str(workdir / "reports")], env, workdir)
    return TorchrunRun(result.returncode, result.stdout + result.stderr, workdir, read_jsonl(workdir / "calls.jsonl"),
                       read_jsonl(workdir / "chain.jsonl"), preloaded(workdir))


def test_torchrun_trains_to_the_end(run: TorchrunRun) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert f"iteration        {ITERS}/       {ITERS}" in run.output
    assert (run.workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


def test_workers_are_active_without_an_import_in_the_script(run: TorchrunRun) -> None:
    starts = [(r["args"], r["rank"]) for r in run.records if r["api"] == "init_taskd_worker"]
    assert sorted(starts) == [([0, 5000, "pt"], "0"), ([1, 5000, "pt"], "1")]
    assert all(r["dist_initialized"] for r in run.records if r["api"] == "init_taskd_worker")
    steps = [r["args"][0] for r in run.records if r["api"] == "mstx.range_start" and r["rank"] == "0"
             and r["args"][0].startswith("step")]
    assert steps == [f"step {n}" for n in range(ITERS)]
    reports = sorted((run.workdir / "reports").glob("rank_*.json"))
    assert [p.name for p in reports] == ["rank_0.json", "rank_1.json"]
    assert '"activity": "worker started on rank 1"' in reports[1].read_text()


def test_taskds_adaptor_is_imported_in_the_launcher_only_and_fitted_to_this_torch(run: TorchrunRun) -> None:
    launcher = run.pids("taskd.python.adaptor.patch imported")
    assert len(launcher) == 1
    workers = set(run.pids("init_taskd_worker"))
    assert launcher[0] not in workers
    calls = [r for r in run.records if r["api"] == "taskd.launch_agent"]
    # TaskD's replacement ran, with 0 restarts: fitted to this torch (unfitted, it dies with TypeError: see below)
    assert [(c["pid"], c["args"][0]) for c in calls] == [(launcher[0], 0)]


def test_ld_preload_reaches_launcher_and_workers_once_each(run: TorchrunRun) -> None:
    launcher = run.pids("taskd.python.adaptor.patch imported")[0]
    workers = set(run.pids("init_taskd_worker"))
    for pid in {launcher, *workers}:
        assert run.preload.get(pid) == {"libtaskd.so", "libmspti.so"}, (pid, run.preload)
    lines = (run.workdir / "preload.txt").read_text().splitlines()
    assert len(lines) == len(set(lines)), "a library was preloaded twice into one process"


def test_existing_sitecustomize_chain_loaded_with_bootstrap_off_the_path(run: TorchrunRun) -> None:
    launcher = run.pids("taskd.python.adaptor.patch imported")[0]
    by_pid = {entry["pid"]: entry for entry in run.chain}
    assert launcher in by_pid and set(run.pids("init_taskd_worker")) <= set(by_pid)
    assert all(BOOTSTRAP_DIR not in entry["pythonpath"].split(":") for entry in run.chain)


def test_inject_fault_reaches_the_workers(run: TorchrunRun) -> None:
    workers = [entry for entry in run.chain if entry["rank"] in ("0", "1")]
    assert len(workers) >= 2 and {entry["inject"] for entry in workers} == {FAULT}


def test_every_process_of_the_run_gets_its_role(run: TorchrunRun) -> None:
    launcher = run.pids("taskd.python.adaptor.patch imported")[0]
    workers = set(run.pids("init_taskd_worker"))
    env = {"TORCHELASTIC_RUN_ID": "x"}
    for entry in run.chain:
        if "ft_plugins.cli" in entry["orig_argv"]:
            continue  # `ft-plugins run` itself, before it execs torchrun under the same pid
        role = roles.detect(entry["orig_argv"], env if entry["rank"] else {}).name
        if entry["pid"] == launcher:
            assert role == "torchrun"
        elif entry["pid"] in workers:
            assert role == "worker"
        else:  # megatron's helpers: multiprocessing's resource tracker and spawned children
            assert role == "helper", entry["orig_argv"]


def test_without_ft_plugins_taskds_patch_breaks_torchrun_on_this_torch(vendors: Vendors, tmp_path: Path) -> None:
    """Negative control: the vendor guide's edit (the adaptor imported in torchrun's process) on torch 2.13."""
    sed = tmp_path / "sed"
    sed.mkdir()
    (sed / "sitecustomize.py").write_text(
        "import sys\nif sys.argv[0].endswith('torchrun'):\n    import taskd.python.adaptor.patch\n")
    script = tmp_path / "hello.py"
    script.write_text("print('worker ran')\n")
    env = launch_env(vendors, tmp_path)
    env["PYTHONPATH"] = f"{sed}:{env['PYTHONPATH']}"
    result = subprocess.run([TORCHRUN, "--nproc-per-node", "1", "--master-port", str(free_port()), str(script)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "TypeError" in result.stderr and "health_check_server" in result.stderr
    assert "worker ran" not in result.stdout
