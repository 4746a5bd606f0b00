"""The hooks in this process, on the real transformers / accelerate modules: every copy of
``get_last_checkpoint`` rebound and restored, one callback per Trainer (subclasses included), a moved
internal turning its feature off with one message; and, on the reference run's checkpoints, what stock
transformers does with each kind of damage (the negative controls) against what ft_plugins does."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hf_runs import Job

from support import PYTHON

HOOKED = (("transformers.trainer", "Trainer", "_save_checkpoint"), ("transformers.trainer", "Trainer", "train"),
          ("transformers.trainer", "Trainer", "_rotate_checkpoints"), ("transformers.trainer", "Trainer", "__init__"),
          ("accelerate.accelerator", "Accelerator", "save_state"),
          ("accelerate.accelerator", "Accelerator", "load_state"))


@pytest.fixture
def ft_torch(no_ft_env):
    import transformers.trainer  # noqa: F401  (imported before ft_plugins here; the other order: a subprocess)
    import accelerate.accelerator  # noqa: F401

    import ft_plugins.torch as ft_torch

    ft_torch.disable()
    yield ft_torch
    ft_torch.disable()


def _hooked() -> list[object]:
    return [vars(getattr(sys.modules[module], owner))[name] for module, owner, name in HOOKED]


def _copies(holder: types.ModuleType) -> list[object]:
    import transformers.trainer
    import transformers.trainer_utils

    return [transformers.trainer_utils.get_last_checkpoint, transformers.trainer.get_last_checkpoint,
            holder.get_last_checkpoint]


def test_every_copy_is_hooked_once_and_disable_restores_every_original(ft_torch) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    holder = types.ModuleType("ft_test_script_holder")  # a script that imported it by name, as TRL does
    holder.get_last_checkpoint = get_last_checkpoint
    sys.modules[holder.__name__] = holder
    try:
        originals, functions = _hooked(), _copies(holder)
        ft_torch.enable("resume,mstx", mstx={"backend": "noop"})
        ft_torch.enable("resume,mstx", mstx={"backend": "noop"})
        assert all(copy is not functions[0] and copy.__wrapped__ is functions[0] for copy in _copies(holder))
        assert all(now is not before for now, before in zip(_hooked(), originals))
        ft_torch.disable()
        assert _copies(holder) == functions and all(now is before for now, before in zip(_hooked(), originals))
    finally:
        del sys.modules[holder.__name__]


def _trainer(tmp_path: Path, trainer_class: type | None = None, callbacks: list | None = None) -> object:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1,
                             save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    return (trainer_class or Trainer)(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_one_callback_per_trainer_given_or_added_and_subclasses_keep_working(ft_torch, tmp_path: Path) -> None:
    from transformers import Trainer

    ft_torch.enable("resume")
    callback_class = ft_torch.FaultToleranceCallback
    given = _trainer(tmp_path, callbacks=[callback_class()])
    added = _trainer(tmp_path)

    class Custom(Trainer):
        calls = 0

        def training_step(self, *args, **kwargs):
            Custom.calls += 1
            return super().training_step(*args, **kwargs)

    custom = _trainer(tmp_path, Custom)
    for trainer in (given, added, custom):
        assert sum(isinstance(cb, callback_class) for cb in trainer.callback_handler.callbacks) == 1
    custom.train()
    assert Custom.calls == 1 and custom.state.global_step == 1


def test_a_moved_internal_turns_its_feature_off_with_one_message(ft_torch, monkeypatch, caplog) -> None:
    from transformers import Trainer

    monkeypatch.delattr(Trainer, "_rotate_checkpoints")
    with caplog.at_level(logging.WARNING, logger="ft_plugins"):
        runtime = ft_torch.enable("resume,mstx", mstx={"backend": "noop"})
    lines = [record.getMessage() for record in caplog.records if "disabled" in record.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("resume disabled: transformers.trainer.Trainer._rotate_checkpoints"
                                                   " is missing in transformers 4.")
    assert runtime.feature("resume") is None and runtime.feature("mstx") is not None
    import transformers.trainer_utils as utils

    assert not hasattr(utils.get_last_checkpoint, "__wrapped__")  # the whole resume set is off
    assert _owners(vars(Trainer)["train"]) == ["CleanExit"]  # resume's own wrapper is not there


def _owners(function: object) -> list[str]:
    """The classes whose hooks wrap ``function``, outermost first."""
    owners = []
    while hasattr(function, "__wrapped__"):
        owners.append(type(function._self_wrapper.__self__).__name__)  # type: ignore[attr-defined]
        function = function.__wrapped__  # type: ignore[attr-defined]
    return owners


def test_hooks_reach_transformers_imported_after_ft_plugins(tmp_path: Path) -> None:
    code = ("import ft_plugins.torch, transformers.trainer as t, transformers.trainer_utils as u\n"
            "print(t.get_last_checkpoint is u.get_last_checkpoint, hasattr(t.get_last_checkpoint, '__wrapped__'),"
            " hasattr(vars(t.Trainer)['_save_checkpoint'], '__wrapped__'))")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}, "PYTHONPATH": "",
           "FT_PLUGINS": "resume"}
    result = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True", "True"], result.stderr[-2000:]


def _damaged(reference: Job, tmp_path: Path, kind: str) -> Path:
    """A copy of the reference's checkpoints 2 and 4 with checkpoint-4 damaged by ``kind``."""
    out = tmp_path / kind
    for step in (2, 4):
        shutil.copytree(reference.checkpoint(step), out / f"checkpoint-{step}")
    newest = out / "checkpoint-4"
    if kind == "truncated":
        os.truncate(newest / "model.safetensors", 1000)
    elif kind == "no_optimizer":
        (newest / "optimizer.pt").unlink()
    elif kind == "no_trainer_state":
        (newest / "trainer_state.json").unlink()
    elif kind == "empty":
        shutil.rmtree(newest)
        newest.mkdir()
    return out


