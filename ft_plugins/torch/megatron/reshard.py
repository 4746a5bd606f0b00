"""Megatron's distributed optimizer laid out again for a new data-parallel size, in place, for ``elastic``.

Megatron shards the fp32 main parameters and the optimizer's moments over the data-parallel ranks by ranges of
each gradient buffer, whose padding and ranges follow the size. Once the groups stand at the new size: each model
chunk's buffers are built again by Megatron's own ``DistributedDataParallel`` (the parameters move into them, their
values kept; the gradient hooks registered at start stay the only working ones: they reach the buffers through the
chunk), the optimizer by Megatron's own ``get_megatron_optimizer`` with the arguments ``setup_model_and_optimizer``
gave it, and each rank's new ranges are filled from the ranges the survivors held, point to point inside the new
data-parallel group. That is what Megatron's own resume at the new size loads from a save of the step, without a
file: the main parameters and moments moved as they are, never recomputed from 16-bit weights.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from ft_plugins.torch.megatron.state import megatron, optional_megatron, sharded_optimizers

Where = tuple[int, int]  # a parameter: (model chunk, its index among the chunk's parameters), alike on every rank


class Piece(NamedTuple):
    """A range of one parameter's optimizer state: main parameter and moments, flat."""

    where: Where
    start: int
    end: int
    tensors: dict[str, Any]


class Unmovable(RuntimeError):
    """The layout cannot be built from what the survivors hold; the message says why."""


def unreshardable(megatron_args: Any) -> str:
    """Why this run's distributed optimizer cannot be laid out again in place ("" when it can)."""
    sharded = getattr(optional_megatron("core.optimizer.distrib_optimizer"), "DistributedOptimizer", None)
    if sharded is not None and not hasattr(sharded, "_get_main_param_and_optimizer_states"):
        return "Megatron's distributed optimizer on this release: it has no per-parameter view of its shards"
    if getattr(megatron_args, "overlap_param_gather", False):
        return "Megatron's distributed optimizer with --overlap-param-gather: its forward hooks are not built again"
    if getattr(megatron_args, "use_precision_aware_optimizer", False):
        return "Megatron's precision-aware optimizer: its scaled moments are not moved yet"
    return ""


def pieces(model: list[Any], optimizer: Any) -> list[Piece]:
    """The ranges of optimizer state this rank holds in ``optimizer``'s layout."""
    import torch

    where = {param: (chunk, index)
             for chunk, module in enumerate(model) for index, param in enumerate(module.parameters())}
    found = []
    for member in sharded_optimizers(optimizer):
        for bucket in (bucket for buffer_ranges in member.gbuf_ranges for buckets in buffer_ranges.values()
                       for bucket in buckets):
            for param, ranges in bucket["param_map"].items():
                state = member._get_main_param_and_optimizer_states(param)
                tensors = {name: value for name, value in state.items()
                           if torch.is_tensor(value) and value.dim() > 0}  # the step count is not sharded
                found.append(Piece(where[param], ranges["param"].start, ranges["param"].end, tensors))
    return found


def rebuild_buffers(model: list[Any], megatron_args: Any) -> None:
    """Each chunk's buffers and bucket groups built by Megatron's DDP at the groups' size, moved into the chunk."""
    base = megatron("core.distributed").DistributedDataParallel

    class Rebuilt(base):  # type: ignore[misc, valid-type]
        def _make_backward_post_hook(self, param: Any) -> Any:  # the chunk's own hooks stay, reading these buffers
            return lambda *unused: None

    for index, chunk in enumerate(model):
        rebuilt = Rebuilt(config=chunk.config, ddp_config=chunk.ddp_config, module=chunk.module,
                          disable_bucketing=index > 0 or bool(getattr(megatron_args,
                                                                      "overlap_param_gather_with_optimizer_step",
                                                                      False)))
        vars(chunk).update({name: value for name, value in vars(rebuilt).items()
                            if not name.startswith("_") and name not in ("grad_accs", "training")})


