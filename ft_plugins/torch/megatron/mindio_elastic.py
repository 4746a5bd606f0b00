"""MindCluster's ``elastic-training`` strategy through MindIO's ZIT handlers, as :mod:`.elastic` is the built-in
scale-in: ``recover``'s MindIO handlers (:mod:`.mindio_recover`) plus the scale-in MindIO asks for.

When ClusterD finds no replacement for a lost rank within the job's ``wait-reschedule-timeout``, it sends
``changeStrategy downgrade``; MindIO's controller isolates every rank of the model replicas that lost one (their
healthy ranks end through ClusterD's ``faultNodesExit``) and, after its ``stop`` and ``clean``, calls the downgrade
rebuild handler ``(new_dp_ranks, new_world_ranks, train_args, params)`` on each rank that goes on, then lets
training go on: MindIO has no rollback after a downgrade. So the handler does what Megatron's own resume at the
smaller size from a save of the last completed step K does, with :class:`.elastic.Resize` as the built-in scale-in
does it: the ranks that go on are numbered in their order (the i-th smallest old rank becomes rank i), Megatron's
groups are built for them, the gradient buffers, the distributed optimizer's shards and the micro-batch calculator
are laid out for the new size, every rank stands at K, and the data iterators are built again at K's samples.

Refused in one line (MindIO then takes its dump): a run :func:`.elastic.unscalable` names, a global batch the new
size does not divide (without Megatron's ``--decrease-batch-size-if-needed``), ranks that do not all hold one
completed step (a fault in the optimizer update: a downgrade hands no state over) or that are not whole model
replicas, a second scale-in or a repair in place after one (MindIO's own rules then offer only the dump, which
takes this rank and size as the groups stand: :func:`.mindio_recover.placement`), and MindIO's scale-out
("upgrade"): growing back is a restart, from the dump. Each of these is decided alike on every rank before anything
changed; a failure after the groups were built again (none is known) leaves MindIO's dump the last save.
A MindIO without ZIT (:func:`ft_plugins.vendors.mindio.zit_lacking`) keeps ``recover``'s handlers and its dump.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from ft_plugins import progress
from ft_plugins.features.elastic import Elastic
from ft_plugins.features.recover import Recover
from ft_plugins.patching import Patch
from ft_plugins.rank import on_rank_zero
from ft_plugins.recovery import NODES, REFUSED, await_keys, key
from ft_plugins.torch.megatron.elastic import Resize, model_replica
from ft_plugins.torch.megatron.mindio_recover import MindioRecovery, Refused, placement
from ft_plugins.torch.megatron.regroup import megatron_roots, require_successors
from ft_plugins.torch.megatron.state import megatron_args

log = logging.getLogger("ft_plugins.elastic")

GROWING = ("growing back in place (MindIO's upgrade) is not implemented: the job grows back by a restart from the "
           "dump (torchrun --nnodes MIN:MAX, or MindCluster's rescheduling)")


class MindioElastic(MindioRecovery):
    """MindIO's recovery handlers and its ZIT handlers of one worker."""

    ZIT = True

    def __init__(self, feature: Recover, ttp: Any, elastic: Elastic) -> None:
        super().__init__(feature, ttp)
        self.elastic = elastic
        self.resize = Resize()
        self.downgrades = 0
        self.lacking = ""  # what of ZIT this MindIO lacks (then recover's handlers and the dump only)
        self.replica: tuple[int, ...] = ()  # the global ranks of this rank's model replica
        self.report_layout: Callable[[list[int]], None] = ttp.mindio.report_layout  # the groups, to MindIO

    def without_zit(self, lacking: str) -> None:
        """This MindIO has no ZIT: recover's handlers and its dump stay; a lost rank with no replacement takes
        the dump."""
        self.lacking = lacking
        on_rank_zero(log.warning, "elastic: the installed MindIO lacks %s (MindCluster's elastic-training): a "
                     "lost rank with no replacement takes MindIO's dump; install a MindIO with ZIT", lacking)

    def patches(self) -> tuple[Patch, ...]:
        return (*super().patches(), *self.resize.patches())

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {**super().handlers(), "zit_downgrade_rebuild": self.downgrade_rebuild,
                "zit_upgrade_rebuild": self.upgrade_rebuild, "zit_upgrade_repair": self.upgrade_repair,
                "zit_upgrade_rollback": self.upgrade_rollback}

    def train(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if not self.lacking:
            args, kwargs = self.resize.begin(args, kwargs, "a lost rank MindCluster does not reschedule (its "
                                             "downgrade)", "MindIO's dump")
            self.replica = () if self.resize.cannot else model_replica()
        return super().train(wrapped, instance, args, kwargs)

    # -- MindIO's ZIT handlers ---------------------------------------------------------------------
    def downgrade_rebuild(self, new_dp_ranks: list[int], new_world_ranks: list[int], train_args: Any,
                          params: Any) -> None:
        self._guard("zit_downgrade_rebuild", self._downgrade, sorted(set(new_world_ranks)))

    def upgrade_rebuild(self, rank_list: list[int], train_args: Any, params: Any) -> None:
        self._grow("zit_upgrade_rebuild")

    def upgrade_repair(self, step: int, need_rebuild: bool, error_ranks: list[int], repair_info: dict[str, Any],
                       train_args: Any, params: Any) -> None:
        self._grow("zit_upgrade_repair")

    def upgrade_rollback(self, step: int, train_args: Any, params: Any) -> None:
        self._grow("zit_upgrade_rollback")

    # -- what they do ------------------------------------------------------------------------------
    def _rebuild(self, fault_ranks: list[int]) -> None:
        if self.downgrades:  # MindIO's own rules after a downgrade: its dump, and the exit
            raise Refused("a repair in place after a scale-in: the job's ranks are no longer those MindIO started")
        super()._rebuild(fault_ranks)

    def _downgrade(self, going: list[int]) -> None:
        """Go on with the ranks ``going`` (old numbering, sorted), every one at the step all of them completed last.
        What every rank can refuse alike is refused before anything changed; the size is set once they agreed."""
        from torch.distributed import PrefixStore

        rank, world = placement()
        parsed = megatron_args()
        if self.resize.cannot:
            raise Refused(f"this run cannot go on at a smaller data-parallel size: {self.resize.cannot}")
        if self.downgrades:
            raise Refused("a second scale-in: after a downgrade MindCluster's own rules allow only the dump")
        if rank not in going:
            raise Refused(f"rank {rank} is not among the ranks MindIO keeps ({', '.join(map(str, going))})")
        replica = world // parsed.data_parallel_size  # the ranks of one model replica
        if len(going) % replica:
            raise Refused(f"MindIO keeps {len(going)} ranks, not whole model replicas of {replica}")
        store = PrefixStore("mindio/downgrade/", self._launcher_store())  # the keys of this set of workers
        generation = store.add(f"count/{rank}", 1)  # every rank that goes on counts alike
        completed = self.mine[0] if self.mine is not None else -1
        store.set(key(generation, f"standing/{rank}"),
                  json.dumps([completed, int(os.environ.get("GROUP_RANK", "0")), list(self.replica)]))
        found = [json.loads(raw) for raw in await_keys(store, generation, [f"standing/{peer}" for peer in going],
                                                        "the standings of the ranks MindIO keeps",
                                                        self.feature.settings["timeout"])]
        refusal = _disagreement(going, found)  # the same on every rank: decided before anything changed
        if refusal:
            raise Refused(refusal)
        batch = self.resize.to(len(going) // replica, Refused)
        place = going.index(rank)
        try:
            require_successors(self.regroup.join(place, len(going), PrefixStore(key(generation, "world/"), store),
                                                   megatron_roots(self.objects)), Refused)
            change = self.resize.announce("MindIO's downgrade", sorted(set(range(world)) - set(going)), len(going),
                                          batch, generation, place == 0)
            self.resize.rebuilt(self.objects, self.tracker, completed, Refused)
            self.resize.resumed(self.batches, self._stand_at(completed))
        finally:
            self.resize.size = 0  # nothing half-set for a later handler: the dump takes what the groups hold
        self.downgrades += 1
        self.report_layout(going)  # MindIO numbers the ranks as it started them; its dump's ranks follow the groups
        if place == 0:  # speaks for the job
            launcher = self._launcher_store()
            launcher.set(NODES, json.dumps(sorted({node for _, node, _ in found})))  # torchrun's exit barrier's
            launcher.set(REFUSED, "the job scaled in: its ranks are no longer torchrun's")
            self.elastic.changes.append(change)
            log.warning("elastic: MindIO downgrade in %.2f s: every rank stands at step %d, training continues at "
                        "step %d", time.monotonic() - self.started, completed, completed + 1)
        self.mine = self.received = None
        progress.report(progress.STEP)

    def _grow(self, stage: str) -> None:
        self._refusal(stage, Refused(GROWING))
        raise Refused(GROWING)


def _disagreement(going: list[int], found: list[list]) -> str:
    """Why the ranks MindIO keeps cannot go on together ("" when they can), from each one's standing (its completed
    step, -1 when torn; its node; its model replica): not one completed step, or a replica not kept whole."""
    steps = sorted({step for step, _, _ in found})
    if len(steps) > 1 or steps[0] < 0:
        held = ", ".join(f"rank {peer}: {'torn' if step < 0 else f'step {step}'}"
                         for peer, (step, _, _) in zip(going, found))
        return f"the ranks MindIO keeps do not all hold one completed step ({held}): a downgrade hands no state over"
    broken = sorted({peer for _, _, replica in found for peer in replica} - set(going))
    if broken:
        return (f"MindIO keeps ranks of model replicas without rank{'s' if len(broken) > 1 else ''} "
                f"{', '.join(map(str, broken))}: only whole model replicas go on")
    return ""
