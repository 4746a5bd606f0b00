"""``ttp``'s built-in engine on MindSpore in one process (real Model.train, CPU): which engine runs, what
it refuses, and the dump when training raises. The dumps of real msrun jobs (a lost peer, SIGTERM) are
in test_msrun.py."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture
def no_tft(fakes: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("MS_ENABLE_TFT", "FT_PLUGINS_TTP_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    return fakes


def _ttp_part(callback: Any) -> Any:
    from ft_plugins.mindspore import TtpCallback

    return next(part for part in callback.parts if isinstance(part, TtpCallback))


def test_builtin_engine_runs_when_asked_for_by_name_only(no_tft: Any, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.mindspore import FaultTolerance

    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert _ttp_part(FaultTolerance(features="ttp")).engine is not None
    assert "engine builtin (MS_ENABLE_TFT does not switch MindIO TTP on)" in caplog.text
    assert FaultTolerance(features="auto").runtime.feature("ttp") is None
    assert "or ask for the built-in engine by name (FT_PLUGINS=ttp,resume)" in caplog.text
    monkeypatch.setenv("FT_PLUGINS_TTP_ENGINE", "mindio")
    assert FaultTolerance(features="ttp").runtime.feature("ttp") is None


@pytest.mark.parametrize(("setting", "message"), [
    ({"parallel_mode": "semi_auto_parallel"}, "parallel mode semi_auto_parallel: ranks hold different shards"),
    ({"parallel_mode": "data_parallel", "enable_parallel_optimizer": True}, "the parallel optimizer shards"),
    ("sink", "sink_size=4: the host sees a step end only every sink of steps"),
])
def test_layouts_without_a_replica_of_every_rank_are_refused(no_tft: Any, tiny: Any, setting: Any, message: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The engine writes every rank's file from one replica: refused before the first step, training goes on."""
    from mindspore import context
    from mindspore.train import RunContext
    from mindspore.train.callback import _InternalCallbackParam

    from ft_plugins.mindspore import FaultTolerance
    from ft_plugins.runtime import FeatureUnavailable

    if setting != "sink":
        real = context.get_auto_parallel_context
        monkeypatch.setattr(context, "get_auto_parallel_context", lambda key: setting.get(key, real(key)))
    params = _InternalCallbackParam()
    params.update(dataset_sink_mode=setting == "sink", sink_size=4, list_callback=[])
    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="ttp")
    callback.on_train_begin(RunContext(params))
    assert callback.runtime.feature("ttp") is None and message in caplog.text
    with pytest.raises(FeatureUnavailable, match=message.split(":")[0]):
        FaultTolerance(features="ttp", strict=True).on_train_begin(RunContext(params))


class Raise:
    """A callback that raises after a step ended, as a failing step would."""

    def __init__(self, step: int) -> None:
        from mindspore.train import Callback

        self.step = step
        self.callback = type("RaiseAt", (Callback,), {"on_train_step_end": self._step_end})()

    def _step_end(self, run_context: Any) -> None:
        if run_context.original_args().cur_step_num == self.step:
            raise RuntimeError(f"step {self.step} failed")


def test_training_that_raises_writes_the_last_completed_step(no_tft: Any, tiny: Any, tmp_path: Path) -> None:
    """Step 6 raises after its end: step 6, the last completed, is written and committed as a save of it,
    every parameter equal to a regular save of step 6; resume takes it."""
    from mindspore import load_checkpoint
    from mindspore.train import CheckpointConfig, ModelCheckpoint

    from ft_plugins.checkpoint import find_latest
    from ft_plugins.mindspore import FaultTolerance

    regular = tmp_path / "regular"
    tiny.model().train(2, tiny.dataset(), callbacks=[ModelCheckpoint("tiny", str(regular),
                                                                     CheckpointConfig(save_checkpoint_steps=1))])
    dumped = tmp_path / "dumped"
    callback = FaultTolerance(features="ttp,resume")
    with pytest.raises(RuntimeError, match="step 6 failed"):
        tiny.model().train(2, tiny.dataset(), callbacks=[callback, tiny.checkpointing(dumped), Raise(6).callback])
    assert callback.runtime.report()["ttp"]["activity"] == f"dying-gasp checkpoints written: {dumped / 'tiny-2_2.ckpt'}"
    assert find_latest(dumped).path == str(dumped / "tiny-2_2.ckpt")
    ours, theirs = load_checkpoint(str(dumped / "tiny-2_2.ckpt")), load_checkpoint(str(regular / "tiny-2_2.ckpt"))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name].asnumpy(), theirs[name].asnumpy())


