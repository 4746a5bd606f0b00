"""What a replaced or lagging rank receives in ``recover``: the state a save at step K holds, from a peer.

The holder builds it as Megatron's ``save_checkpoint`` at K would (``generate_state_dict``: model,
optimizer, scheduler, RNG, arguments with the consumed samples at K, floating point operations; with the
distributed optimizer also the holder's own shard of the parameter state, which only a rank at the same
place of another optimizer instance holds too), serializes it with ``torch.save`` into memory and sends
it point to point inside the data-parallel group (size, then bytes); the receiver applies it as Megatron's
``load_checkpoint`` would. No file is written or read. :class:`Batches` keeps a step's batches so that a
step run again reads the same data.
"""

from __future__ import annotations

import io
import logging
import random
from contextlib import contextmanager
from typing import Any, Iterator

from ft_plugins.torch.megatron.state import (RESUMES_TORCH_FORMAT, megatron, megatron_version, optional_megatron,
                                             saved_state, sharded_optimizers, unwrap_model)

log = logging.getLogger("ft_plugins.recover")

# the distributed optimizer's shard of the parameter state: the sender's place in its instance, one shard per
# sharded optimizer
PARAMETER_STATE = "ft_plugins_parameter_state"


def unreplicated(megatron_args: Any) -> str:
    """Why a lost rank's optimizer state has no other holder ("" when it has one)."""
    if megatron_args.use_distributed_optimizer and (getattr(megatron_args, "num_experts", None) or 0) > 1:
        return ("mixture of experts with megatron's distributed optimizer: the experts' optimizer shards are not "
                "handed over yet")
    if megatron_args.use_distributed_optimizer and getattr(megatron_args, "num_distributed_optimizer_instances", 1) < 2:
        return ("megatron's distributed optimizer in one instance: a lost rank's optimizer shard has no other "
                "holder (FT_PLUGINS_TTP_REPLICAS=2, or --num-distributed-optimizer-instances 2)")
    return ""


def unsupported(megatron_args: Any) -> str:
    """Why a lost rank cannot be replaced in this run (empty when it can)."""
    if (form := getattr(megatron_args, "ckpt_format", "torch")) not in RESUMES_TORCH_FORMAT:
        return (f"--ckpt-format {form}: the hand-over moves the state of Megatron's DDP and optimizers as the "
                f"{' and '.join(RESUMES_TORCH_FORMAT)} formats save it")
    sharded = getattr(optional_megatron("core.optimizer.distrib_optimizer"), "DistributedOptimizer", None)
    if getattr(megatron_args, "use_distributed_optimizer", False) and not hasattr(
            sharded, "get_parameter_state_dp_reshardable"):
        return (f"--use-distributed-optimizer on megatron-core {megatron_version()}: the hand-over moves the "
                "optimizer's shards with get_parameter_state_dp_reshardable, which this release does not have")
    return unreplicated(megatron_args)


def instance_place(optimizer: Any) -> int | None:
    """This rank's place in its distributed-optimizer instance: ranks at the same place of every instance hold
    the same shard. None without the distributed optimizer (every data-parallel rank holds all of it)."""
    import torch.distributed as dist

    sharded = sharded_optimizers(optimizer)
    return dist.get_process_group_ranks(sharded[0].data_parallel_group).index(dist.get_rank()) if sharded else None


def what_this_rank_holds(optimizer: Any) -> tuple[int, int, int | None]:
    """Ranks with the same answer hold the same state: the first rank of the data-parallel group, the experts
    (with expert parallelism the data-parallel ranks hold different experts), and with the distributed optimizer
    the place in the optimizer instance (the shard of the parameter state)."""
    import torch.distributed as dist

    mpu = megatron("core.parallel_state")
    members = dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True))
    return min(members), mpu.get_expert_model_parallel_rank(), instance_place(optimizer)


def step_samples(consumed: int) -> int:
    """The samples of the step that brought the run to ``consumed`` samples: the global batch, or under
    ``--rampup-batch-size`` (from megatron-core 0.19 ``--step-batch-size-schedule``) the batch Megatron's
    calculator gives at the step's start (``c`` with ``c + batch(c) == consumed``: one, as the batch never
    shrinks, so no larger than the batch at ``consumed``; a schedule's batches can exceed ``--global-batch-size``,
    which Megatron then sets to one micro-batch per data-parallel rank)."""
    calculator = megatron("core.num_microbatches_calculator")
    given = megatron("training.global_vars").get_args().global_batch_size
    try:
        calculator.update_num_microbatches(consumed, consistency_check=False)
        largest = max(calculator.get_current_global_batch_size(), given)
        for batch in range(1, min(consumed, largest) + 1):
            calculator.update_num_microbatches(consumed - batch, consistency_check=False)
            if calculator.get_current_global_batch_size() == batch:
                return batch
    finally:
        calculator.update_num_microbatches(consumed, consistency_check=False)
    raise ValueError(f"no step of this run's batch sizes ends at {consumed} consumed samples")


