"""The glue calls Megatron as each supported release takes the call, from megatron-core 0.8 (MindSpeed-LLM's base)
to 0.19. ``megatron.training`` of the releases before 0.17 is not on any package registry (their wheels hold
``megatron.core`` only), so its functions stand in here with each release's own signature, as Megatron-LM's
source at the release tag has it (``core_r0.8.0``, ``core_v0.12.1``, ``core_v0.17.0``)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from ft_plugins.torch.megatron import handover, loop, state


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _release(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    _module(monkeypatch, "megatron.core.package_info", __version__=version)


def test_the_rng_state_is_asked_for_as_each_release_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def release_0_8(use_dist_ckpt: bool = False) -> list:
        calls.append((use_dist_ckpt,))
        return ["0.8"]

    def release_0_12(ckpt_format: str) -> list:
        calls.append((ckpt_format,))
        return ["0.12"]

    def release_0_17(ckpt_format: str, tp_group: Any, pp_group: Any) -> list:
        calls.append((ckpt_format, tp_group, pp_group))
        return ["0.17"]

    for get_rng_state in (release_0_8, release_0_12, release_0_17):
        _module(monkeypatch, "megatron.training.checkpointing", get_rng_state=get_rng_state)
        assert state.rng_state() == [get_rng_state.__name__.replace("release_", "").replace("_", ".")]
    assert calls == [(False,), ("torch",), ("torch", None, None)]


def test_unwrap_model_is_taken_from_where_the_release_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _release(monkeypatch, "0.8.0")
    _module(monkeypatch, "megatron.core.utils")  # 0.8: not here
    _module(monkeypatch, "megatron.training.utils", unwrap_model=lambda model: ("training.utils", model))
    assert state.unwrap_model("m") == ("training.utils", "m")
    _module(monkeypatch, "megatron.core.utils", unwrap_model=lambda model: ("core.utils", model))  # 0.14 on
    assert state.unwrap_model("m") == ("core.utils", "m")
    _module(monkeypatch, "megatron.core.utils")
    _module(monkeypatch, "megatron.training.utils")
    with pytest.raises(AttributeError, match=r"megatron-core 0.8.0 has no unwrap_model in megatron.core.utils or "
                                             r"megatron.training.utils"):
        state.unwrap_model("m")


@pytest.mark.parametrize("version, items", [("0.8.0", 4), ("0.9.0", 4), ("0.10.0", 7), ("0.12.1", 7),
                                            ("0.15.0", 7), ("0.16.0", 8), ("0.17.1", 8), ("0.19.0", 8)])
def test_a_step_done_by_a_peer_returns_what_the_releases_train_step_returns(
        monkeypatch: pytest.MonkeyPatch, version: str, items: int) -> None:
    _release(monkeypatch, version)
    assert state.train_step_items() == items
    result = loop.done_by_peer(items)
    assert len(result) == items and result[:2] == ({}, 0)
    if items == 4:  # loss_dict, skipped_iter, grad_norm, num_zeros_in_grad: no norm to log
        assert result[2:] == (None, None)
    else:  # no save, no exit asked
        assert result[2:5] == (False, False, 0)


def test_the_iteration_training_log_is_called_with_in_each_release() -> None:
    def release_0_8(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration, loss_scale,
                    report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
        """megatron-core 0.8 to 0.15."""

    def release_0_17(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit, **rest):
        """megatron-core 0.17 (no decoupled learning rate)."""

    assert state.argument(release_0_8, ({}, {}, 0.1, 0.2, 7, 1.0, False, 0, 1.5, 2.0, 0), {}, "iteration") == 7
    assert state.argument(release_0_17, ({}, {}, 0.1, 7, 1.0, False, 0, 1.5, 2.0, 0, None), {}, "iteration") == 7
    assert state.argument(release_0_17, ({}, {}, 0.1), {"iteration": 9}, "iteration") == 9


def test_the_rerun_state_machine_is_reset_only_where_the_release_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "megatron.core.rerun_state_machine", raising=False)
    loop.rerun_anew()  # megatron-core 0.8: nothing to reset
    not_yet, running = object(), object()
    machine = SimpleNamespace(state=running, current_iteration=5)
    _module(monkeypatch, "megatron.core.rerun_state_machine", get_rerun_state_machine=lambda: machine,
            RerunState=SimpleNamespace(NOT_RUNNING_YET=not_yet))
    loop.rerun_anew()
    assert (machine.state, machine.current_iteration) == (not_yet, 4)


def test_the_distributed_optimizer_of_each_release_is_found_and_recover_refuses_one_it_cannot_hand_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Release08:  # megatron-core 0.8's DistributedOptimizer: the dp_zero gather only
        def get_parameter_state_dp_zero(self) -> dict:
            return {}

    class Release17(Release08):
        def get_parameter_state_dp_reshardable(self) -> dict:
            return {}

    chained = SimpleNamespace(chained_optimizers=[Release08(), object()])
    assert [type(member) for member in state.sharded_optimizers(chained)] == [Release08]
    layout = SimpleNamespace(use_distributed_optimizer=True, num_distributed_optimizer_instances=2,
                             pipeline_model_parallel_size=1)
    _release(monkeypatch, "0.8.0")
    _module(monkeypatch, "megatron.core.optimizer.distrib_optimizer", DistributedOptimizer=Release08)
    assert handover.unsupported(layout) == (
        "--use-distributed-optimizer on megatron-core 0.8.0: the hand-over moves the optimizer's shards with "
        "get_parameter_state_dp_reshardable, which this release does not have")
    _module(monkeypatch, "megatron.core.optimizer.distrib_optimizer", DistributedOptimizer=Release17)
    assert handover.unsupported(layout) == ""
    layout.use_distributed_optimizer = False
    _module(monkeypatch, "megatron.core.optimizer.distrib_optimizer", DistributedOptimizer=Release08)
    assert handover.unsupported(layout) == ""


def test_the_rng_tracker_is_restored_with_and_without_graph_safe_states(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    import numpy as np
    import torch

    class Tracker:
        states: dict = {}

        def set_states(self, states: dict) -> None:
            self.states = states

    tracker = Tracker()
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
            "rng_tracker_states": {"model-parallel-rng": "saved"}}]
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda value: None)
    _module(monkeypatch, "megatron.core.tensor_parallel", get_cuda_rng_tracker=lambda: tracker)  # 0.8 to 0.15
    handover.set_rng(rng)
    assert tracker.states == {"model-parallel-rng": "saved"}
    _module(monkeypatch, "megatron.core.tensor_parallel", get_cuda_rng_tracker=lambda: tracker,
            is_graph_safe_cuda_rng_tracker=lambda given: given is tracker,
            convert_cuda_rng_state=lambda value, to_graphable: (value, to_graphable))
    handover.set_rng(rng)
    assert tracker.states == {"model-parallel-rng": ("saved", True)}
