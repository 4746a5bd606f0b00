"""``hangs`` across nodes: what one launcher's ranks entered, told to the launchers of the other nodes.

A launcher sees only its own ranks. On NCCL or HCCL, ranks that wait for a rank hung on another node wait at a host
sync, outside any collective's frame, and their counts match each other's (:func:`.stalls.ahead`): seen from their
node alone they are ranks stopped outside collectives. So while some of its ranks stand still, each launcher
publishes, per process group, the fewest collectives one of its ranks entered, in the job's rendezvous store (at
most once a second), and empties it once they move again; a launcher judging its ranks reads the others'
entries, each as fresh as ``FRESH`` seconds, and a rank of its own that entered more than a rank elsewhere waits
for it. One store round trip or two per other node, at a judgement only.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

PREFIX = "ft_plugins/hangs/fewest/"
REPUBLISH = 1.0  # seconds between two publications of the same node while its ranks stand still
FRESH = 10.0  # seconds an entry counts for (a launcher gone leaves one behind)


class NodeCounts:
    """This node's entry in the rendezvous ``store`` (a torch ``Store``), and the other ``nodes``' entries."""

    def __init__(self, store: Any, node: int, nodes: int) -> None:
        self.store, self.node, self.nodes = store, node, nodes
        self._published = 0.0  # when this node last published (0: its entry is withdrawn)

    def publish(self, fewest: Mapping[int, int]) -> None:
        """This node's ranks stand still: per group key, the fewest collectives one of them entered."""
        now = time.time()
        if now - self._published >= REPUBLISH:
            self.store.set(f"{PREFIX}{self.node}", json.dumps({"at": now, "fewest": fewest}))
            self._published = now

    def withdraw(self) -> None:
        """This node's ranks move again: its entry is emptied (never deleted: a reader that found it there may get
        it, where a get of a key gone would wait for the store's timeout)."""
        if self._published:
            self.store.set(f"{PREFIX}{self.node}", json.dumps({"at": time.time(), "fewest": {}}))
            self._published = 0.0

    def elsewhere(self) -> dict[int, int]:
        """Per group key, the fewest collectives a rank of another node entered, by their fresh entries."""
        fewest: dict[int, int] = {}
        now = time.time()
        for node in range(self.nodes):
            key = f"{PREFIX}{node}"
            if node == self.node or not self.store.check([key]):
                continue
            entry = json.loads(self.store.get(key))
            if now - entry["at"] > FRESH:
                continue
            for group, count in entry["fewest"].items():
                fewest[int(group)] = min(count, fewest.get(int(group), count))
        return fewest
