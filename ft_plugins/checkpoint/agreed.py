"""The newest checkpoint intact on every rank, the same on all by construction, each rank checking only its own
files: for per-rank checkpoints (MindSpore's ``rank_*/*.ckpt``) on disks each rank alone sees (node-local, or an
NFS whose attribute cache differs between nodes), where every rank examining every rank's files would cost N²
reads and could still see different things.

Each round every rank gives the newest checkpoint it holds intact, at or below the smallest given in the round
before; the ranks agree when all give the same. The framework supplies ``gather`` (one all-gather of a few
integers); every rank runs the same rounds, since every rank sees the same gathered values.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ft_plugins.checkpoint.select import Search, Selection, Skipped, order

Standing = tuple[int, int, int, int]  # the order of the checkpoint a rank offers (-1s: none), and 1 if it holds any
Gather = Callable[[Standing], Sequence[Standing]]  # every rank's standing, in rank order, on every rank
NONE = (-1, -1, -1)


def agreed_latest(search: Search | None, gather: Gather, where: str) -> Selection:
    """The newest checkpoint ``search`` (this rank's own files; None: this rank has none to offer, its directory
    missing or unreadable) holds intact that every rank holds intact; ``where`` names this rank's directory. When no
    step is intact on every rank, the Selection has no path and, where some rank holds checkpoints, says why."""
    selection = search.next_intact() if search is not None else Selection(None, None, None, [])
    # a checkpoint here, intact or not (saves that never finished are none: alone, they leave a start as without)
    holds = int(selection.path is not None or any(not skipped.unfinished for skipped in selection.skipped))
    while True:
        mine = order(selection) if selection.path is not None else NONE
        offered = [tuple(standing) for standing in gather((*mine, holds))]
        lowest = min(standing[:3] for standing in offered)
        if lowest == NONE:
            return _none_everywhere(selection, offered, where)
        if all(standing[:3] == lowest for standing in offered):
            return selection
        if mine != lowest:
            selection = search.next_intact(lowest, f"intact here, but not on every rank (they agree on "
                                                   f"{_named(lowest)} or older)")


def _named(place: tuple[int, ...]) -> str:
    """A checkpoint's place as its layout counts it: the step it records, else its epoch and step."""
    iteration, epoch, step = place
    return f"step {iteration}" if iteration >= 0 else f"epoch {epoch}, step {step}"


def _none_everywhere(selection: Selection, offered: list[tuple[int, ...]], where: str) -> Selection:
    """No step intact on every rank: a first start where no rank holds a checkpoint, else a refusal that says which
    ranks hold none."""
    if not any(standing[3] for standing in offered):
        return Selection(None, None, selection.format, [])
    lacking = [rank for rank, standing in enumerate(offered) if standing[:3] == NONE]
    ranks = f"rank{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))}"
    passed = [Skipped(selection.path, "intact here, but not on every rank")] if selection.path else []
    return Selection(None, None, selection.format, [*selection.skipped, *passed, Skipped(
        where, f"no checkpoint is intact on every rank: {ranks} hold{'' if len(lacking) > 1 else 's'} no intact one "
               "the others hold")])
