"""Megatron glue for ``ttp``'s ``replicas`` option: replicated distributed-optimizer state, no argument edit.

With ``--use-distributed-optimizer`` every data-parallel rank holds the only copy of its optimizer
shard. megatron-core already splits data parallel into instances that shard the state inside and
replicate it across (``num_distributed_optimizer_instances``); this sets that count from the option,
in ``validate_args``: after the command line is parsed, before megatron derives anything from it
(the printed arguments, the parallel state, the DDP config all see the count). A
``--num-distributed-optimizer-instances`` the user passed wins.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Literal, Sequence

from ft_plugins.patching import Patch
from ft_plugins.rank import on_rank_zero
from ft_plugins.replicas import ReplicaLayout, ReplicaLayoutError, choose_replicas, optimizer_bytes_per_parameter

log = logging.getLogger("ft_plugins.ttp")

ARGUMENTS = "megatron.training.arguments"
FLAG = "--num-distributed-optimizer-instances"
OPTION_VAR = "FT_PLUGINS_TTP_REPLICAS"


def user_flag(argv: Sequence[str]) -> bool:
    """Whether the command line carries megatron's own instance-count flag."""
    return any(arg == FLAG or arg.startswith(f"{FLAG}=") for arg in argv)


def replicated_data_parallel_size(megatron_args: Any) -> int | None:
    """The size megatron splits into instances (data parallel x context parallel), None if not derivable."""
    model_parallel = megatron_args.tensor_model_parallel_size * megatron_args.pipeline_model_parallel_size
    world = getattr(megatron_args, "world_size", None)
    if not world or world % model_parallel:
        return None  # megatron's validate_args reports the inconsistent sizes itself
    return world // model_parallel


class MegatronReplicas:
    """Sets ``num_distributed_optimizer_instances`` from the ``replicas`` option (wrapt wrapper on ``validate_args``)."""

    def __init__(self, requested: int | Literal["auto"], strict: bool) -> None:
        self.requested = requested
        self.strict = strict

    def patches(self) -> tuple[Patch, ...]:
        return (Patch(ARGUMENTS, "validate_args", self.validate_args),)

    def validate_args(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self.configure(kwargs["args"] if "args" in kwargs else args[0])
        return wrapped(*args, **kwargs)

    def configure(self, megatron_args: Any) -> None:
        """Set the instance count on megatron's parsed arguments, or raise ReplicaLayoutError (strict)."""
        if not getattr(megatron_args, "use_distributed_optimizer", False):
            return  # the plain optimizer: every rank already holds the whole state
        size = replicated_data_parallel_size(megatron_args)
        if size is None:
            return
        if user_flag(sys.argv):  # read now: entry scripts rewrite sys.argv
            on_rank_zero(log.info, "ttp: %s %s given on the command line: it wins over %s", FLAG,
                       megatron_args.num_distributed_optimizer_instances, OPTION_VAR)
            return
        try:
            choice = choose_replicas(self.requested, size, strict=self.strict)
        except ReplicaLayoutError as exc:
            raise ReplicaLayoutError(f"ttp: {OPTION_VAR}={self.requested}: {exc} "
                                     f"(or leave replicas to megatron with {FLAG})") from None
        if choice.warning:
            on_rank_zero(log.warning, "ttp: %s", choice.warning)
        megatron_args.num_distributed_optimizer_instances = choice.replicas
        layout = ReplicaLayout.build(range(size), choice.replicas)
        on_rank_zero(log.info, "ttp: distributed optimizer with %d replica%s over data-parallel size %d (instances "
                   "of %d ranks): optimizer state %.2f bytes per parameter with mixed precision, against %.2f "
                   "unreplicated", layout.replicas, "" if layout.replicas == 1 else "s", size, layout.shard_count,
                   layout.optimizer_bytes_per_parameter(), optimizer_bytes_per_parameter(size))