def test_a_parameter_is_dumped_with_its_value_not_the_checkpoint_callback_s_entry_of_its_name(
        no_tft: Any, tiny: Any, tmp_path: Path) -> None:
    """MindFormers' CheckpointMonitor keeps ``global_step`` (the optimizer's count) and ``loss_scale`` in its
    append_info, 0 and 1 until its own save sets them: the dump wrote those over the count and the scale, and a
    resumed run restarted its optimizer's bias correction and its loss scale (an integer one, at that)."""
    from mindspore import load_checkpoint, nn, ops
    from mindspore.train import CheckpointConfig, Model, ModelCheckpoint

    from ft_plugins.mindspore import FaultTolerance

    class LossScaled(nn.TrainOneStepWithLossScaleCell):
        def get_overflow_status(self, status, grads):  # its own reads Ascend's float-status registers
            return ops.logical_not(ops.stack([ops.isfinite(grad).all() for grad in grads]).all())

    stale = CheckpointConfig(save_checkpoint_steps=100, append_info=["epoch_num", "step_num",
                                                                     {"global_step": 0, "loss_scale": 1}])
    plain = tiny.model()  # a loss-scaled step cell of its network and optimizer, as MindFormers' wrapper is one
    scaling = nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, scale_window=2)
    scaled = Model(LossScaled(nn.WithLossCell(plain._network, nn.MSELoss()), plain._optimizer,  # noqa: SLF001
                              scale_sense=scaling))
    with pytest.raises(RuntimeError, match="step 6 failed"):
        scaled.train(2, tiny.dataset(), callbacks=[FaultTolerance(features="ttp"), Raise(6).callback,
                                                   ModelCheckpoint("tiny", str(tmp_path), stale)])
    dumped = load_checkpoint(str(tmp_path / "tiny-2_2.ckpt"))
    assert [int(dumped[name].asnumpy().item()) for name in ("global_step", "epoch_num", "step_num")] == [6, 2, 6]
    assert dumped["loss_scale"].dtype == dumped["scale_sense"].dtype  # float32, as the step returned it
    assert float(dumped["loss_scale"].asnumpy()) == float(dumped["scale_sense"].asnumpy()) == 2.0 ** 13


def test_a_dump_cut_short_in_a_launch_before_does_not_keep_this_one_from_writing(no_tft: Any, tiny: Any,
                                                                                   tmp_path: Path) -> None:
    """A dump SIGKILLed mid-write (msrun's kill) leaves its claim and staging folder; the next launch clears
    them at its start, so its own dump of that step is written, not skipped as another survivor's."""
    from ft_plugins.mindspore import FaultTolerance

    dumped = tmp_path / "dumped"
    (dumped / ".ft_ttp-0").mkdir(parents=True)
    (dumped / ".ft_ttp-0" / "tiny-2_2.ckpt").write_bytes(b"half")
    (dumped / ".ft_ttp_claim-tiny-2_2").touch()
    callback = FaultTolerance(features="ttp,resume")
    with pytest.raises(RuntimeError, match="step 6 failed"):
        tiny.model().train(2, tiny.dataset(), callbacks=[callback, tiny.checkpointing(dumped), Raise(6).callback])
    assert (dumped / "tiny-2_2.ckpt").is_file()
    assert not [path.name for path in dumped.iterdir() if path.name.startswith(".ft_ttp")]


