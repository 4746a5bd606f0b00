"""MindFormers 1.8.0: ``- type: FaultTolerance`` in a YAML ``callbacks:`` list, built by MindFormers
(``MindFormerConfig`` + ``build_callback``) and run by a real ``model.train`` with MindFormers'
``MFLossMonitor`` and ``CheckpointMonitor``. MindFormers writes ./output, so each run is in a temp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support import REPO

YAML = """
callbacks:
  - type: MFLossMonitor
    origin_epochs: 2
    dataset_size: 4
    global_batch_size: 2
  - type: FaultTolerance
    features: taskd,mstx,resume
    mstx: {backend: mindspore}
    taskd: {disk_limit_mb: 2000}
  - type: CheckpointMonitor
    prefix: tiny
    save_checkpoint_steps: 4
"""


def _callbacks(directory: Path, resume_dir: Path | None = None) -> list:
    from mindformers.core.callback import build_callback
    from mindformers.tools.register import MindFormerConfig

    entry = f"    resume_dir: {resume_dir}\n" if resume_dir else ""
    (directory / "task.yaml").write_text(YAML.replace("    features: taskd,mstx,resume\n",
                                                      "    features: taskd,mstx,resume\n" + entry))
    return build_callback(MindFormerConfig(str(directory / "task.yaml")).callbacks)


def _step_ranges(calls: list[dict[str, Any]]) -> list[str]:
    return [c["args"][0] for c in calls if c["api"] == "mstx.range_start" and c["args"][0].startswith("step ")]


@pytest.fixture(scope="module")
def workdir(fakes: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import ft_plugins.mindspore  # noqa: F401  (what the start-up hook does in every process)

    directory = tmp_path_factory.mktemp("mindformers")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        yield directory


@pytest.fixture(scope="module")
def first_run(workdir: Path, fakes: Any, tiny: Any) -> dict[str, Any]:
    from ft_plugins import events

    fakes.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(events, "_recorder", None)  # this run's record begins as a worker's would
        callbacks = _callbacks(workdir)
        tiny.model().train(2, tiny.dataset(), callbacks=callbacks)
        events.flush()
    return {"calls": fakes.calls(), "callbacks": callbacks}


def test_yaml_entry_builds_ft_plugins_callback(first_run: dict[str, Any]) -> None:
    from ft_plugins.mindspore import FaultTolerance

    built = [type(cb).__name__ for cb in first_run["callbacks"]]
    assert built == ["MFLossMonitor", "FaultTolerance", "CheckpointMonitor"]
    assert isinstance(first_run["callbacks"][1], FaultTolerance)


def test_taskd_and_ranges_in_mindformers_run(first_run: dict[str, Any], workdir: Path) -> None:
    calls = first_run["calls"]
    assert [(c["api"], c["args"]) for c in calls if "taskd" in c["api"]] == [
        ("init_taskd_worker", [0, 2000, "ms"]), ("start_taskd_worker", [])]
    assert _step_ranges(calls) == [f"step {n}" for n in range(1, 9)]
    assert sorted(os.listdir(workdir / "output" / "checkpoint" / "rank_0")) == [
        "ft_manifest-tiny_rank_0-1_4.json", "ft_manifest-tiny_rank_0-2_4.json", "meta.json", "tiny_rank_0-1_4.ckpt", "tiny_rank_0-2_4.ckpt"]


def test_the_run_records_its_steps_and_checkpoint_monitors_saves_beside_the_checkpoints(
        first_run: dict[str, Any], workdir: Path) -> None:
    """No events folder named: the record goes beside MindFormers' checkpoints, dated from the process's start; each
    save of CheckpointMonitor with its step and this rank's bytes."""
    import json

    save = workdir / "output" / "checkpoint"
    [path] = (save / "ft_events").glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["ev"] == "start" and lines[0]["t"] < lines[1]["t"]
    assert [line["step"] for line in lines if line["ev"] == "step"] == list(range(1, 9))
    saves = [(line["ev"], line["step"], line.get("bytes")) for line in lines if line["ev"].startswith("save_")]
    sizes = {step: (save / "rank_0" / f"tiny_rank_0-{step // 4}_4.ckpt").stat().st_size for step in (4, 8)}
    assert saves == [("save_start", 4, None), ("save_end", 4, sizes[4]), ("save_start", 8, None),
                     ("save_end", 8, sizes[8])]
    assert [line["ev"] for line in lines if line["ev"] in ("setup_done", "trained")] == ["setup_done", "trained"]


