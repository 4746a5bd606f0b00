"""``hangs``' worker side in a real ``Model.fit`` (MindSpore 2.7.2, CPU): what each section reports to the launcher.

Real: Model.fit with its evaluation, ModelCheckpoint saving on disk. The launcher is the test: it names the
progress directory (``FT_PLUGINS_PROGRESS``) and reads the reports as msrun's watchdog does. The msrun run with
a hung rank is in test_msrun.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ft_plugins import progress
from ft_plugins.config import PROGRESS_VAR


def test_steps_saves_evaluations_and_the_end_are_reported(fakes: Any, tiny: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import mindspore
    from mindspore import nn
    from mindspore.train import Callback, Model

    from ft_plugins.mindspore import FaultTolerance

    monkeypatch.setattr(progress, "_reporter", None)  # a fresh worker process
    monkeypatch.setenv(PROGRESS_VAR, str(tmp_path))
    seen: list[tuple[str, int, int]] = []

    def now(where: str) -> None:
        record = progress.read(str(tmp_path), 0)
        assert record is not None
        seen.append((where, record.section, record.step))

    class Probe(Callback):  # listed after FaultTolerance: sees what it reported
        def on_train_step_begin(self, run_context: Any) -> None:
            now("step begin")

        def on_eval_begin(self, run_context: Any) -> None:
            now("evaluation")

    checkpoint = tiny.checkpointing(tmp_path / "ckpt")
    saving = type(checkpoint).on_train_step_end

    def save_probe(run_context: Any) -> None:  # ModelCheckpoint's own step end, where it saves
        now("checkpoint")
        saving(checkpoint, run_context)

    checkpoint.on_train_step_end = save_probe
    callback = FaultTolerance(features="hangs")
    assert callback.runtime.report()["hangs"]["enabled"], callback.runtime.report()["hangs"]
    mindspore.set_seed(1)
    network = nn.Dense(4, 1)
    model = Model(network, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(network.trainable_params(), 0.01, 0.9),
                  metrics={"loss"})
    model.fit(2, tiny.dataset(), tiny.dataset(), callbacks=[callback, Probe(), checkpoint], dataset_sink_mode=False)
    steps = tiny.STEPS_PER_EPOCH * 2
    assert [s for s in seen if s[0] == "step begin"] == [("step begin", progress.STEP, n) for n in range(1, steps + 1)]
    assert [s for s in seen if s[0] == "checkpoint"] == [("checkpoint", progress.SAVE, n) for n in range(1, steps + 1)]
    assert [s for s in seen if s[0] == "evaluation"] == [("evaluation", progress.EVAL, n) for n in (4, 8)]
    final = progress.read(str(tmp_path), 0)
    assert final is not None and (final.section, final.step, final.begun) == (progress.END, steps, steps)
    assert (tmp_path / "0.stacks").exists()  # asked with SIGUSR2, this worker writes its stacks there


def test_without_a_launcher_watching_nothing_is_reported(fakes: Any, tiny: Any, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.mindspore import HangsCallback

    monkeypatch.setattr(progress, "_reporter", None)
    monkeypatch.delenv(PROGRESS_VAR, raising=False)
    callback = HangsCallback()
    tiny.model().train(1, tiny.dataset(), callbacks=[callback], dataset_sink_mode=False)
    assert not callback.watched and progress._reporter is None  # noqa: SLF001
    assert "no launcher watches these workers (launch with `ft-plugins run -- msrun" in caplog.text