@pytest.mark.parametrize("kind", ["truncated", "no_optimizer", "no_trainer_state", "empty"])
def test_stock_resumes_the_damaged_newest_and_ft_plugins_the_previous_one(
        ft_torch, reference: Job, tmp_path: Path, kind: str) -> None:
    import transformers.trainer_utils as utils

    out = _damaged(reference, tmp_path, kind)
    stock_choice = utils.get_last_checkpoint(str(out))
    assert stock_choice == str(out / "checkpoint-4")
    trainer = _trainer(tmp_path)
    if kind == "no_optimizer":  # stock: a fresh optimizer and schedule, silently
        trainer.create_optimizer_and_scheduler(num_training_steps=12)
        trainer._load_optimizer_and_scheduler(stock_choice)
        assert trainer.optimizer.state_dict()["state"] == {}
    else:
        with pytest.raises(Exception):
            trainer._load_from_checkpoint(stock_choice)
            from transformers.trainer_callback import TrainerState

            TrainerState.load_from_json(os.path.join(stock_choice, "trainer_state.json"))
    ft_torch.enable("resume")
    assert utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_an_explicit_damaged_path_or_no_intact_checkpoint_is_refused_before_training(
        ft_torch, reference: Job, tmp_path: Path) -> None:
    import transformers.trainer_utils as utils

    from ft_plugins.checkpoint.errors import NoIntactCheckpoint

    out = _damaged(reference, tmp_path, "truncated")
    ft_torch.enable("resume")
    trainer = _trainer(tmp_path)
    with pytest.raises(NoIntactCheckpoint, match="checkpoint-4 is not intact: model.safetensors"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert trainer.state.global_step == 0
    shutil.rmtree(out / "checkpoint-2")
    with pytest.raises(NoIntactCheckpoint, match="none is intact"):
        utils.get_last_checkpoint(str(out))
