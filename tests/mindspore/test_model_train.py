"""``FaultTolerance`` in a plain, real ``Model.train`` (MindSpore 2.7.2, CPU): TaskD, step ranges, resume.

Real: MindSpore's Model.train, ModelCheckpoint, checkpoints on disk, load_checkpoint. Faked: TaskD
and mstx (conftest), which record their calls.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

EPOCHS = 2


@pytest.fixture(scope="module")
def first_run(fakes: Any, tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real two-epoch run with every feature that can run here (TTP needs MS_ENABLE_TFT: test_ttp)."""
    from ft_plugins.mindspore import FaultTolerance

    fakes.clear()
    directory = tmp_path_factory.mktemp("ckpt")
    callback = FaultTolerance(features="taskd,mstx,resume", mstx={"backend": "mindspore"})
    tiny.model().train(EPOCHS, tiny.dataset(), callbacks=[callback, tiny.checkpointing(directory)])
    return {"calls": fakes.calls(), "directory": directory, "callback": callback}


def test_taskd_worker_started_once_with_global_rank_and_ms(first_run: dict[str, Any], fakes: Any,
                                                           tiny: Any) -> None:
    taskd = [(c["api"], c["args"]) for c in first_run["calls"] if "taskd" in c["api"]]
    assert taskd == [("init_taskd_worker", [0, 5000, "ms"]), ("start_taskd_worker", [])]
    assert first_run["callback"].runtime.report()["taskd"]["activity"] == "worker started on rank 0"
    from ft_plugins.mindspore import FaultTolerance, TaskdWorkerCallback

    fakes.clear()  # a second training in the same process, with new callbacks: no second worker
    tiny.model().train(1, tiny.dataset(), callbacks=[FaultTolerance(features="taskd"), TaskdWorkerCallback()])
    assert not fakes.calls("init_taskd_worker")