def test_checkpoint_monitor_saves_committed_and_an_uncommitted_one_skipped(first_run: dict[str, Any],
                                                                          workdir: Path, tmp_path: Path) -> None:
    """FaultTolerance sits before CheckpointMonitor in the YAML list: each save is still committed by its
    rank (manifest beside the file, naming it); without its manifest the newest save is passed over."""
    import json

    from ft_plugins.checkpoint import find_latest

    save = tmp_path / "checkpoint"
    shutil.copytree(workdir / "output" / "checkpoint", save)
    for epoch in (1, 2):
        manifest = json.loads((save / "rank_0" / f"ft_manifest-tiny_rank_0-{epoch}_4.json").read_text())
        name = f"tiny_rank_0-{epoch}_4.ckpt"
        assert list(manifest["files"]) == [name]
        assert manifest["files"][name]["size"] == (save / "rank_0" / name).stat().st_size
    (save / "rank_0" / "ft_manifest-tiny_rank_0-2_4.json").unlink()  # the rank died between its save and its commit
    selection = find_latest(save, rank=0)
    assert selection.format == "mindformers" and (selection.epoch, selection.step) == (1, 4)
    assert [(Path(s.path).name, s.reason.split(",")[0]) for s in selection.skipped] == [
        ("tiny_rank_0-2_4.ckpt", "uncommitted: no manifest")]


def test_no_second_step_range_when_mindformers_emits_them(workdir: Path, fakes: Any, tiny: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With libmspti in LD_PRELOAD, MFLossMonitor emits 'step {n}' itself: exactly one range per step."""
    monkeypatch.setenv("LD_PRELOAD", "/usr/local/Ascend/cann/lib64/libmspti.so")
    run = workdir / "mspti"
    run.mkdir()
    monkeypatch.chdir(run)
    fakes.clear()
    callbacks = _callbacks(run)
    tiny.model().train(2, tiny.dataset(), callbacks=callbacks)
    assert _step_ranges(fakes.calls()) == [f"step {n}" for n in range(1, 9)]
    assert callbacks[1].runtime.feature("mstx").counts["step"] == 0


def test_resume_from_yaml_entry_skips_truncated(first_run: dict[str, Any], workdir: Path, fakes: Any,
                                                tiny: Any) -> None:
    rank_dir = workdir / "output" / "checkpoint" / "rank_0"
    newest = rank_dir / "tiny_rank_0-2_4.ckpt"
    newest.write_bytes(newest.read_bytes()[:-40])
    with pytest.raises(RuntimeError, match="no resume_dir"):  # without it: refused, never a silent retrain
        tiny.model().train(2, tiny.dataset(), callbacks=_callbacks(workdir), initial_epoch=1)
    fakes.clear()
    callbacks = _callbacks(workdir, resume_dir=workdir / "output" / "checkpoint")
    dataset = tiny.dataset()
    initial_epoch = callbacks[1].initial_epoch(dataset.get_dataset_size(), dataset)
    assert initial_epoch == 1
    tiny.model().train(2, dataset, callbacks=callbacks, initial_epoch=initial_epoch)
    selection = callbacks[1].resume.selection
    assert selection.path == str(rank_dir / "tiny_rank_0-1_4.ckpt") and (selection.epoch, selection.step) == (1, 4)
    assert [Path(s.path).name for s in selection.skipped] == [newest.name]
    assert _step_ranges(fakes.calls()) == [f"step {n}" for n in range(5, 9)]


def test_startup_hook_registers_without_an_import(tmp_path: Path) -> None:
    """The .pth installed with the package: a plain MindFormers process finds FaultTolerance."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(REPO / "ft_plugins" / "mindspore" / "ft-plugins-mindformers.pth", site_dir)
    script = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(site_dir)!r})  # what the interpreter does for site-packages at start-up
        assert "mindspore" not in sys.modules, "the hook must not import MindSpore by itself"
        from mindformers.core.callback import build_callback
        print(type(build_callback({{"type": "FaultTolerance", "features": "none"}})).__module__)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ft_plugins.mindspore.callbacks"


def test_startup_hook_explains_a_switch_that_aborts_mindspore(tmp_path: Path) -> None:
    """MindSpore 2.7.2 aborts inside its own import on MS_ENABLE_TFT='TTP=1'; the hook says why first."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(REPO / "ft_plugins" / "mindspore" / "ft-plugins-mindformers.pth", site_dir)
    script = f"import site; site.addsitedir({str(site_dir)!r}); import mindspore"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    env["MS_ENABLE_TFT"] = "TTP=1"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "MS_ENABLE_TFT='TTP=1' makes MindSpore abort while importing" in result.stderr
    assert "'{TTP:1}'" in result.stderr


def test_auto_register_with_register_path_needs_no_hook_and_no_import(tmp_path: Path) -> None:
    """MindFormers' own mechanism for outside classes: ``auto_register`` + ``REGISTER_PATH``. The interpreter
    starts without the site module (``-S``) and is given site-packages by hand, so that the installed start-up
    hook does not run."""
    entry_dir = tmp_path / "register"
    entry_dir.mkdir()
    (entry_dir / "ft_entry.py").write_text("from ft_plugins.mindspore.callbacks import FaultTolerance\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path.append({sysconfig.get_paths()["purelib"]!r})
        from mindformers.core.callback import build_callback
        assert "ft_plugins" not in sys.modules
        built = build_callback({{"type": "FaultTolerance", "auto_register": "ft_entry.FaultTolerance",
                                "features": "none"}})
        print(type(built).__module__, type(built).__name__)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}
    env["REGISTER_PATH"] = str(entry_dir)
    result = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["ft_plugins.mindspore.callbacks", "FaultTolerance"]
