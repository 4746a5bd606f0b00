"""TTP through MindSpore 2.7.2's own ``TrainFaultTolerance``, with a fake MindIO, and the bad inputs.

What is real and what is not, precisely:
- real: MindSpore's ``TrainFaultTolerance`` (its MindIO start-up in ``_tft_handler``, handler
  registration, ``on_train_begin`` / ``on_train_step_end`` reporting, its save handler
  ``_save_checkpoint_on_failure`` with the consistency check on the TFT-wrapped optimizer's flag),
  ``mindspore.save_checkpoint`` / ``load_checkpoint``, the real network and optimizer objects, and
  for the "training proceeds" cases a real ``Model.train``.
- fake: ``mindio_ttp.framework_ttp`` (tests/fakes/mindio_ttp: records calls, plays the controller).
- shimmed, in ``ascend_dp2`` only: ``TrainFaultTolerance`` refuses any device but Ascend, and a
  data-parallel job needs several communicating processes, which MindSpore cannot run on CPU
  (data_parallel Model.train crashes without communication). So for that fixture the device
  target reads "Ascend" in MindSpore's two TFT modules, the parallel mode reads "data_parallel"
  and the group size 2 (rank 0); the callbacks are then driven with a real ``RunContext`` over
  the real network, as ``Model.train`` would, since a wrapped optimizer's AllReduce cannot run here.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support import old_mindio

TFT_ENV = {"MS_ENABLE_TFT": "{TTP:1}", "MS_TFT_IP": "127.0.0.1", "MS_TFT_PORT": "8000",
           "MS_WORKER_NUM": "2", "MS_NODE_ID": "0", "MINDIO_FOR_MINDSPORE": "1"}


@pytest.fixture
def tft_env(fakes: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in TFT_ENV.items():
        monkeypatch.setenv(name, value)
    fakes.clear()
    return fakes


@pytest.fixture
def ascend_dp2(tft_env: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """See the module docstring: the shims that stand for an Ascend data-parallel job of 2 ranks."""
    import mindspore.communication.management as management
    import mindspore.train.callback._train_fault_tolerance as tft_module
    import mindspore.utils.utils as tft_utils
    from mindspore import context

    class AscendContext:
        def __getattr__(self, name: str) -> Any:
            return getattr(context, name)

        @staticmethod
        def get_context(key: str) -> Any:
            return "Ascend" if key == "device_target" else context.get_context(key)

    real_parallel = context.get_auto_parallel_context
    monkeypatch.setattr(tft_utils._tft_handler, "tft", None)  # MindIO not yet started in this "process"
    monkeypatch.setattr(tft_module, "context", AscendContext())
    monkeypatch.setattr(tft_utils, "context", AscendContext())
    monkeypatch.setattr(context, "get_auto_parallel_context",
                        lambda key: "data_parallel" if key == "parallel_mode" else real_parallel(key))
    for module in (management, tft_module):
        monkeypatch.setattr(module, "get_group_size", lambda group=None: 2)
        monkeypatch.setattr(module, "get_rank", lambda group=None: 0)
    return tft_env


def _run_context(tiny: Any, callbacks: list, step: int = 0, wrapped: bool = True, **extra: Any) -> Any:
    """A real RunContext over a real network, shaped as Model.train makes it (4 steps per epoch)."""
    from mindspore import nn
    from mindspore.train import RunContext
    from mindspore.train.callback import TrainFaultTolerance, _InternalCallbackParam

    network = nn.Dense(4, 1)
    optimizer_class = TrainFaultTolerance.get_optimizer_wrapper(nn.Momentum) if wrapped else nn.Momentum
    optimizer = optimizer_class(network.trainable_params(), learning_rate=0.01, momentum=0.9)
    if wrapped:  # put the TFT flag in device memory, as the first optimizer step does
        import mindspore
        from mindspore import ops

        ops.Assign()(optimizer.tft_g_one_flag, mindspore.Tensor([1], mindspore.int32))
    params = _InternalCallbackParam()
    params.train_network = nn.TrainOneStepCell(nn.WithLossCell(network, nn.MSELoss()), optimizer)
    params.network, params.optimizer, params.list_callback = network, optimizer, callbacks
    params.cur_step_num, params.cur_epoch_num, params.batch_num = step, 1 + max(step - 1, 0) // 4, 4
    params.dataset_sink_mode, params.net_outputs = False, None
    params.update(extra)
    return RunContext(params)


def _apis(fakes: Any) -> list[str]:
    return [c["api"] for c in fakes.calls("tft_")]


def test_dying_gasp_saves_where_resume_loads(ascend_dp2: Any, tiny: Any, tmp_path: Path) -> None:
    import mindspore
    from mindspore import load_checkpoint

    from ft_plugins.mindspore import FaultTolerance

    framework_ttp = importlib.import_module("mindio_ttp.framework_ttp")
    callback = FaultTolerance(features="ttp,resume", strict=True)
    checkpoint = tiny.checkpointing(tmp_path)
    checkpoint._append_step_num = 8  # noqa: SLF001  (a resumed run's ModelCheckpoint counts on from step 8)
    context = _run_context(tiny, [callback, checkpoint])
    callback.on_train_begin(context)
    registered = [api for api in _apis(ascend_dp2) if api.startswith("tft_register_")]
    assert sorted(registered) == sorted(set(registered))  # every handler exactly once
    assert {"tft_register_save_ckpt_handler", "tft_register_rename_handler"} <= set(registered)
    assert ["tft_init_processor", "tft_start_processor"] == [a for a in _apis(ascend_dp2) if "processor" in a]

    for step in (1, 2, 3):
        context.original_args().cur_step_num = step
        callback.on_train_step_begin(context)
        callback.on_train_step_end(context)
    replica = [c["args"] for c in ascend_dp2.calls("tft_set_optimizer_replica")]
    assert replica == [[0, repr([{"type": 1, "rank_list": [0, 1], "replica_cnt": 2, "replica_shift": 0}])]]

    trained = np.array([[0.5, -1.5, 2.5, 4.0]], dtype=np.float32)  # the state the three steps reached
    context.original_args().network.weight.set_data(mindspore.Tensor(trained))
    framework_ttp.fake_controller_dying_gasp(3)  # rank 1 died during step 4
    saved = tmp_path / "tiny-1_3.ckpt"  # committed like a regular save, so resume never takes it for a half one
    written = sorted(p.name for p in tmp_path.iterdir() if p.name != "ft_events")  # the job's events, if kept here
    assert written == ["ft_manifest-tiny-1_3.json", saved.name]
    assert callback.runtime.report()["ttp"]["activity"] == f"dying-gasp checkpoints written: {saved}"

    resume = FaultTolerance(features="resume", resume_dir=str(tmp_path))
    dataset = tiny.dataset()
    assert resume.resume.selection.path == str(saved) and resume.initial_epoch(4, dataset) == 0
    fresh = _run_context(tiny, [resume], wrapped=False, train_dataset=dataset)
    resume.on_train_begin(fresh)
    weights = {p.name: p.asnumpy() for p in fresh.original_args().train_network.get_parameters()}
    saved_weights = load_checkpoint(str(saved))
    np.testing.assert_array_equal(weights["weight"], trained)
    np.testing.assert_array_equal(saved_weights["weight"].asnumpy(), trained)
    assert int(saved_weights["step_num"].asnumpy()) == 8 + 3  # the true step, as the run's regular saves record
    assert int(saved_weights["epoch_num"].asnumpy()) == 1
    assert fresh.original_args().cur_step_num == 3  # the dataset skips the 3 steps done: step 4 is next
    callback.on_train_end(context)
    assert "tft_destroy_processor" in _apis(ascend_dp2)


def test_mindio_start_failure_leaves_training_alone(ascend_dp2: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.mindspore import FaultTolerance

    monkeypatch.setenv("FT_FAKE_TTP_INIT", "raise")
    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="ttp")
    callback.on_train_begin(_run_context(tiny, [callback]))
    assert "TrainFaultTolerance refused to start" in _warning(caplog) and "fake vendor failure" in _warning(caplog)
    assert callback.runtime.feature("ttp") is None and "tft_init_processor" in _apis(ascend_dp2)


def test_no_second_train_fault_tolerance(ascend_dp2: Any, tiny: Any, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """MindFormers 1.5+ injects TrainFaultTolerance itself when MS_ENABLE_TFT is set: ours stands aside."""
    from mindspore.train.callback import TrainFaultTolerance

    from ft_plugins.mindspore import FaultTolerance

    injected = TrainFaultTolerance(ckpt_save_path=str(tmp_path))
    before = _apis(ascend_dp2).count("tft_register_save_ckpt_handler")
    callback = FaultTolerance(features="ttp", strict=True)
    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback.on_train_begin(_run_context(tiny, [injected, callback]))
    assert before == 1 and _apis(ascend_dp2).count("tft_register_save_ckpt_handler") == 1
    assert any("does not add a second" in r.getMessage() for r in caplog.records)


def test_uce_arf_retries_need_mindspores_own_callback_in_the_list(ascend_dp2: Any, tiny: Any,
                                                                   tmp_path: Path) -> None:
    """MindSpore's retry wrapper around Model.train (UCE/ARF/HCCE) looks for a TrainFaultTolerance among the
    ``callbacks`` given to train, before training starts: one held inside FaultTolerance is never found.
    The composition docs/frameworks/mindspore.md gives (MindSpore's own in the list, FaultTolerance beside it) is."""
    from mindspore.train.callback import TrainFaultTolerance
    from mindspore.train.model import _get_tft_obj

    from ft_plugins.mindspore import FaultTolerance, TtpCallback

    alone = FaultTolerance(features="ttp,resume")
    assert _get_tft_obj(callbacks=[alone]) is None
    own = TrainFaultTolerance(ckpt_save_path=str(tmp_path))
    beside = FaultTolerance(features="ttp,resume")
    assert _get_tft_obj(callbacks=[own, beside]) is own
    beside.on_train_begin(_run_context(tiny, [own, beside]))
    ttp = next(part for part in beside.parts if isinstance(part, TtpCallback))
    assert ttp.delegate is None and ttp.ttp is None  # TTP left to MindSpore's own


def _warning(caplog: pytest.LogCaptureFixture) -> str:
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "ttp" in r.getMessage()]
    assert len(messages) == 1, messages
    return messages[0]


