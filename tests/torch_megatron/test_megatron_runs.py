"""``import ft_plugins.torch`` on the real megatron ``pretrain()`` (CPU, gloo), checked through recording fakes.

Each real run is made once per module and shared by the assertions about it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import Run, fake_env, read_records, run_megatron

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
EXIT_PROBE = FIXTURES / "exit_probe"
ITERS = 4


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, nproc: int, *args: str,
         entry: Path | None = None, extra_paths: tuple[Path, ...] = (), **env: str) -> Run:
    workdir = tmp_path_factory.mktemp(name)
    record = workdir / "calls.jsonl"
    save = workdir / "ckpt"
    kwargs = {"entry": entry} if entry else {}
    result = run_megatron(workdir, nproc, fake_env(record, *extra_paths, **env), "--train-iters", str(ITERS),
                          "--save", str(save), "--save-interval", "2", *args, **kwargs)
    return Run(result.returncode, result.stdout + result.stderr, read_records(record), save)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "world2", 2, extra_paths=(EXIT_PROBE,))


@pytest.fixture(scope="module")
def world2_stock(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same 2-rank job without ft_plugins: the exit drain's negative control."""
    return _run(tmp_path_factory, "world2_stock", 2, extra_paths=(EXIT_PROBE,), FT_PLUGINS="none")


@pytest.fixture(scope="module")
def old_mstx_and_refusing_taskd(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One rank; torch_npu's older mstx signature; TaskD's init returns False; torch_dist saves."""
    return _run(tmp_path_factory, "old", 1, "--ckpt-format", "torch_dist",
                FT_FAKE_MSTX="old", FT_FAKE_TASKD_INIT="false")


@pytest.fixture(scope="module")
def raising_vendors(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "raising", 1, FT_FAKE_MSTX_FAIL="1", FT_FAKE_TASKD_INIT="raise")


@pytest.fixture(scope="module")
def switched_off(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "none", 1, FT_PLUGINS="none")


@pytest.fixture(scope="module")
def mindspeed_shaped(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "mindspeed", 1, entry=FIXTURES / "mindspeed_entry.py", extra_paths=(FIXTURES,))


def _trained(run: Run) -> None:
    assert run.returncode == 0, run.output[-3000:]
    assert f"iteration        {ITERS}/       {ITERS}" in run.output
    assert (run.save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


def test_worker_started_once_per_rank_after_process_group_with_global_rank(world2: Run) -> None:
    _trained(world2)
    for pid, calls in world2.processes(2).items():
        taskd = [c for c in calls if "taskd" in c["api"]]
        assert [c["api"] for c in taskd] == ["init_taskd_worker", "start_taskd_worker"]
        init = taskd[0]
        assert init["args"] == [init["dist_rank"], 5000, "pt"]  # torch.distributed's rank, not just RANK
        assert all(c["dist_initialized"] for c in taskd)
    assert sorted(int(c["rank"]) for c in world2.records if c["api"] == "init_taskd_worker") == [0, 1]


def test_one_step_range_per_iteration_in_order_on_the_device_stream(world2: Run) -> None:
    for pid in world2.processes(2):
        steps = [r for r in world2.ranges(pid) if r[0].startswith("step ")]
        assert steps == [(f"step {n}", "current") for n in range(ITERS)]


def test_dataloader_ranges_inside_steps_and_save_ranges_around_real_saves(world2: Run) -> None:
    saved = sorted(p.name for p in world2.save.iterdir() if p.name.startswith("iter_"))
    assert saved == ["iter_0000002", "iter_0000004"]
    for pid in world2.processes(2):
        names = world2.range_names(pid)
        assert names == ["step 0", "dataloader", "step 1", "dataloader", "save_checkpoint",
                         "step 2", "dataloader", "step 3", "dataloader", "save_checkpoint"]


def test_ranges_use_the_default_domain_where_torch_npu_has_it(world2: Run) -> None:
    starts = [c for c in world2.records if c["api"] == "mstx.range_start"]
    assert starts and all(c["kwargs"]["domain"] == "default" for c in starts)


def test_older_torch_npu_signature_gets_a_stream_and_no_domain(old_mstx_and_refusing_taskd: Run) -> None:
    run = old_mstx_and_refusing_taskd
    _trained(run)
    starts = [c for c in run.records if c["api"] == "mstx.range_start"]
    assert [c["args"][0] for c in starts if c["args"][0].startswith("step")] == [f"step {n}" for n in range(ITERS)]
    assert all(c["args"][1] == "current" and "domain" not in c["kwargs"] for c in starts)
    (pid,) = run.by_pid()
    run.ranges(pid)  # balanced


def test_taskd_returning_false_is_logged_and_training_goes_on(old_mstx_and_refusing_taskd: Run) -> None:
    run = old_mstx_and_refusing_taskd
    assert [c["api"] for c in run.records if "taskd" in c["api"]] == ["init_taskd_worker"]
    assert "init_taskd_worker(rank=0) returned False" in run.output
    assert (run.save / "iter_0000004" / ".metadata").exists()


def test_raising_vendors_never_stop_training(raising_vendors: Run) -> None:
    _trained(raising_vendors)
    assert "worker start on rank 0 failed: RuntimeError" in raising_vendors.output
    assert "ranges are off for this process" in raising_vendors.output


def _exits(run: Run) -> dict[str, bool]:
    """Each rank's last word at exit (``exit_probe``): whether its process group was still up."""
    return {record["rank"]: record["dist_initialized"] for record in run.records
            if record["api"] == "exit"}


def test_a_finished_gloo_job_destroys_its_process_group_before_the_interpreter_exits(world2: Run,
                                                                                    world2_stock: Run) -> None:
    """The exit drain against PyTorch's gloo exit race (a finished rank dying with SIGABRT at exit, seen in a
    recovered rank of a 4-rank job): on each rank the group is gone before the last exit handler; stock, the
    interpreter finalizes with it up."""
    _trained(world2)
    _trained(world2_stock)
    assert _exits(world2) == {"0": False, "1": False}
    assert _exits(world2_stock) == {"0": True, "1": True}


def test_ft_plugins_none_does_nothing(switched_off: Run) -> None:
    _trained(switched_off)
    assert switched_off.records == []
    assert "taskd disabled: switched off (FT_PLUGINS=none)" in switched_off.output


def test_mindspeed_llm_by_name_copies_are_patched(mindspeed_shaped: Run) -> None:
    _trained(mindspeed_shaped)
    assert "mindspeed-shaped train loop running" in mindspeed_shaped.output
    (pid,) = mindspeed_shaped.by_pid()
    names = mindspeed_shaped.range_names(pid)
    assert [n for n in names if n.startswith("step")] == [f"step {n}" for n in range(ITERS)]
    assert mindspeed_shaped.output.count("mindspeed-shaped save through its own save_checkpoint") == 2
    assert names.count("save_checkpoint") == 2  # ranges and commits prove its copy was rebound
    assert [p.parent.name for p in sorted(mindspeed_shaped.save.glob("iter_*/ft_manifest.json"))] == [
        "iter_0000002", "iter_0000004"]
    assert [c["api"] for c in mindspeed_shaped.records if "taskd" in c["api"]] == [
        "init_taskd_worker", "start_taskd_worker"]