def state_at(model: Any, optimizer: Any, scheduler: Any, iteration: int, rng: Any, consumed: int,
             flops: float) -> dict[str, Any]:
    """What a save at ``iteration`` holds."""
    state = saved_state(model, optimizer, scheduler, iteration, rng, consumed)
    state["num_floating_point_operations_so_far"] = flops
    shards = [member.get_parameter_state_dp_reshardable() for member in sharded_optimizers(optimizer)]
    if shards:
        state[PARAMETER_STATE] = {"place": instance_place(optimizer), "shards": shards}
    return state


@contextmanager
def without_load(who: str) -> Iterator[None]:
    """Megatron's ``--load`` / ``--pretrained-checkpoint`` ignored meanwhile: ``who``'s state comes from a peer."""
    megatron_args = megatron("training.global_vars").get_args()
    kept = megatron_args.load, getattr(megatron_args, "pretrained_checkpoint", None)
    if any(kept):
        log.warning("recover: %s: --load ignored, the state comes from a peer", who)
    megatron_args.load = megatron_args.pretrained_checkpoint = None
    try:
        yield
    finally:
        megatron_args.load, megatron_args.pretrained_checkpoint = kept


def send(state: dict[str, Any], receivers: tuple[int, ...], group: Any) -> int:
    """Send ``state`` to each receiver (global ranks) over ``group``; returns the bytes sent to each."""
    import torch
    import torch.distributed as dist

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)  # the bytes saved, sent as they are
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for receiver in receivers:
        dist.send(size, receiver, group=group)
        dist.send(payload, receiver, group=group)
    return payload.numel()


def receive(source: int, group: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, source, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, source, group=group)
    # a peer's bytes are read as Megatron reads a checkpoint: tensors and the types megatron-core registers as safe,
    # never an arbitrary object a pickle names
    with torch.serialization.safe_globals(_saved_types()):
        return torch.load(io.BufferedReader(_Reading(memoryview(payload.numpy()))), map_location="cpu",
                          weights_only=True)


