"""``recover``'s exchange on torchrun's store at cluster scale, on a real TCPStore: requests counted, time measured.

One recovery generation among N ranks (1,024 and 10,240): the launcher announces the lost rank; every survivor
publishes its standing and waits for the replacement; the replacement reads every survivor's standing, then joins.
The ranks are :class:`MegatronRecovery`'s own waits and writes (``_await``, ``_standings``, the survivor's publish),
made over --connections client connections of one TCPStore server (each connection serves its ranks in turn, phase
by phase: the server sees every rank's requests, over fewer sockets than a job opens). Printed per N: the requests of
a survivor, of the replacement and in all, and the wall time of each phase as the ranks see it.

The exchange before (each rank read every other rank's standing, a look for the abandonment, a look for the key and
a read for each, polling every 20 ms while one was missing) is timed for one rank reading N − 1 standings already
there, and its requests counted for the job: 3·N·(N − 1), at the server's rate measured there.

torchrun's keep-alives on the same store: a thread on a connection of its own makes the keep-alive of torchrun's c10d
rendezvous (torch's own ``C10dRendezvousBackend``: read the state, then compare-and-set it) every --beat seconds,
for a second before each generation and all through it; printed: its median and longest round, idle and during
the exchange and the old reads, against the 5 s within which torchrun's agent must complete a keep-alive
(``RendezvousTimeout.heartbeat``; a node without one for 3 rounds of 5 s is dropped from the rendezvous).

    python benchmarks/bench_recover_store.py [--ranks 1024 10240] [--connections 32] [--beat 0.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

from torch.distributed import PrefixStore, TCPStore

os.environ.setdefault("FT_PLUGINS_LOG", "error")  # importing the glue enables ft_plugins: no start-up line here

from ft_plugins.recovery import STANDINGS, Standing, key  # noqa: E402
from ft_plugins.torch.megatron.recover import MegatronRecovery  # noqa: E402

NAMESPACE = "ft_plugins/recover/bench/0/"


class Counting:
    """A connection that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _rank(store: Any) -> MegatronRecovery:
    recovery = MegatronRecovery.__new__(MegatronRecovery)
    recovery.store = recovery.waits = store
    recovery.timeout = 600.0
    return recovery


def _phase(connections: list[Counting], ranks: list[int], work: Callable[[Counting, int], None]) -> float:
    """Seconds until every rank of ``ranks`` did ``work`` over its connection (rank i: connection i mod C)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(connections)) as pool:
        list(pool.map(lambda index: [work(connections[index], rank) for rank in ranks[index::len(connections)]],
                      range(len(connections))))
    return time.perf_counter() - started


class KeepAlive:
    """torchrun's c10d rendezvous keep-alive (read the state, compare-and-set it), every ``beat`` seconds, timed."""

    def __init__(self, port: int, beat: float) -> None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

        self.backend = C10dRendezvousBackend(TCPStore("127.0.0.1", port, is_master=False), "bench-keep-alive")
        self.beat, self.rounds = beat, []  # (when it began, seconds)
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.running.is_set():
            began = time.perf_counter()
            state, token = self.backend.get_state() or (b"", None)
            self.backend.set_state(state + b"." if len(state) < 64 else b"", token)
            self.rounds.append((began, time.perf_counter() - began))
            time.sleep(self.beat)

    def __enter__(self) -> "KeepAlive":
        self.running.set()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running.clear()
        self.thread.join()

    def during(self, start: float, end: float) -> str:
        taken = [seconds for began, seconds in self.rounds if start <= began < end]
        if not taken:
            return "no round"
        return f"{len(taken)} rounds, median {statistics.median(taken) * 1e3:.2f} ms, longest {max(taken) * 1e3:.1f} ms"


def generation(port: int, world: int, width: int, generation_number: int) -> dict[str, float]:
    connect = lambda: Counting(PrefixStore(NAMESPACE, TCPStore("127.0.0.1", port, is_master=False,  # noqa: E731
                                                                  timeout=timedelta(seconds=600))))
    launcher, replacement, connections = connect(), connect(), [connect() for _ in range(width)]
    lost = world // 2
    survivors = [rank for rank in range(world) if rank != lost]
    began_exchange = time.perf_counter()  # the connections made: the keep-alive's "during the exchange" from here
    launcher.set(key(generation_number, "lost"), str(lost))

    def publish(store: Counting, rank: int) -> None:  # what a survivor does, as MegatronRecovery._recover does it
        _rank(store)._await(generation_number, ["lost"], "the launcher's announcement")
        store.set(key(generation_number, f"state/{rank}"), Standing(7, 8, 16 * rank, 1e9).encode())
        if store.add(key(generation_number, "published"), 1) == world - 1:
            store.set(key(generation_number, STANDINGS), "ready")

    published = _phase(connections, survivors, publish)
    began = time.perf_counter()
    standings = _rank(replacement)._standings(generation_number, world)
    read = time.perf_counter() - began
    assert len(standings) == world - 1
    replacement.set(key(generation_number, "joined"), str(lost))
    joined = _phase(connections, survivors,
                    lambda store, rank: _rank(store)._await(generation_number, ["joined"], "the replacement"))
    return {"survivors' requests": sum(store.requests for store in connections),
            "replacement's requests": replacement.requests, "published s": published, "read s": read,
            "joined s": joined, "began": began_exchange}


def before(port: int, world: int, generation_number: int) -> tuple[int, float]:
    """One rank's read of every standing the way before: look for the abandonment, look for the key, read it."""
    store = Counting(PrefixStore(NAMESPACE, TCPStore("127.0.0.1", port, is_master=False)))
    began = time.perf_counter()
    for rank in range(world):
        if rank != world // 2:
            store.check([key(generation_number, "abandoned")])
            store.check([key(generation_number, f"state/{rank}")])
            store.get(key(generation_number, f"state/{rank}"))
    return store.requests, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 10240])
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--beat", type=float, default=0.05, help="seconds between keep-alives (torchrun's: 5)")
    options = parser.parse_args()
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for number, world in enumerate(options.ranks, start=1):
        with KeepAlive(server.port, options.beat) as keep_alive:
            idle = time.perf_counter()
            time.sleep(1.0)
            quiet = time.perf_counter()
            now = generation(server.port, world, options.connections, number)
            old = time.perf_counter()
            requests, seconds = before(server.port, world, number)
            done = time.perf_counter()
        rate = requests / seconds
        survivors, replacement = now["survivors' requests"], now["replacement's requests"]
        print(f"{world} ranks, {options.connections} connections:")
        print(f"  now:    {survivors / (world - 1):.1f} requests per survivor, {replacement} for the replacement, "
              f"{survivors + replacement} in all; survivors published in {now['published s']:.2f} s, the "
              f"replacement read them in {now['read s']:.3f} s, every survivor saw it join in {now['joined s']:.2f} s")
        print(f"  before: {requests} requests per rank ({seconds:.2f} s for one rank's reads, {rate:,.0f} requests/s), "
              f"{3 * world * (world - 1):,} in all: {3 * world * (world - 1) / rate:,.0f} s of the store's time at "
              "that rate")
        print(f"  torchrun's keep-alive (its deadline 5 s): idle {keep_alive.during(idle, quiet)}; during the "
              f"exchange {keep_alive.during(now['began'], old)}; during one rank's old reads "
              f"{keep_alive.during(old, done)}")


if __name__ == "__main__":
    main()
