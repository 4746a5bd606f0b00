"""The Megatron process state the torch glue shares: megatron's modules, its parsed arguments, the iteration a
``train_step`` call runs. A leaf: every feature's glue reads these here, none imports another's glue."""

from __future__ import annotations

import copy
import sys
from typing import Any

# the modules the glue hooks into
INITIALIZE = "megatron.training.initialize"
TRAINING = "megatron.training.training"
CHECKPOINTING = "megatron.training.checkpointing"
MINDSPEED_LLM_TRAINING = "mindspeed_llm.training.training"
OPTIMIZER = "megatron.core.optimizer.optimizer"
# the optimizer's own update, without the grad-norm all-reduce that ``step`` adds
UPDATES = ("FP32Optimizer.step_with_ready_grads", "MixedPrecisionOptimizer.step_with_ready_grads",
           "ChainedOptimizer.step_with_ready_grads")


def megatron(name: str) -> Any:
    """An imported ``megatron.<name>`` module (the glue runs only once megatron imported it)."""
    return sys.modules[f"megatron.{name}"]


def megatron_args() -> Any:
    """Megatron's parsed arguments (``get_args()``)."""
    return megatron("training.global_vars").get_args()


# the checkpoint formats whose jobs resume from a torch-format directory: Megatron's load tells the format by
# what the directory holds when --ckpt-format is torch_dist (or --auto-detect-ckpt-format is given)
RESUMES_TORCH_FORMAT = ("torch", "torch_dist")


def saved_state(model: Any, optimizer: Any, scheduler: Any, iteration: int, rng: Any, consumed: int) -> dict[str, Any]:
    """What Megatron's ``save_checkpoint`` at ``iteration`` holds, with ``consumed`` samples, in the torch format
    whatever ``--ckpt-format`` says: it needs no collective (a torch_dist save is one over every rank, a lost one
    included). The state's own arguments keep the job's format, so the job's later saves stay in it."""
    state_args = copy.copy(megatron_args())
    state_args.consumed_train_samples = consumed
    torch_format = copy.copy(state_args)
    torch_format.ckpt_format = "torch"
    state = megatron("training.checkpointing").generate_state_dict(
        torch_format, megatron("core.utils").unwrap_model(model), optimizer, scheduler, rng, iteration=iteration)
    state["args"] = state_args
    return state


def sharded_optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside ``optimizer`` (a chained one holds several): each holds a shard of
    its instance's parameter state. Empty without ``--use-distributed-optimizer``."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [member for member in chained if hasattr(member, "get_parameter_state_dp_reshardable")]


def current_iteration(args: tuple, kwargs: dict) -> int:
    """``train_step``'s iteration argument (megatron 0.12+), else ``args.curr_iteration``: steps completed."""
    iteration = kwargs.get("iteration", args[7] if len(args) > 7 else None)
    if iteration is None:
        global_vars = sys.modules.get("megatron.training.global_vars")
        parsed = getattr(global_vars, "_GLOBAL_ARGS", None)
        iteration = getattr(parsed, "curr_iteration", 0)
    return iteration


def megatron_version() -> str:
    info = sys.modules.get("megatron.core.package_info")
    if info is None:
        try:
            from megatron.core import package_info as info  # type: ignore[no-redef]
        except ImportError:
            return "unknown version"
    return getattr(info, "__version__", "unknown version")