def test_a_file_claimed_by_a_survivor_killed_mid_write_is_written_by_another(no_tft: Any, tmp_path: Path) -> None:
    """Two survivors each write every rank's file: the one SIGKILLed while writing rank 1's file leaves its claim
    there, and this one still writes that file; rank 0's file, claimed by a survivor still running, is left to it."""
    import signal

    from ft_plugins.mindspore import FaultTolerance, dump
    from support import claim_holder

    engine = _ttp_part(FaultTolerance(features="ttp,resume")).engine
    engine.target = dump.Target(str(tmp_path / "rank_0"), True, "net", 2, {})
    engine.snapshot = dump.Snapshot(2, 13, 5, [("weight", np.arange(4, dtype=np.float32))])
    holders = {}
    for rank in (0, 1):
        (tmp_path / f"rank_{rank}").mkdir()
        holders[rank] = claim_holder(tmp_path / f"rank_{rank}" / f"{dump.CLAIM_PREFIX}net-2_5")
    holders[1].send_signal(signal.SIGKILL)
    holders[1].wait()
    try:
        assert engine.dump("a peer exited") == [str(tmp_path / "rank_1" / "net-2_5.ckpt")]
    finally:
        holders[0].kill()
        holders[0].wait()
    from mindspore import load_checkpoint

    assert load_checkpoint(str(tmp_path / "rank_1" / "net-2_5.ckpt"))["weight"].asnumpy().tolist() == [0, 1, 2, 3]
    assert not [path.name for path in (tmp_path / "rank_1").iterdir() if path.name.startswith(".ft_ttp")]
    assert [path.name for path in (tmp_path / "rank_0").iterdir()] == [f"{dump.CLAIM_PREFIX}net-2_5"]


def test_a_dump_of_an_older_step_stops_between_files_once_a_newer_step_completed(no_tft: Any, tmp_path: Path) -> None:
    """A peer lost while this rank still finishes the step the peer finished: the copy of the step before is
    written at once, but stops at the next file once the newer step completed, which is then written whole."""
    from ft_plugins.mindspore import FaultTolerance, dump

    engine = _ttp_part(FaultTolerance(features="ttp,resume")).engine
    engine.target = dump.Target(str(tmp_path / "rank_0"), True, "net", 2, {})
    engine.snapshot = dump.Snapshot(2, 13, 5, [("weight", np.zeros(4, dtype=np.float32))])
    write = engine._write

    def completing_meanwhile(*args: Any) -> Any:
        path = write(*args)
        engine.snapshot = dump.Snapshot(2, 14, 6, [("weight", np.ones(4, dtype=np.float32))])
        return path

    engine._write = completing_meanwhile
    assert engine.dump("a peer exited") == [str(tmp_path / "rank_0" / "net-2_5.ckpt")]
    engine._write = write
    assert engine.dump("a peer exited") == [str(tmp_path / f"rank_{rank}" / "net-2_6.ckpt") for rank in (0, 1)]
    assert not (tmp_path / "rank_1" / "net-2_5.ckpt").exists()


@pytest.mark.parametrize("peer", ["ended training", "died"])
def test_a_peer_leaving_after_it_ended_training_is_no_loss(no_tft: Any, tmp_path: Path, peer: str) -> None:
    """A faster peer leaves while this rank is still in its last step (a slower save listed before ours): it said
    it ended (its ``end()`` marks it), so its exit is no loss and nothing is written; without the mark the same exit
    is one, and the last completed step is written."""
    import shutil
    import subprocess
    import sys
    import threading

    from ft_plugins.mindspore import FaultTolerance, dump

    engine = _ttp_part(FaultTolerance(features="ttp,resume")).engine
    engine.target = dump.Target(str(tmp_path / "rank_0"), True, "net", 1, {})
    engine.snapshot = dump.Snapshot(1, 4, 4, [("weight", np.zeros(4, dtype=np.float32))])
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    mark = Path(dump._ended_mark(process.pid))
    try:
        if peer == "ended training":  # what the peer's own end() writes, under this node's launcher
            mark.parent.mkdir(exist_ok=True)
            mark.touch()
        process.wait()
        engine.peers, engine.step_started = [process.pid], time.monotonic()
        watcher = threading.Thread(target=engine._watch)
        watcher.start()
        deadline = time.monotonic() + 60
        while engine.peers and time.monotonic() < deadline:  # until the watcher has seen the peer gone
            time.sleep(dump.POLL)
        engine.end()
        watcher.join()
        assert engine.peers == [] and Path(dump._ended_mark(os.getpid())).is_file()
        written = sorted(path.name for path in (tmp_path / "rank_0").glob("*.ckpt"))
        assert written == ([] if peer == "ended training" else ["net-1_4.ckpt"])
    finally:
        shutil.rmtree(mark.parent, ignore_errors=True)


