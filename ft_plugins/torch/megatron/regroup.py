"""Megatron's communication groups torn down and built again in place, for ``recover``.

Two states besides the ordinary one. *Holding*: every group of a lost world destroyed (in a helper
thread, with a time bound: a gloo group cannot be aborted), and the same layout rebuilt on torch's
``fake`` backend, whose collectives return at once: Megatron's rank getters and ``ttp``'s dump keep
working, nothing waits on a dead peer. A replacement starts in this state too, until it has joined.
*Joined*: the real backend again, on a store prefix of the new generation, and Megatron's
``initialize_model_parallel`` called with the arguments it was first given, so the groups are exactly
the ones Megatron built; every reference the model, its DDP buckets, the optimizer and the model
config hold to an old group is pointed at its successor (matched by Megatron's name for it).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import zlib
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator

from ft_plugins.config import ROUND_VAR
from ft_plugins.patching import Patch
from ft_plugins.torch.abort import blocks
from ft_plugins.torch.megatron.state import megatron

log = logging.getLogger("ft_plugins.recover")

DESTROY_BOUND = 10.0  # seconds; measured: destroying a broken gloo group takes <= 30 ms
MEETING_BOUND = 10.0  # seconds the members of a held group wait for one another before they meet in a real one
DEFAULT = "<default>"
_DESCEND = ("megatron", "mindspeed", "ft_plugins", "torch.nn")


def megatron_roots(objects: tuple[Any, Any, Any]) -> tuple[Any, ...]:
    """What holds process groups, from ``setup_model_and_optimizer``'s (model, optimizer, scheduler): the model
    chunks (DDP, its buckets), the optimizer, the model config."""
    model, optimizer, _ = objects
    return model, optimizer, megatron("core.utils").get_model_config(model[0])


def require_successors(stale: list[str], error: type[Exception]) -> None:
    """Raise ``error`` when a rebuild left references to old groups (``hold``'s and ``join``'s answer)."""
    if stale:
        raise error(f"process groups without a successor still held: {', '.join(stale[:3])}")


def _parallel_state() -> Any:
    return sys.modules["megatron.core.parallel_state"]


def named_groups() -> dict[str, Any]:
    """Every group Megatron's parallel state holds, by its global's name (list entries as ``NAME[i]``),
    and the default group."""
    import torch.distributed as dist

    found: dict[str, Any] = {}
    if dist.is_initialized():
        found[DEFAULT] = dist.distributed_c10d._get_default_group()
    for name, value in vars(_parallel_state()).items():
        if not name.startswith("_") or name == "_global_process_group_list":
            continue
        if isinstance(value, dist.ProcessGroup):
            found[name] = value
        elif isinstance(value, (list, tuple)):
            found.update((f"{name}[{index}]", item) for index, item in enumerate(value)
                         if isinstance(item, dist.ProcessGroup))
    return found


class Regroup:
    """Records how Megatron built its groups, and builds them again (holding, or joined)."""

    _unbuilt = False  # this process's groups are destroyed and not built again yet (one regroup at a time)
    _tended = False  # real groups were recorded: the main thread may shut them down or rebuild them at any moment
    _lock = threading.Lock()  # a shutdown or rebuild of the groups, or a dump's own groups in use: one at a time

    def __init__(self) -> None:
        self.layout: tuple[tuple, dict] | None = None  # initialize_model_parallel's arguments
        self.backend = "gloo"
        self.timeout = timedelta(minutes=10)
        self.fake = False  # new groups are made on the fake backend
        self.sockets: set[str] = set()  # the real groups' connections (/proc/self/fd link names)

    def patches(self) -> tuple[Patch, ...]:
        """Where Megatron's groups are made: recorded (layout, connections), or held on the fake backend."""
        return (Patch("torch.distributed.distributed_c10d", "init_process_group", self.init_process_group),
                Patch("torch.distributed.distributed_c10d", "new_group", self.new_group),
                Patch("megatron.core.parallel_state", "initialize_model_parallel", self.initialize_model_parallel))

    # -- hooks (wrapt signature) -------------------------------------------------------------------
    def initialize_model_parallel(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.layout is None:
            self.layout = (args, dict(kwargs))
        return wrapped(*args, **kwargs)

    def init_process_group(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        if backend and backend != "fake":  # the framework's own choice, not a holding state's
            self.backend, self.timeout = backend, kwargs.get("timeout") or self.timeout
        if self.fake:  # a replacement before it joined: collectives held
            kwargs = {**kwargs, "backend": "fake", "store": kwargs.get("store") or _hash_store()}
            return wrapped(**{k: v for k, v in kwargs.items() if k != "device_id"})
        rendezvous = int(os.environ.get(ROUND_VAR, "0") or 0)
        if rendezvous and kwargs.get("store") is None and len(args) < 2 and kwargs.get("world_size", -1) > 0:
            kwargs = {**kwargs, "store": _round_store(rendezvous, kwargs["rank"], kwargs["world_size"],
                                                      kwargs.get("timeout") or self.timeout)}
        return self._recording(wrapped, args, kwargs, default=True)

    def new_group(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.fake:
            return wrapped(*args, **{**kwargs, "backend": "fake", "pg_options": None})
        return self._recording(wrapped, args, kwargs)

    def _recording(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict, default: bool = False) -> Any:
        """Create a real group, remembering the connections it opened: a gloo group's, which a shutdown ends. Those of
        a backend that blocks (NCCL, HCCL) are its own, never shut down under it: an abort releases its waits; and
        the ``default`` group's store's (:func:`_store_connections`)."""
        import torch.distributed as dist

        Regroup._tended = True
        before = _sockets()
        group = wrapped(*args, **kwargs)
        try:
            blocking = blocks(str(dist.get_backend(group)))
        except Exception:  # not a member of it: no connection of its own
            blocking = False
        if not blocking:
            self.sockets |= _sockets() - before - (_store_connections() if default else set())
        return group

    def interrupt(self) -> None:
        """Shut this process's group connections down: a collective pending in another thread fails now (a
        dump's meeting in groups of its own ends first: the dump then ends the process)."""
        with Regroup._lock:
            _shut_down(self.sockets)

    # -- the two states ----------------------------------------------------------------------------
    def hold(self, rank: int, world: int, store: Any, roots: Iterable[Any]) -> list[str]:
        """Hold: the same layout on the fake backend; ``store`` stays the default group's store (``ttp``'s
        writer claims go through it)."""
        return self._rebuild(rank, world, "fake", store, roots)

    def join(self, rank: int, world: int, store: Any, roots: Iterable[Any]) -> list[str]:
        """Join: the real groups on ``store``."""
        return self._rebuild(rank, world, self.backend, store, roots)

    @staticmethod
    def holding() -> bool:
        import torch.distributed as dist

        return dist.is_initialized() and dist.get_backend() == "fake"

    @staticmethod
    def rebuilding() -> bool:
        """Whether this process's groups are torn down and not built again yet (a dump in another thread can
        then name no shard of its own: Megatron's parallel state is partly or not at all there)."""
        return Regroup._unbuilt

    def _rebuild(self, rank: int, world: int, backend: str, store: Any, roots: Iterable[Any]) -> list[str]:
        """Destroy every group (bounded), build them again on ``backend`` and point ``roots`` at the new
        ones; returns where a dead group without a successor is still held (empty when complete). No
        reference to an old group may stay: a gloo group's sockets close only when its last one goes,
        and until then a peer blocked in a collective with this rank waits for its full timeout. Groups on
        the fake backend hold no connection: leaving them (a join) needs no collection, which took 0.2 to
        0.7 s of the repair's critical path with megatron imported."""
        real = not self.holding()
        old = named_groups()
        links = self.sockets
        with Regroup._lock:
            Regroup._unbuilt = True
            self._destroy()
            self._build(rank, world, backend, store)
            Regroup._unbuilt = False  # a build that failed leaves the groups unbuilt
        current = named_groups()
        successors = {id(group): current[name] for name, group in old.items() if name in current}
        stale = repoint(roots, successors, {id(group) for group in current.values()})
        del old, successors
        if real:
            _release(links)
        return stale

    def _destroy(self) -> None:
        """Shut the old groups' connections down, then destroy them. A forked child (a data loader worker)
        holds a copy of every socket open at its fork, so closing ours would not tell a peer blocked in a
        collective with this rank: shutting the connection down does."""
        import torch.distributed as dist

        _shut_down(self.sockets)
        self.sockets = set()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may refuse; the registry is cleared regardless
                log.info("recover: destroying the old groups: %s: %s", type(exc).__name__, exc)

        helper = threading.Thread(target=destroy, name="ft_plugins-recover-destroy", daemon=True)
        helper.start()
        helper.join(DESTROY_BOUND)
        if helper.is_alive():
            raise TimeoutError(f"destroying the old process groups took over {DESTROY_BOUND:.0f} s")
        _parallel_state().destroy_model_parallel()

    def _build(self, rank: int, world: int, backend: str, store: Any) -> None:
        import torch.distributed as dist

        if self.layout is None:
            raise RuntimeError("megatron's initialize_model_parallel was never seen")
        self.fake = backend == "fake"
        try:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=self.timeout)
            args, kwargs = self.layout
            _parallel_state().initialize_model_parallel(*args, **kwargs)
        finally:
            self.fake = False


@contextmanager
def real_twins(groups: list[Any], key: str, bound: float = MEETING_BOUND) -> Iterator[list[Any]]:
    """``groups`` themselves where nothing else touches them; where ``recover`` tends them (the main thread may
    shut them down, hold or rebuild them at any moment) or holds them on the fake backend, real gloo groups of
    the same members instead, met on the store (destroyed on exit), in the same order. So every member of a
    group decides alike, whether or not its own main thread already shut its connections down (a peer lost),
    and a shutdown or rebuild waits until the block ends. A held group's collectives return at once and its
    gather hands every slot the caller's own tensor, so what is gathered there (a dump's optimizer state) would
    be the caller's shard repeated. Every member calls this with the same groups in the same order and ``key``;
    a member that does not come within ``bound`` (it is lost) makes it raise, naming it."""
    import torch.distributed as dist

    if not (Regroup._tended or Regroup.holding()):
        yield groups
        return
    if not Regroup._lock.acquire(timeout=bound):
        raise TimeoutError(f"this process's groups were being built again for over {bound:.0f} s")
    store = dist.distributed_c10d._get_default_store()
    twins: dict[int, Any] = {}
    try:
        for group in groups:
            if id(group) not in twins:
                twins[id(group)] = _meet(dist.get_process_group_ranks(group), store, key, bound)
        yield [twins[id(group)] for group in groups]
    finally:
        for twin in twins.values():
            dist.destroy_process_group(twin)
        Regroup._lock.release()


def _meet(members: list[int], store: Any, key: str, bound: float) -> Any:
    """A real gloo group of ``members``, once each has said on ``store`` that it is here. Its name is the same on
    every member by construction (torch names a group by how many the caller made before, which differs once
    ranks were members of different groups), and differs between member sets, so each group's connections
    meet on keys of its own."""
    import torch.distributed as dist

    meeting = f"{key}/{'-'.join(map(str, members))}"
    store.set(f"{meeting}/{dist.get_rank()}", b"")
    try:
        store.wait([f"{meeting}/{member}" for member in members], timedelta(seconds=bound))
    except Exception:
        absent = [member for member in members if not store.check([f"{meeting}/{member}"])]
        raise TimeoutError(f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} of {members} "
                           f"did not come within {bound:.0f} s") from None
    world = dist.distributed_c10d._world
    counted, world.group_count = world.group_count, 1_000_000 + zlib.crc32(meeting.encode())
    try:
        return dist.new_group(members, backend="gloo")
    finally:
        world.group_count = counted


def _sockets() -> set[str]:
    """This process's open sockets (``socket:[inode]``)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def _store_connections() -> set[str]:
    """The connections of the default group's store, opened by ``init_process_group`` with the group's own: never shut
    down with them, for a dump meets groups of its own on that store (a shutdown's broken pipe had left MindIO's
    dump, after its stop, with no shard written). Those to its address, and those its server accepted where it
    listens in this process; not another host's connection that merely shares the port number."""
    import socket

    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default group
        return set()
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    port, host = getattr(store, "port", None), getattr(store, "host", None)
    if not port or not host:
        return set()
    try:
        addresses = {_ip(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        addresses = set()
    rows, mine = _tcp_rows(), _sockets()
    listening = any(local[1] == port and state == _LISTEN and inode in mine for local, _, state, inode in rows)
    return {inode for local, remote, _, inode in rows
            if (remote[1] == port and remote[0] in addresses) or (listening and local[1] == port)}


_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _ip(text: str) -> Any:
    """An address as :mod:`ipaddress` has it, an IPv4-mapped IPv6 one as its IPv4 (``%scope`` dropped)."""
    import ipaddress

    address = ipaddress.ip_address(text.split("%", 1)[0])
    return getattr(address, "ipv4_mapped", None) or address


def _tcp_rows() -> list[tuple[tuple[Any, int], tuple[Any, int], str, str]]:
    """This network namespace's TCP sockets: (local (ip, port), remote (ip, port), state, ``socket:[inode]``)."""
    import socket

    def endpoint(field: str) -> tuple[Any, int]:
        address, port = field.rsplit(":", 1)
        raw = bytes.fromhex(address)  # in 32-bit words of the host's order (little-endian here)
        packed = b"".join(raw[index:index + 4][::-1] for index in range(0, len(raw), 4))
        return _ip(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, packed)), int(port, 16)

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:  # sl local_address rem_address st ... inode
                    fields = row.split()
                    found.append((endpoint(fields[1]), endpoint(fields[2]), fields[3], f"socket:[{fields[9]}]"))
        except OSError:
            continue
    return found


def _release(links: set[str]) -> None:
    """Collect what still holds the dead groups' connections: the young generations first (what the failed
    step left in cycles, ~1 ms), every generation only if one of ``links`` is still open then. A full
    collection traverses every object torch and megatron made (0.2 s per rank with 400,000), and on the
    survivors it ran while the replacement, on the same cores, set itself up."""
    gc.collect(1)
    if links & _sockets():
        gc.collect()


def _shut_down(links: set[str]) -> None:
    """``shutdown(SHUT_RDWR)`` on every still open connection among ``links`` (on a duplicate: the
    connection, shared with every copy, ends); listening sockets are left to the group's destruction."""
    import socket

    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") not in links:
                continue
            with socket.socket(fileno=os.dup(int(fd))) as connection:
                if not connection.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # never a listener
                    connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue


def _round_store(rendezvous: int, rank: int, world: int, timeout: timedelta) -> Any:
    """torchrun's store for the workers, under a prefix of their rendezvous round. torch names the workers' keys by
    the restart count alone, which a change of nodes (``--nnodes MIN:MAX``) keeps: the workers of a later round
    would read the peer addresses an earlier round's left, and gloo connect to processes that are gone."""
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import rendezvous as env_rendezvous

    store, _, _ = next(env_rendezvous("env://", rank, world, timeout=timeout))
    return PrefixStore(f"round_{rendezvous}/", store)


def _hash_store() -> Any:
    """An in-process store: the fake backend needs one and never talks to it."""
    from torch.distributed import HashStore

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the fake backend, as megatron does)

    return HashStore()


def repoint(roots: Iterable[Any], successors: dict[int, Any], live: set[int]) -> list[str]:
    """Replace, in ``roots`` and what they hold (modules, megatron objects, lists, dicts), every process
    group found in ``successors`` (by id) by its successor; returns where a dead group without one remains."""
    import torch
    import torch.distributed as dist

    stale: list[str] = []
    seen: set[int] = set()
    stack = [(root, type(root).__name__) for root in roots]
    while stack:
        obj, where = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            items, setter = list(obj.items()), obj.__setitem__
        elif isinstance(obj, list):
            items, setter = list(enumerate(obj)), obj.__setitem__
        elif hasattr(obj, "__dict__") and (type(obj).__module__.startswith(_DESCEND)
                                           or isinstance(obj, torch.nn.Module)):
            items, setter = list(vars(obj).items()), vars(obj).__setitem__
        else:
            continue
        for name, value in items:
            if isinstance(value, dist.ProcessGroup):
                if id(value) in successors:
                    setter(name, successors[id(value)])
                elif id(value) not in live:
                    stale.append(f"{where}.{name}")
            elif isinstance(value, tuple) and any(isinstance(item, dist.ProcessGroup) for item in value):
                setter(name, tuple(successors.get(id(item), item) for item in value))
            elif isinstance(value, (dict, list)) or hasattr(value, "__dict__"):
                stack.append((value, f"{where}.{name}"))
    return stale

