"""``before_step_ends``: a hook run before any callback's step end, without MindSpore (plain objects stand for
the run's first callback and its ``RunContext``). The hook in a real ``Model.train`` is in test_dump.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ft_plugins.mindspore.base import before_step_ends


class First:
    """The run's first callback (MindSpore's step sync): what its own step end was called with."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_train_step_end(self, run_context: Any) -> None:
        self.calls.append(f"own {run_context.original_args()['cur_step_num']}")


class Context:
    def __init__(self, cb_params: dict[str, Any]) -> None:
        self.cb_params = cb_params

    def original_args(self) -> dict[str, Any]:
        return self.cb_params


def _step_end(first: First, step: int) -> None:
    """What MindSpore's callback manager does for the first callback at a step end."""
    first.on_train_step_end(Context({"cur_step_num": step}))


def test_the_hook_runs_first_at_every_step_end_until_undone() -> None:
    first = First()
    def hook(params: dict[str, Any]) -> None:
        first.calls.append(f"hook {params['cur_step_num']}")

    undo = before_step_ends({"list_callback": [first]}, hook)
    _step_end(first, 1)
    _step_end(first, 2)
    undo()
    _step_end(first, 3)
    assert first.calls == ["hook 1", "own 1", "hook 2", "own 2", "own 3"]
    assert "on_train_step_end" not in vars(first)  # the class was never touched, the instance is as it was


def test_a_hook_that_raises_is_taken_off_and_never_reaches_training(caplog: pytest.LogCaptureFixture) -> None:
    def hook(params: dict[str, Any]) -> None:
        raise OSError("disk gone")

    first = First()
    before_step_ends({"list_callback": [first]}, hook)
    caplog.set_level(logging.WARNING, logger="ft_plugins")
    _step_end(first, 1)
    _step_end(first, 2)
    assert first.calls == ["own 1", "own 2"]
    assert caplog.text.count("before the step ends failed, taken off: OSError: disk gone") == 1


def test_the_undo_leaves_a_later_wrapper_alone() -> None:
    first = First()
    undo = before_step_ends({"list_callback": [first]}, lambda params: None)
    later = first.on_train_step_end
    first.on_train_step_end = lambda run_context: later(run_context)  # type: ignore[method-assign]
    replaced = vars(first)["on_train_step_end"]
    undo()
    assert vars(first)["on_train_step_end"] is replaced


def test_no_callback_or_one_with_slots_leaves_the_run_alone() -> None:
    class Slotted:
        __slots__ = ()

        def on_train_step_end(self, run_context: Any) -> None:
            pass

    for params in ({"list_callback": []}, {}, {"list_callback": [Slotted()]}):
        before_step_ends(params, lambda params: None)()  # nothing hooked, the undo does nothing