@pytest.mark.parametrize("peer", ["SIGTERMed", "died", "died, seen by the watcher"])
def test_sigterm_before_the_watcher_saw_a_peer_exit_still_names_the_exit_as_the_fault(
        no_tft: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        peer: str) -> None:
    """msrun answers a worker's death with SIGTERM to the others within its second: on a loaded machine it may
    reach this rank before the watcher's look. The dump then still names the exit, and the exit is recorded as the
    fault of its rank (the report's "death", not a "signal"), also where the watcher had seen it and not yet dumped;
    a peer that marked its own SIGTERM first is no loss. And this rank marks its end before it dumps: to its peers,
    its exit is no loss."""
    import shutil
    import subprocess
    import sys

    from ft_plugins.mindspore import FaultTolerance, dump, recording

    engine = _ttp_part(FaultTolerance(features="ttp,resume")).engine
    engine.target = dump.Target(str(tmp_path / "rank_0"), True, "net", 1, {})
    engine.snapshot = dump.Snapshot(1, 4, 4, [("weight", np.zeros(4, dtype=np.float32))])
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    mark = Path(dump._ended_mark(process.pid))
    lost: list[list[int | None]] = []
    monkeypatch.setattr(recording, "peers_lost", lost.append)
    monkeypatch.setattr(dump, "exit_now", lambda code: None)
    caplog.set_level(logging.WARNING, logger="ft_plugins")
    try:
        if peer == "SIGTERMed":  # what its own SIGTERM thread writes first
            mark.parent.mkdir(exist_ok=True)
            mark.touch()
        process.wait()
        engine.peers, engine.peer_ranks = [process.pid], {process.pid: 1}
        if peer == "died, seen by the watcher":  # its look, the dump still to come
            assert engine._newly_lost() == [process.pid]
        engine._on_sigterm()
        assert Path(dump._ended_mark(os.getpid())).is_file()
        reason = "SIGTERM" if peer == "SIGTERMed" else f"SIGTERM after worker process {process.pid} of this node exited"
        assert f"ttp: {reason}: dying-gasp checkpoint of step 4 written" in caplog.text
        assert lost == ([] if peer == "SIGTERMed" else [[1]]) and engine.peers == []
    finally:
        shutil.rmtree(mark.parent, ignore_errors=True)


class Stall:
    """A callback whose step ``step`` begins stuck, as behind a lost peer, until ``until`` exists (60 s at most)."""

    def __init__(self, step: int, until: Path) -> None:
        from mindspore.train import Callback

        def step_begin(_self: Any, run_context: Any) -> None:
            deadline = time.monotonic() + 60
            while run_context.original_args().cur_step_num == step and not until.exists() and time.monotonic() < deadline:
                time.sleep(0.05)

        self.callback = type("StallAt", (Callback,), {"on_train_step_begin": step_begin})()


