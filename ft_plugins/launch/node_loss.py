"""A node lost together with its launcher, announced to the workers by the launchers left (for ``recover``).

On gloo a survivor's collective with a lost node fails at once, and the survivor starts the repair (or, with
``elastic``, the scale-in) by itself. On NCCL and HCCL it blocks until the backend's timeout: the workers' loss watch
(:class:`ft_plugins.torch.abort.LossWatch`) aborts it on the launcher's word, and for a lost node no launcher of its
own is left to say it. torchrun's c10d rendezvous drops a node from its participants once it sent no keep-alive for
``keep_alive_interval`` x ``keep_alive_max_attempt`` (15 s by default), and each agent left sees that at its next
keep-alive. A node gone so, from the round its workers run, that did not say it finished and that the workers have
not scaled in without already (gloo's survivors do so within ``elastic``'s wait), is lost: the abort of the workers'
next generation is announced on their store (:data:`ft_plugins.recovery.ABORT`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ft_plugins.recovery import ABORT, NODES, key

log = logging.getLogger("ft_plugins.recover")

CHECK_EVERY = 1.0  # seconds between two looks at the rendezvous state the agent holds (no store request)
FINISHED = "finished/"  # + a node: it reached torchrun's exit barrier (its end is no loss)


def rendezvous_state(handler: Any) -> Any:
    """torchrun's c10d rendezvous state as this agent last synced it (None for another rendezvous)."""
    return getattr(getattr(handler, "_state_holder", None), "state", None)


class NodeLoss:
    """The nodes of the workers' round, and those of them already announced lost."""

    def __init__(self) -> None:
        self.round: int | None = None
        self.members: dict[str, int] = {}  # node -> its place in the round (torchrun's GROUP_RANK)
        self.announced: set[str] = set()
        self.checked = 0.0

    def begin(self, handler: Any) -> None:
        """Workers start (a round's rendezvous completed): its nodes are the members."""
        state = rendezvous_state(handler)
        self.round = None if state is None else state.round
        self.members = {} if state is None else {str(node): rank for node, rank in state.participants.items()}
        self.announced = set()

    def check(self, handler: Any, store: Callable[[], Any]) -> list[str]:
        """At most once a second: a member gone from the rendezvous, not finished, is announced; the nodes it
        announced now."""
        now = time.monotonic()
        if now - self.checked < CHECK_EVERY:
            return []
        self.checked = now
        state = rendezvous_state(handler)
        if state is None or getattr(state, "closed", False) or state.round != self.round:
            return []
        gone = sorted(set(self.members) - set(map(str, state.participants)) - self.announced)
        if not gone:
            return []
        connection = store()
        self.announced.update(gone)
        going_on = set(json.loads(connection.get(NODES))) if connection.check([NODES]) else set(self.members.values())
        lost = [node for node in gone if not connection.check([FINISHED + node]) and self.members[node] in going_on]
        if lost:
            generation = connection.add("generation", 0) + 1
            connection.set(key(generation, ABORT), f"node{'s' if len(lost) > 1 else ''} {', '.join(lost)} lost")
            log.warning("recover: node%s %s left torchrun's rendezvous (no keep-alive) without finishing: the "
                        "workers' communicators are aborted for generation %d (on gloo their collectives failed "
                        "already)", "s" if len(lost) > 1 else "", ", ".join(lost), generation)
        return lost

    @staticmethod
    def finished(handler: Any, store: Any) -> None:
        """This node reached torchrun's exit barrier: when it leaves the rendezvous, it is no loss."""
        node = getattr(handler, "_this_node", None)
        if node is not None:
            store.set(FINISHED + str(node), "1")
