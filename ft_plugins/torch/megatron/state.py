"""The Megatron process state the torch glue shares: megatron's modules, its parsed arguments, the iteration a
``train_step`` call runs. A leaf: every feature's glue reads these here, none imports another's glue."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
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


def optional_megatron(name: str) -> Any:
    """``megatron.<name>`` if this release has it and it is imported, else None (e.g. the rerun state machine,
    which megatron-core 0.8 does not have)."""
    return sys.modules.get(f"megatron.{name}")


def moved(attribute: str, *places: str) -> Any:
    """``attribute`` from the first ``megatron.<place>`` holding it: a name that moved between the supported
    releases, looked up in each place a release keeps it, newest first."""
    for place in places:
        try:
            module = importlib.import_module(f"megatron.{place}")
        except ImportError:
            continue
        if hasattr(module, attribute):
            return getattr(module, attribute)
    raise AttributeError(f"megatron-core {megatron_version()} has no {attribute} in "
                         f"{' or '.join(f'megatron.{place}' for place in places)}")


def unwrap_model(model: Any) -> Any:
    """Megatron's ``unwrap_model``: in ``megatron.training.utils`` in megatron-core 0.8, in ``megatron.core.utils``
    in later releases (there only since 0.19)."""
    return moved("unwrap_model", "core.utils", "training.utils")(model)


@functools.lru_cache(maxsize=None)
def signature(function: Any) -> inspect.Signature:
    """``function``'s signature, read once: the calls made as each release takes them ask for it every step."""
    return inspect.signature(function)


def rng_state() -> Any:
    """Megatron's ``get_rng_state`` in the torch format (a list, this rank's entry first), called as each release
    takes it: ``(use_dist_ckpt)`` up to megatron-core 0.11, ``(ckpt_format)`` to 0.15, then with the tensor- and
    pipeline-parallel groups (None: the default ones)."""
    get_rng_state = megatron("training.checkpointing").get_rng_state
    first, *rest = signature(get_rng_state).parameters.values()
    groups = [None for parameter in rest if parameter.default is inspect.Parameter.empty]
    return get_rng_state(False if first.name == "use_dist_ckpt" else "torch", *groups)


def argument(function: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value parameter ``name`` of ``function`` takes in a call with ``args`` and ``kwargs``: for parameters whose
    place moved between releases (``training_log``'s ``iteration`` is its fifth in megatron-core 0.8, its fourth
    in 0.17)."""
    return signature(function).bind_partial(*args, **kwargs).arguments[name]


def train_step_items() -> int:
    """How many items Megatron's ``train_step`` returns: 4 up to megatron-core 0.9, 7 from 0.10, 8 since 0.16."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(megatron_version()).release
    except InvalidVersion:
        return 8
    return 4 if release < (0, 10) else 7 if release < (0, 16) else 8


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
        torch_format, unwrap_model(model), optimizer, scheduler, rng, iteration=iteration)
    state["args"] = state_args
    return state


def sharded_optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside ``optimizer`` (a chained one holds several): each holds a shard of
    its instance's parameter state. Empty without ``--use-distributed-optimizer``. Told by the gather every
    supported release has (``get_parameter_state_dp_zero``, megatron-core 0.8 to 0.19)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [member for member in chained if hasattr(member, "get_parameter_state_dp_zero")]


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