def test_a_stalled_step_writes_the_last_completed_one_once(no_tft: Any, tiny: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule for a peer lost on another node: the step has run for over STALL_STEPS medians (floor lowered
    here from 3 s); step 6 stalls until step 5 is written, once, and training goes on."""
    from ft_plugins.checkpoint import find_latest
    from ft_plugins.mindspore import FaultTolerance, dump

    monkeypatch.setattr(dump, "STALL_FLOOR", 0.3)
    written = tmp_path / "tiny-2_1.ckpt"
    callback = FaultTolerance(features="ttp,resume")
    tiny.model().train(2, tiny.dataset(), callbacks=[callback, tiny.checkpointing(tmp_path), Stall(6, written).callback])
    assert callback.runtime.report()["ttp"]["activity"] == f"dying-gasp checkpoints written: {written}"
    assert find_latest(tmp_path).path == str(tmp_path / "tiny-2_4.ckpt")  # the later regular saves came after it


class Slow:
    """A user's slow step end (a logger, a ModelCheckpoint saving): what the engine holds as completed meanwhile."""

    def __init__(self, engine: Any) -> None:
        from mindspore.train import Callback

        self.engine = engine
        self.seen: list[tuple[int, int | None, bool]] = []  # (step, the engine's completed step, same parameters)
        self.first: Any = None  # the run's first callback, which MindSpore calls first at each step end

        def step_end(_self: Any, run_context: Any) -> None:
            cb_params = run_context.original_args()
            self.first = cb_params.list_callback[0]
            snapshot = engine().snapshot
            live = [p.asnumpy() for p in cb_params.train_network.get_parameters()]
            same = snapshot is not None and all(np.array_equal(a, b) for (_, a), b in zip(snapshot.parameters, live))
            self.seen.append((cb_params.cur_step_num, snapshot.step if snapshot else None, same))
            time.sleep(0.05)

        self.callback = type("SlowStepEnd", (Callback,), {"on_train_step_end": step_end})()


@pytest.mark.parametrize("entry", ["FaultTolerance", "TtpCallback"])
@pytest.mark.parametrize("listed", ["after", "before"])
def test_a_step_is_completed_before_any_callback_step_end_runs(no_tft: Any, tiny: Any, tmp_path: Path, entry: str,
                                                                listed: str) -> None:
    """SIGTERM while a slow callback listed before ours runs its step end must write that step, not the one
    before: the engine holds the step (and its parameters) from the moment the update finished, wherever
    ``FaultTolerance`` (or ``TtpCallback`` alone) stands in the list; the hook comes off after training."""
    from ft_plugins.mindspore import FaultTolerance, TtpCallback

    ours = FaultTolerance(features="ttp") if entry == "FaultTolerance" else TtpCallback()
    slow = Slow(lambda: (_ttp_part(ours) if entry == "FaultTolerance" else ours).engine)
    others = [tiny.checkpointing(tmp_path), slow.callback]
    callbacks = [*others, ours] if listed == "after" else [ours, *others]
    tiny.model().train(2, tiny.dataset(), callbacks=callbacks)
    steps = list(range(1, 2 * tiny.STEPS_PER_EPOCH + 1))
    assert slow.seen == [(step, step, True) for step in steps]
    assert "on_train_step_end" not in vars(slow.first)


@pytest.mark.parametrize("slow, follows", [(0.8, False), (0.0, False), (0.8, True)])
def test_rank_0_says_once_when_a_dump_at_the_saves_speed_would_outlast_msruns_second(
        no_tft: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        slow: float, follows: bool) -> None:
    """msrun SIGKILLs every worker within a second of one's death. Each ModelCheckpoint save is recorded
    (``ft_write_speed.json``); slowed by 0.8 s (a slow file system), a dump of the same state at that speed needs
    about 1.2 s, and rank 0 says so once; at full speed nothing is said. Under ``ft-plugins run`` without
    ``--grace`` (``FT_PLUGINS_GRACE_FOLLOWS``), what the dump needs is reported there after each save instead,
    for the launcher's grace to follow, and nothing is said."""
    import mindspore
    import mindspore.dataset as ds
    import mindspore.train.callback._checkpoint as checkpointing
    from mindspore import nn
    from mindspore.train import CheckpointConfig, Model, ModelCheckpoint

    from ft_plugins import grace
    from ft_plugins.mindspore import FaultTolerance, speed

    real = checkpointing.save_checkpoint

    def slowed(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        time.sleep(slow)

    monkeypatch.setattr(checkpointing, "save_checkpoint", slowed)
    monkeypatch.setattr(speed, "under_msrun", lambda: True)
    reports = tmp_path / "reports"
    if follows:
        reports.mkdir()
        monkeypatch.setenv(grace.GRACE_FOLLOWS_VAR, str(reports))
    mindspore.set_seed(1)
    network = nn.Dense(256, 256)  # 0.5 MB of weights and momentum: a write, not a file's fixed overhead
    model = Model(network, loss_fn=nn.MSELoss(),
                  optimizer=nn.Momentum(network.trainable_params(), learning_rate=0.01, momentum=0.9))
    data = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    checkpoint = ModelCheckpoint("wide", str(tmp_path), CheckpointConfig(save_checkpoint_steps=2))
    caplog.set_level(logging.WARNING, logger="ft_plugins")
    model.train(1, ds.NumpySlicesDataset({"data": data, "label": data}, shuffle=False).batch(2),
                callbacks=[FaultTolerance(features="ttp"), checkpoint])
    last = grace.recorded(str(tmp_path))[-1]
    assert last.what == "save wide-1_4.ckpt"
    assert last.written == (tmp_path / "wide-1_4.ckpt").stat().st_size
    said = [record.getMessage() for record in caplog.records if "longer than msrun's grace" in record.getMessage()]
    assert len(said) == (1 if slow and not follows else 0), said
    reported = grace.recorded(str(reports)) if follows else []
    assert [write.what for write in reported] == (["save wide-1_2.ckpt, for a dump of 1 file"] if follows else [])
    if follows:  # after the save of step 2 (step 4's comes after training's last look): the state at its speed
        assert reported[0].speed == pytest.approx(grace.recorded(str(tmp_path))[0].speed)
        assert reported[0].written >= grace.recorded(str(tmp_path))[0].written
    if said:
        assert said[0].startswith("ttp: a dump needs about 1.") and "measured on the save wide-1_2.ckpt" in said[0]
    assert "on_train_step_end" not in vars(checkpoint), "the timing comes off after training"


def test_a_rank_of_a_node_without_rank_0_reports_what_a_dump_needs_after_rank_0_s_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only rank 0 times its saves; the ranks of another node, under their own ``ft-plugins run``, see rank 0's
    record in the shared save root change and report what a dump needs at that speed, so their launcher's grace
    follows it too. They used to report only after their first step, before any save was recorded."""
    from ft_plugins import grace
    from ft_plugins.mindspore import speed

    reports = tmp_path / "reports"
    reports.mkdir()
    monkeypatch.setenv(grace.GRACE_FOLLOWS_VAR, str(reports))
    monkeypatch.setattr(speed, "under_msrun", lambda: True)
    monkeypatch.setattr(speed, "is_rank_zero", lambda: False)
    monkeypatch.setattr(speed, "LOOK_EVERY", 0.0)
    other_node = speed.WriteSpeed(str(tmp_path))
    other_node.warn(2, 10**6)  # after the first step: nothing recorded yet
    assert grace.recorded(str(reports)) == []
    grace.record(str(tmp_path), grace.Measured(10**6, 0.5, "save net-1_2.ckpt"))  # rank 0, on the other node
    other_node.warn(2, 10**6)
    assert [(write.written, write.seconds) for write in grace.recorded(str(reports))] == [(2 * 10**6, 1.0)]
    assert grace.recorded(str(reports))[0].what == "save net-1_2.ckpt, for a dump of 2 files"


def test_under_msrun_is_said_of_a_worker_whose_parent_is_msrun_only() -> None:
    from ft_plugins.mindspore import speed

    assert not speed.under_msrun()  # the test runner's parent is no msrun


def test_a_mark_of_an_ended_peer_counts_only_in_this_users_private_folder(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks live in the world-writable temporary directory: a mark planted in a folder another user could write
    (here: one open to all, or a link to one) would make a peer's loss go unseen, so it counts for nothing there."""
    import tempfile

    from ft_plugins.mindspore import dump

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"{dump.ENDED_MARKS}{os.getuid()}"
    planted = tmp_path / "planted"
    (planted / str(os.getppid())).mkdir(parents=True)
    (planted / str(os.getppid()) / "4242").touch()
    folder.symlink_to(planted)
    assert not dump._has_ended(4242)
    folder.unlink()
    planted.rename(folder)
    folder.chmod(0o777)
    assert not dump._has_ended(4242)
    folder.chmod(0o700)
    assert dump._has_ended(4242)
