"""``FaultToleranceCallback``: the Trainer's events delivered to the features ft_plugins runs.

``Trainer(callbacks=[ft_plugins.torch.FaultToleranceCallback()])`` and the automatic hook give the
same behaviour: a Trainer holding one gets no second. What a callback cannot do (choosing the
checkpoint before ``on_train_begin``, committing saves, rotation) is done by the hooks of
``import ft_plugins.torch``, which importing this class performs.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import TrainerCallback

from ft_plugins.torch.hf.events import dispatch


class FaultToleranceCallback(TrainerCallback):  # type: ignore[misc]
    """Forwards step and save events to the running features (none when ft_plugins is disabled)."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dispatch("step_begin", args, state, control, kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dispatch("step_end", args, state, control, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dispatch("train_end", args, state, control, kwargs)