def rebuild_optimizer(optimizer: Any, built: tuple[tuple, dict]) -> Any:
    """Megatron's optimizer built again with ``built`` (``get_megatron_optimizer``'s arguments) over the chunks' new
    buffers, holding ``optimizer``'s state other than the parameters' (learning rates, steps, loss scale)."""
    args, kwargs = built
    rebuilt = megatron("training.training").get_megatron_optimizer(*args, **kwargs)
    if type(rebuilt) is not type(optimizer):
        raise Unmovable(f"Megatron built a {type(rebuilt).__name__} where the run has a {type(optimizer).__name__}")
    rebuilt.load_state_dict(optimizer.state_dict())
    return rebuilt


def move(held: list[Piece], needed: list[Piece], step: int, group: Any) -> None:
    """Fill ``needed`` (this rank's ranges in the new layout) from what every member of ``group`` ``held``, each
    range from its own holder where it holds it, else from the lowest rank that does; every member stands at
    ``step``."""
    import torch
    import torch.distributed as dist

    table: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, (step, [p[:3] for p in held], [p[:3] for p in needed]), group=group)
    steps = {entry[0] for entry in table}
    if len(steps) > 1 or min(steps) < 0:
        raise Unmovable(f"the survivors stand at steps {sorted(steps)}: the shards are moved from one completed step")
    me = dist.get_rank(group)
    plan = transfers([entry[1] for entry in table], [entry[2] for entry in table])
    mine = _by_parameter(held)
    wanted = {p[:3]: p for p in needed}
    sends, receives, operations = [], [], []
    for source, target, need, start, end in plan:
        if source == me:
            part = next(p for p in mine[need[0]] if p.start <= start and end <= p.end)
            span = {name: value[start - part.start:end - part.start] for name, value in part.tensors.items()}
            if target == me:
                _write(wanted[need], start, span)
            else:
                sends.append((target, span))
        elif target == me:
            into = wanted[need]
            span = {name: torch.empty(end - start, dtype=value.dtype, device=value.device)
                    for name, value in into.tensors.items()}
            receives.append((source, into, start, span))
    for target, span in sends:
        operations += [dist.P2POp(dist.isend, span[name].contiguous(), group=group, group_peer=target)
                       for name in sorted(span)]
    for source, _, _, span in receives:
        operations += [dist.P2POp(dist.irecv, span[name], group=group, group_peer=source) for name in sorted(span)]
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    for _, into, start, span in receives:
        _write(into, start, span)


def transfers(held: list[list[tuple]], needed: list[list[tuple]]) -> list[tuple[int, int, tuple, int, int]]:
    """(source, target, the needed range, start, end) for every part of every member's needed ranges."""
    holders: dict[Where, list[tuple[int, int, int]]] = {}
    for rank, ranges in enumerate(held):
        for where, start, end in ranges:
            holders.setdefault(tuple(where), []).append((rank, start, end))
    plan = []
    for target, ranges in enumerate(needed):
        for need in ranges:
            where, at, end = tuple(need[0]), need[1], need[2]
            candidates = sorted(holders.get(where, ()), key=lambda h: (h[0] != target, h[0]))
            while at < end:
                holder = next(((rank, stop) for rank, begin, stop in candidates if begin <= at < stop), None)
                if holder is None:
                    raise Unmovable(f"elements {at} to {end} of parameter {where} have no surviving holder")
                plan.append((holder[0], target, (where, need[1], need[2]), at, min(end, holder[1])))
                at = min(end, holder[1])
    return plan


def _by_parameter(held: Iterable[Piece]) -> dict[Where, list[Piece]]:
    found: dict[Where, list[Piece]] = {}
    for piece in held:
        found.setdefault(piece.where, []).append(piece)
    return found


def _write(into: Piece, start: int, span: dict[str, Any]) -> None:
    for name, value in into.tensors.items():
        value[start - into.start:start - into.start + len(span[name])].copy_(span[name])