def _saved_types() -> list[Any]:
    """The types besides tensors that a save's state holds (its arguments, their enums, numpy's RNG state): those
    megatron-core registers with torch as safe since 0.13 (``megatron.core.safe_globals``), named here for the
    releases before it, which register none."""
    import argparse

    import numpy

    found = [argparse.Namespace, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32)),
             numpy.zeros(1).__reduce__()[0]]  # numpy's _reconstruct, in whichever module this numpy keeps it
    for module, name in (("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "AttnBackend"),
                         ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
                         ("megatron.core.rerun_state_machine", "RerunMode"),
                         ("megatron.core.rerun_state_machine", "RerunState")):
        found += filter(None, [getattr(optional_megatron(module.removeprefix("megatron.")), name, None)])
    return found


class _Reading(io.RawIOBase):
    """A file read from bytes already in memory, in place: ``io.BytesIO`` holds a copy of its own, and a state
    received whole would then be held three times at once (the bytes, the copy, the tensors loaded)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self.data, self.at = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), len(self.data) - self.at))
        target[:count] = self.data[self.at:self.at + count]
        self.at += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.at = offset + (0, self.at, len(self.data))[whence]
        return self.at

    def tell(self) -> int:
        return self.at


def apply(state: dict[str, Any], model: Any, optimizer: Any, scheduler: Any) -> None:
    """Load ``state`` into the live objects, as Megatron's ``load_checkpoint`` does."""
    chunks = unwrap_model(model)
    for index, chunk in enumerate(chunks):
        chunk.load_state_dict(state["model"] if len(chunks) == 1 else state[f"model{index}"], strict=False)
    # the fp32 main parameters and the loss scaler come with the optimizer's state, exact; reloading the main parameters
    # from the 16-bit model afterwards would round them (Megatron's load does that only without optimizer state)
    optimizer.load_state_dict(state["optimizer"])
    sharded, place = state.get(PARAMETER_STATE, {"place": None, "shards": ()}), instance_place(optimizer)
    if sharded["place"] != place:
        raise ValueError(f"the optimizer shard received is place {sharded['place']} of its optimizer instance, "
                         f"this rank holds place {place}")
    for member, shard in zip(sharded_optimizers(optimizer), sharded["shards"]):
        for bucket in (bucket for dtypes in _buffers(shard) for buckets in dtypes.values() for bucket in buckets):
            for entry in bucket:
                entry.setdefault("padding", False)  # what megatron's loader asks of each entry
        member.load_parameter_state_from_dp_reshardable(shard)  # main parameters (exact) and moments
    scheduler.load_state_dict(state["opt_param_scheduler"])
    set_rng(state["rng_state"])


def _buffers(shard: dict[Any, Any]) -> list[dict[Any, Any]]:
    """The per-buffer parts of ``get_parameter_state_dp_reshardable`` (integer keys; the rest is sizes)."""
    return [value for key, value in shard.items() if isinstance(key, int)]


def set_rng(rng_state: Any) -> None:
    """Megatron's ``get_rng_state`` list (this rank's entry first) put back into every generator."""
    import numpy as np
    import torch

    tensor_parallel = megatron("core.tensor_parallel")
    rng = rng_state[0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = rng["rng_tracker_states"]
    # graph-safe trackers (megatron-core 0.16 on) keep their states in another form; earlier releases have neither
    convert = getattr(tensor_parallel, "convert_cuda_rng_state", None)
    graph_safe = getattr(tensor_parallel, "is_graph_safe_cuda_rng_tracker", None)
    if convert is not None and graph_safe is not None:
        graphable = graph_safe(tracker)
        states = {name: convert(value, to_graphable=graphable) for name, value in states.items()}
    tracker.set_states(states)


class Batches:
    """The training data iterator, with the batches of the running step kept to be read again."""

    def __init__(self, source: Iterator[Any] | None) -> None:
        self.source = source
        self.fetched: list[Any] = []
        self.replay: list[Any] = []

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Any:
        item = self.replay.pop(0) if self.replay else next(self.source)
        self.fetched.append(item)
        return item

    def begin_step(self) -> None:
        self.fetched = []

    def rewind(self) -> None:
        """The step runs again: it reads what it read before."""
        self.replay, self.fetched = self.fetched + self.replay, []

    def finish(self, per_step: int) -> None:
        """The step counts as done (a peer completed it): read past the rest of its batches."""
        self.skip(per_step - len(self.fetched))
        self.fetched = []

    def skip(self, count: int) -> None:
        if self.source is None:  # a pipeline stage that reads no data (neither the first nor the last)
            return
        for _ in range(count):
            next(self.source)


class Chunks:
    """Virtual pipeline stages: one data iterator per model chunk, each kept and read again like one
    :class:`Batches` (a chunk whose forward reads no data only has its unread batches skipped)."""

    def __init__(self, members: list[Batches]) -> None:
        self.members = members

    def begin_step(self) -> None:
        for member in self.members:
            member.begin_step()

    def rewind(self) -> None:
        for member in self.members:
            member.rewind()

    def finish(self, per_step: int) -> None:
        for member in self.members:
            member.finish(per_step)

    def skip(self, count: int) -> None:
        for member in self.members:
            member.skip(count)


def kept(iterator: Any, held: Batches | Chunks | None = None) -> tuple[Batches | Chunks, Any]:
    """``train``'s data iterator read through :class:`Batches` (one per model chunk with virtual pipeline
    stages), and what ``train`` is to be given instead: megatron's ``RerunDataIterator`` is kept, reading
    through ours. ``held``: what an earlier call returned for the same iterator (MindIO calls ``train`` again
    on the same objects), reused with the batches it keeps."""
    if isinstance(iterator, list):
        earlier = held.members if isinstance(held, Chunks) else [None] * len(iterator)
        members = [kept(member, before) for member, before in zip(iterator, earlier)]
        return Chunks([batches for batches, _ in members]), [given for _, given in members]
    if isinstance(iterator, Batches):
        return iterator, iterator
    if hasattr(iterator, "iterable"):
        if not isinstance(iterator.iterable, Batches):
            iterator.iterable = Batches(iterator.iterable)
        return iterator.iterable, iterator
    if isinstance(held, Batches) and held.source is iterator:
        return held, held
    batches = Batches(iterator)
    return batches, batches