@pytest.mark.parametrize("value, fault", [("{TTP: 1}", "' TTP: 1'"), ("{TTP:on}", "'TTP:on'"),
                                          ("{TPP:1}", "'TPP:1'"), ("TTP=1", "'TTP=1'")])
def test_malformed_ms_enable_tft(tft_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                 value: str, fault: str) -> None:
    from ft_plugins.mindspore import FaultTolerance
    from ft_plugins.runtime import FeatureUnavailable

    monkeypatch.setenv("MS_ENABLE_TFT", value)
    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert FaultTolerance(features="taskd,ttp").runtime.feature("ttp") is None
    message = _warning(caplog)
    assert f"MS_ENABLE_TFT={value!r} is not valid" in message and fault.strip("' ").split()[0] in message
    assert "'{TTP:1}'" in message
    with pytest.raises(FeatureUnavailable, match="MS_ENABLE_TFT"):
        FaultTolerance(features="ttp", strict=True)


def _train_with(tiny: Any, callback: Any) -> None:
    tiny.model().train(1, tiny.dataset(), callbacks=[callback])


def test_unwrapped_optimizer_and_dp1_in_a_real_run(tft_env: Any, tiny: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Real Model.train on one CPU process: TTP is refused with the reason, training proceeds."""
    from ft_plugins.mindspore import FaultTolerance

    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="ttp,mstx", mstx={"backend": "mindspore"})
    _train_with(tiny, callback)
    assert "optimizer is not wrapped for TFT" in _warning(caplog)
    assert callback.runtime.feature("ttp") is None and callback.runtime.feature("mstx").counts["step"] == 4
    assert not [api for api in _apis(tft_env) if api.startswith("tft_register_")]


def test_dp1_refused(tft_env: Any, tiny: Any, caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.mindspore import FaultTolerance
    from ft_plugins.runtime import FeatureUnavailable

    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="ttp")
    callback.on_train_begin(_run_context(tiny, [callback]))
    assert "data parallel is 1 (stand_alone)" in _warning(caplog)
    strict = FaultTolerance(features="ttp", strict=True)
    with pytest.raises(FeatureUnavailable, match="data parallel is 1"):
        strict.on_train_begin(_run_context(tiny, [strict]))


def test_sink_size_refused(ascend_dp2: Any, tiny: Any, caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.mindspore import FaultTolerance

    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback = FaultTolerance(features="ttp")
    callback.on_train_begin(_run_context(tiny, [callback], dataset_sink_mode=True, sink_size=4))
    assert "sink_size=4" in _warning(caplog)
    assert not [api for api in _apis(ascend_dp2) if api.startswith("tft_register_")]


def test_optimizer_shard_without_replica_refused(ascend_dp2: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from mindspore import context

    from ft_plugins.mindspore import FaultTolerance

    callback = FaultTolerance(features="ttp")
    run_context = _run_context(tiny, [callback])
    answers = {"parallel_mode": "data_parallel", "enable_parallel_optimizer": True, "optimizer_weight_shard_size": -1}
    monkeypatch.setattr(context, "get_auto_parallel_context", answers.__getitem__)
    caplog.set_level(logging.INFO, logger="ft_plugins")
    callback.on_train_begin(run_context)
    assert "optimizer_weight_shard_size=-1" in _warning(caplog) and "e.g. 1" in _warning(caplog)


def test_mindspore_too_old(tft_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mindspore.train

    from ft_plugins.mindspore import FaultTolerance

    monkeypatch.delattr(mindspore.train, "TrainFaultTolerance")
    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert FaultTolerance(features="ttp").runtime.feature("ttp") is None
    assert "needs MindSpore 2.5 or newer" in _warning(caplog)


def test_mindio_missing(fakes: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the MindIO fake on the path: TTP off with the install hint, no exception."""
    import importlib.util

    for name, value in TFT_ENV.items():
        monkeypatch.setenv(name, value)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mindio_ttp" else real_find_spec(name, *a))
    from ft_plugins.mindspore import FaultTolerance

    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert FaultTolerance(features="ttp").runtime.feature("ttp") is None
    assert "MindIO TTP is not installed" in _warning(caplog)


def test_mindio_with_the_old_api(tft_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    """A MindIO from before the tft_* rename (ttp_* functions): named as such, TTP off."""
    import sys

    old_mindio(tmp_path)
    for name in [m for m in sys.modules if m.startswith("mindio_ttp")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    from ft_plugins.mindspore import FaultTolerance

    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert FaultTolerance(features="ttp").runtime.feature("ttp") is None
    assert "old ttp_* API" in _warning(caplog)  # the fake modules come back with monkeypatch's undo


def test_mindspore_without_mstx(fakes: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mindspore.profiler

    from ft_plugins.mindspore import FaultTolerance

    monkeypatch.delattr(mindspore.profiler, "mstx")
    caplog.set_level(logging.INFO, logger="ft_plugins")
    assert FaultTolerance(features="mstx", mstx={"backend": "mindspore"}).runtime.feature("mstx") is None
    assert any("needs MindSpore 2.5 or newer" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_unknown_option_is_a_clear_error(fakes: Any) -> None:
    from ft_plugins.config import ConfigError
    from ft_plugins.mindspore import FaultTolerance

    with pytest.raises(ConfigError, match="unknown option 'disk_limit' for feature 'taskd'; known: disk_limit_mb"):
        FaultTolerance(features="taskd", taskd={"disk_limit": 100})