def test_taskd_worker_gets_msruns_rank_on_a_non_zero_rank(fakes: Any, tiny: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 is also the single-process fallback: a worker of a 4-rank msrun job must get its own rank."""
    from ft_plugins.mindspore import TaskdWorkerCallback
    from ft_plugins.mindspore import taskd as taskd_callbacks

    monkeypatch.setattr(taskd_callbacks, "_worker_owner", None)  # this "process" has not started one yet
    for name, value in {"MS_WORKER_NUM": "4", "MS_NODE_ID": "3", "RANK_ID": "3"}.items():
        monkeypatch.setenv(name, value)
    fakes.clear()
    tiny.model().train(1, tiny.dataset(), callbacks=[TaskdWorkerCallback()])
    assert [(c["api"], c["args"]) for c in fakes.calls() if "taskd" in c["api"]] == [
        ("init_taskd_worker", [3, 5000, "ms"]), ("start_taskd_worker", [])]


def _step_events(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Step-range opens and closes in order: ("open", "step n") / ("close", id)."""
    step_ids = {c["kwargs"]["id"]: c["args"][0] for c in calls
                if c["api"] == "mstx.range_start" and c["args"][0].startswith("step ")}
    events = []
    for c in calls:
        if c["api"] == "mstx.range_start" and c["kwargs"]["id"] in step_ids:
            events.append(("open", c["args"][0], c["args"][1]))
        elif c["api"] == "mstx.range_end" and c["args"][0] in step_ids:
            events.append(("close", step_ids[c["args"][0]], None))
    return events


def test_one_balanced_step_range_per_step_on_the_device_stream(first_run: dict[str, Any], tiny: Any) -> None:
    steps = EPOCHS * tiny.STEPS_PER_EPOCH
    expected = []
    for n in range(1, steps + 1):
        expected += [("open", f"step {n}", "current"), ("close", f"step {n}", None)]
    assert _step_events(first_run["calls"]) == expected


def test_dataloader_and_save_ranges_left_to_mindspore(first_run: dict[str, Any], tiny: Any) -> None:
    """MindSpore emits 'dataloader' (dataset iterator) and 'save_checkpoint' itself (2.7 once a save, 2.10 twice: a
    decorator and its own range): every one of them from MindSpore, none from us."""
    starts = [c for c in first_run["calls"] if c["api"] == "mstx.range_start"]
    saves = [c["kwargs"]["caller"] for c in starts if c["args"][0] == "save_checkpoint"]
    loads = [c["kwargs"]["caller"] for c in starts if c["args"][0] == "dataloader"]
    assert saves and len(saves) % EPOCHS == 0 and len(saves) <= 2 * EPOCHS
    assert len(loads) >= EPOCHS * tiny.STEPS_PER_EPOCH
    assert all(caller.startswith("mindspore.") for caller in saves + loads), sorted(set(saves + loads))
    assert first_run["callback"].runtime.report()["mstx"]["activity"] == "ranges via mindspore: 8 step"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_resume_skips_truncated_and_breakpoint_and_continues(first_run: dict[str, Any], tiny: Any, fakes: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from mindspore import load_checkpoint

    from ft_plugins.mindspore import FaultTolerance

    directory: Path = first_run["directory"]
    newest = directory / f"tiny-{EPOCHS}_{tiny.STEPS_PER_EPOCH}.ckpt"
    intact = directory / f"tiny-1_{tiny.STEPS_PER_EPOCH}.ckpt"
    breakpoint_file = directory / f"tiny-{EPOCHS + 1}_1_breakpoint.ckpt"
    breakpoint_file.write_bytes(newest.read_bytes())
    expected = {name: p.asnumpy() for name, p in load_checkpoint(str(newest)).items() if name == "weight"}
    _truncate(newest)

    fakes.clear()
    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="mstx,resume", resume_dir=str(directory), mstx={"backend": "mindspore"})
    assert callback.resume.selection.path == str(intact)
    skipped = {Path(s.path).name: s.reason for s in callback.resume.selection.skipped}
    assert "breakpoint" in skipped[breakpoint_file.name] and "truncated" in skipped[newest.name]
    assert any(f"skipped {newest}" in r.getMessage() for r in caplog.records)
    initial_epoch = callback.initial_epoch(tiny.STEPS_PER_EPOCH)
    assert initial_epoch == 1

    resumed = tiny.model()
    resumed.train(EPOCHS, tiny.dataset(), callbacks=[callback], initial_epoch=initial_epoch)
    opened = [event[1] for event in _step_events(fakes.calls()) if event[0] == "open"]
    assert opened == [f"step {n}" for n in range(tiny.STEPS_PER_EPOCH + 1, EPOCHS * tiny.STEPS_PER_EPOCH + 1)]
    # epoch 2 replayed from the epoch-1 checkpoint (weights and momentum) lands where the first run did
    trained = {p.name: p.asnumpy() for p in resumed.train_network.get_parameters() if p.name == "weight"}
    assert trained.keys() == expected.keys()
    np.testing.assert_allclose(trained["weight"], expected["weight"], rtol=1e-6)


def test_mid_epoch_checkpoint_resumes_at_its_exact_step(fakes: Any, tiny: Any, tmp_path: Path) -> None:
    """Saves every 2 steps (4 an epoch); the newest (epoch 2, step 4) truncated: resume from epoch 2 step 2
    trains steps 7 and 8 only, and ends where the uninterrupted run did."""
    from mindspore import load_checkpoint
    from mindspore.train import CheckpointConfig, ModelCheckpoint

    from ft_plugins.mindspore import FaultTolerance

    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    tiny.model().train(EPOCHS, tiny.dataset(), callbacks=[ModelCheckpoint("tiny", str(tmp_path), config)])
    newest = tmp_path / f"tiny-{EPOCHS}_{tiny.STEPS_PER_EPOCH}.ckpt"
    expected = load_checkpoint(str(newest))["weight"].asnumpy()
    _truncate(newest)

    fakes.clear()
    callback = FaultTolerance(features="mstx,resume", resume_dir=str(tmp_path), mstx={"backend": "mindspore"})
    assert Path(callback.resume.selection.path).name == "tiny-2_2.ckpt"
    dataset = tiny.dataset()
    initial_epoch = callback.initial_epoch(tiny.STEPS_PER_EPOCH, dataset)
    resumed = tiny.model()
    resumed.train(EPOCHS, dataset, callbacks=[callback], initial_epoch=initial_epoch)
    opened = [event[1] for event in _step_events(fakes.calls()) if event[0] == "open"]
    assert opened == ["step 7", "step 8"]
    trained = next(p for p in resumed.train_network.get_parameters() if p.name == "weight").asnumpy()
    np.testing.assert_allclose(trained, expected, rtol=1e-6)


@pytest.fixture(scope="module")
def saved_mid_epoch(fakes: Any, tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saves every 2 steps of a 2-epoch run: the newest, epoch 2 step 4, is truncated, so resume takes step 2."""
    from mindspore.train import CheckpointConfig, ModelCheckpoint

    directory = tmp_path_factory.mktemp("mid_epoch")
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    tiny.model().train(EPOCHS, tiny.dataset(), callbacks=[ModelCheckpoint("tiny", str(directory), config)])
    _truncate(directory / f"tiny-{EPOCHS}_{tiny.STEPS_PER_EPOCH}.ckpt")
    return directory


def _ask(callback: Any, tiny: Any, form: str) -> tuple[int, Any]:
    if form == "initial_epoch_not_passed":
        dataset = tiny.dataset()
        callback.initial_epoch(tiny.STEPS_PER_EPOCH, dataset)
        return 0, dataset
    if form == "other_dataset":
        callback.initial_epoch(tiny.STEPS_PER_EPOCH, tiny.dataset())
        return 1, tiny.dataset()
    if form == "other_steps_per_epoch":
        dataset = tiny.dataset()
        return callback.initial_epoch(tiny.STEPS_PER_EPOCH - 1, dataset), dataset
    return 0, tiny.dataset()


@pytest.mark.parametrize(("form", "message"), [
    ("no_resume_dir", "FaultTolerance() was given no resume_dir"),
    ("initial_epoch_not_asked", "initial_epoch was not asked"),
    ("initial_epoch_not_passed", "Model.train starts at epoch 1, but"),
    ("other_dataset", "in another dataset than the one Model.train trains on"),
    ("other_steps_per_epoch", "initial_epoch counted 3 steps per epoch"),
])
def test_a_resume_model_train_is_not_told_of_stops_before_the_first_step(
        fakes: Any, tiny: Any, saved_mid_epoch: Path, tmp_path: Path, form: str, message: str) -> None:
    """Every way of leaving Model.train at epoch 1 on top of a loaded step-6 checkpoint stops, naming the fix,
    before a step is trained; the same callbacks without the checkpoint train as usual."""
    import shutil

    from ft_plugins.mindspore import FaultTolerance

    directory = tmp_path / "ckpt"
    shutil.copytree(saved_mid_epoch, directory)
    resume_dir = "" if form == "no_resume_dir" else str(directory)
    callback = FaultTolerance(features="mstx,resume", resume_dir=resume_dir, mstx={"backend": "mindspore"})
    initial_epoch, dataset = _ask(callback, tiny, form)
    fakes.clear()
    with pytest.raises(RuntimeError, match=re.escape(message)) as refused:
        tiny.model().train(EPOCHS, dataset, callbacks=[callback, tiny.checkpointing(directory)],
                           initial_epoch=initial_epoch)
    assert "tiny-2_2.ckpt" in str(refused.value) and "initial_epoch=ft.initial_epoch(" in str(refused.value)
    assert not [c for c in fakes.calls("mstx.range_start") if c["args"][0].startswith("step ")]
    if form == "no_resume_dir":  # the same call on a first run (nothing saved yet) trains
        fresh = FaultTolerance(features="resume")
        tiny.model().train(1, tiny.dataset(), callbacks=[fresh, tiny.checkpointing(tmp_path / "fresh")])
        assert (tmp_path / "fresh" / f"tiny-1_{tiny.STEPS_PER_EPOCH}.ckpt").exists()


def test_initial_epoch_refuses_a_mid_epoch_checkpoint_without_the_dataset(fakes: Any, tiny: Any,
                                                                          saved_mid_epoch: Path) -> None:
    from ft_plugins.mindspore import FaultTolerance

    callback = FaultTolerance(features="resume", resume_dir=str(saved_mid_epoch))
    with pytest.raises(ValueError, match=r"tiny-2_2.ckpt is 2 steps into epoch 2; pass the training dataset"):
        callback.initial_epoch(tiny.STEPS_PER_EPOCH)
    with pytest.raises(ValueError, match=r"FaultTolerance\(resume_dir=DIR\)"):
        FaultTolerance(features="resume").initial_epoch(tiny.STEPS_PER_EPOCH)
