"""A communication backend with NCCL's and HCCL's semantics on CPU, for the tests: a collective whose peer is lost
or silent blocks, and only ``abort()`` releases it (or the group's timeout, where NCCL's watchdog would end the
process). Registered as ``blocking`` with ``torch.distributed.Backend.register_backend`` (``sitecustomize.py`` beside
it does that in a job).

Each process's groups run gloo in one child process of its own (as torchft's "baby" process groups do): a
collective is sent to the child, which runs it on gloo and sends its tensors back. Where gloo fails (a lost peer's
connection closed) the child keeps silent, so the caller's ``wait()`` blocks, as a NCCL kernel waits on the device
for data that never comes. ``abort()`` fails every pending and later collective of the group with
``DistBackendError``, as an aborted NCCL communicator does. ``FT_FAKE_BLOCKING_ABORT=off`` makes ``abort()`` do
nothing (the negative control: a communicator that cannot be aborted).

:func:`synchronize` stands in for the device's stream: a copy of state to the host waits behind every collective
sent before it, as a device-to-host copy queued behind a blocked collective kernel does (``sitecustomize.py`` puts
torch's archive writer behind it); an abort, which fails the collectives, releases it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

NAME = "blocking"
FOLDER = os.path.dirname(os.path.abspath(__file__))
OPTIONS = ("reduceOp", "rootRank", "rootTensor", "timeout", "asyncOp")
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
SINGLE = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
          "_allgather_base": "_allgather_base", "_reduce_scatter_base": "_reduce_scatter_base"}
COALESCED = {"all_gather_single_coalesced": "_allgather_base", "allgather_into_tensor_coalesced": "_allgather_base",
             "reduce_scatter_single_coalesced": "_reduce_scatter_base",
             "reduce_scatter_tensor_coalesced": "_reduce_scatter_base"}


# -- what crosses the pipe: tensors as bytes, options as their fields --------------------------------------------
def encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        return ("list", [encode(item, tensors) for item in value])
    if type(value).__name__.endswith("Options"):
        fields = {name: getattr(value, name) for name in OPTIONS if hasattr(value, name)}
        if "reduceOp" in fields:
            fields["reduceOp"] = next(op for op in REDUCE_OPS if fields["reduceOp"] == getattr(dist.ReduceOp, op))
        fields.pop("rootTensor", None)
        return ("options", type(value).__name__, fields)
    return ("value", value)


def decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    kind = value[0]
    if kind == "tensor":
        return tensors[value[1]]
    if kind == "list":
        return [decode(item, tensors) for item in value[1]]
    if kind == "options":
        options = getattr(dist.distributed_c10d, value[1])()
        for name, field in value[2].items():
            setattr(options, name, getattr(dist.ReduceOp, field) if name == "reduceOp" else field)
        return options
    return value[1]


def pack(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = tensor.detach().contiguous().reshape(-1)
    return str(flat.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes()


def unpack(packed: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = packed
    kind = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


# -- the process's side ---------------------------------------------------------------------------------------------
class Work(dist.Work):
    """A collective sent to the child: done when its tensors came back, failed only by an abort (or the timeout)."""

    def __init__(self, group: "BlockingGroup", tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.group, self.tensors = group, tensors
        self.done = threading.Event()
        self.results: list[torch.Tensor] | None = None
        self.error: str | None = None

    def finish(self, results: list[torch.Tensor] | None, error: str | None) -> None:
        self.results, self.error = results, error
        self.done.set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        bound = (timeout if timeout.total_seconds() > 0 else self.group.timeout).total_seconds()
        if not self.done.wait(bound):
            raise dist.DistBackendError(f"{NAME}: a collective of group {self.group.gid} timed out after {bound:.0f} s")
        if self.error is not None:
            raise dist.DistBackendError(self.error)
        if self.results is not None:
            with torch.no_grad():
                for tensor, result in zip(self.tensors, self.results):
                    tensor.copy_(result)
            self.results = None
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()

        def settle() -> None:
            try:
                self.wait()
                future.set_result(self.tensors)
            except Exception as exc:
                future.set_exception(exc)

        threading.Thread(target=settle, daemon=True).start()
        return future


class Child:
    """The process's one child, which runs every group's gloo; replies are read by a thread of their own."""

    _instance: "Child | None" = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "Child":
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = Child()
            return cls._instance

    def __init__(self) -> None:
        self.pid = os.getpid()
        ours, theirs = socket.socketpair()
        code = f"import sys; sys.path.insert(0, {FOLDER!r}); import blocking_pg; blocking_pg.serve({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-I", "-c", code], pass_fds=(theirs.fileno(),),
                                        env={**os.environ, "FT_FAKE_BLOCKING": "0"})
        theirs.close()
        self.connection = Connection(ours.detach())
        self.sending = threading.Lock()
        self.pending: dict[int, Work] = {}
        self.ids = itertools.count()
        self.created: dict[int, threading.Event] = {}
        threading.Thread(target=self._read, name="blocking-backend-replies", daemon=True).start()

    def send(self, message: tuple) -> None:
        with self.sending:
            self.connection.send(message)

    def create(self, gid: int, key: str, rank: int, size: int, timeout: timedelta) -> None:
        made = self.created[gid] = threading.Event()
        self.send(("create", gid, key, rank, size, timeout.total_seconds()))
        if not made.wait(timeout.total_seconds()):
            raise dist.DistBackendError(f"{NAME}: group {gid} not made within {timeout}")

    def run(self, work: Work, gid: int, method: str, payload: Any) -> None:
        op = next(self.ids)
        self.pending[op] = work
        self.send(("run", op, gid, method, payload, [pack(tensor) for tensor in work.tensors]))

    def _read(self) -> None:
        while True:
            try:
                message = self.connection.recv()
            except (EOFError, OSError):
                return  # the child is gone: what waits keeps waiting, as on a device nobody aborts
            if message[0] == "created":
                self.created.pop(message[1]).set()
            else:
                work = self.pending.pop(message[1], None)
                if work is not None and not work.done.is_set():
                    work.finish([unpack(packed) for packed in message[2]], None)


def synchronize(what: str) -> None:
    """The stand-in device stream: wait until every collective this process sent to its child finished or failed
    (an abort fails them); past a group's timeout, where NCCL's watchdog would end the process, ``what`` fails."""
    child = Child._instance
    if child is None or child.pid != os.getpid():
        return  # no collective of this backend in this process
    for work in list(child.pending.values()):
        bound = work.group.timeout.total_seconds()
        if not work.done.wait(bound):
            raise dist.DistBackendError(f"{NAME}: {what} waited {bound:.0f} s behind a collective of group "
                                        f"{work.group.gid} that never finished")


class BlockingGroup(dist.ProcessGroup):
    """One group of the ``blocking`` backend."""

    _gids = itertools.count()

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.gid, self.timeout, self.aborted = next(self._gids), timeout, False
        if rank == 0:
            store.set("blocking_key", uuid.uuid4().hex)
        key = store.get("blocking_key").decode()
        self.works: set[Work] = set()
        self.child = Child.get()
        self.child.create(self.gid, key, rank, size, timeout)

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    def abort(self) -> None:
        """Every pending and later collective of the group fails at once (``FT_FAKE_BLOCKING_ABORT=off``: nothing)."""
        if os.environ.get("FT_FAKE_BLOCKING_ABORT") == "off":
            return
        self.aborted = True
        for work in list(self.works):
            if not work.done.is_set():
                work.finish(None, f"{NAME}: group {self.gid}'s communicator was aborted")

    def shutdown(self) -> None:
        self.abort()

    def _call(self, method: str, *args: Any) -> Work:
        tensors: list[torch.Tensor] = []
        payload = encode(list(args), tensors)
        work = Work(self, tensors)
        if self.aborted:
            work.finish(None, f"{NAME}: group {self.gid}'s communicator was aborted")
            return work
        self.works = {pending for pending in self.works if not pending.done.is_set()} | {work}
        self.child.run(work, self.gid, method, payload)
        return work

    def allreduce(self, tensors, opts=None):
        return self._call("allreduce", tensors, opts or dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._call("allreduce_coalesced", tensors, opts or dist.distributed_c10d.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        return self._call("broadcast", tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._call("allgather", outputs, inputs, opts or dist.distributed_c10d.AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._call("all_gather_single", output, input, opts or dist.distributed_c10d.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._call("all_gather_single_coalesced", outputs, inputs,
                          opts or dist.distributed_c10d.AllgatherOptions())

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, inputs, opts=None):
        return self._call("reduce_scatter", outputs, inputs, opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        return self._call("reduce_scatter_single", output, input, opts or dist.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._call("reduce_scatter_single_coalesced", outputs, inputs, opts or dist.ReduceScatterOptions())

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors, opts=None):
        return self._call("reduce", tensors, opts or dist.ReduceOptions())

    def gather(self, outputs, inputs, opts=None):
        return self._call("gather", outputs, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self._call("scatter", outputs, inputs, opts or dist.ScatterOptions())

    def alltoall(self, outputs, inputs, opts=None):
        return self._call("alltoall", outputs, inputs, opts or dist.AllToAllOptions())

    def barrier(self, opts=None):
        return self._call("barrier", opts or dist.BarrierOptions())

    def send(self, tensors, dst, tag=0):
        return self._call("send", tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._call("recv", tensors, src, tag)


def create(store: Any, rank: int, size: int, timeout: timedelta) -> BlockingGroup:
    """The creator ``register_backend`` calls for each group."""
    return BlockingGroup(store, rank, size, timeout)


def register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, devices=["cpu"])


# -- the child's side -----------------------------------------------------------------------------------------------
def serve(fd: int) -> None:
    """The child: make each group's gloo, run each collective, send its tensors back; a failed one is never
    answered. It ends with its parent (``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() == 1:
        return
    connection = Connection(fd)
    sending = threading.Lock()
    groups: dict[int, Any] = {}
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))

    def reply(message: tuple) -> None:
        with sending:
            connection.send(message)

    def finish(op: int, works: list[Any], tensors: list[torch.Tensor]) -> None:
        try:
            for work in works:
                work.wait()
        except Exception:
            return  # a lost or silent peer: the caller blocks until it aborts
        reply(("done", op, [pack(tensor) for tensor in tensors]))

    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message[0] == "create":
            _, gid, key, rank, size, seconds = message
            store = dist.PrefixStore(f"ft_fake_blocking/{key}/", client)
            groups[gid] = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=seconds))
            reply(("created", gid))
            continue
        _, op, gid, method, payload, packed = message
        tensors = [unpack(item) for item in packed]
        args = decode(payload, tensors)
        gloo = groups[gid]
        try:
            if method in COALESCED:
                outputs, inputs, opts = args
                works = [getattr(gloo, COALESCED[method])(out, inp, opts) for out, inp in zip(outputs, inputs)]
            else:
                works = [getattr(gloo, SINGLE.get(method, method))(*args)]
        except Exception:
            continue  # a group already broken: silent, as above
        threading.Thread(target=finish, args=(op, works, tensors), daemon=True).start()
