"""The plan that moves the distributed optimizer's ranges to their places at a new data-parallel size
(:func:`ft_plugins.torch.megatron.reshard.transfers`): every needed element from exactly one holder, a rank's own
first, and a range nobody holds refused by name."""

from __future__ import annotations

import pytest

from ft_plugins.torch.megatron.reshard import Unmovable, transfers

A, B = (0, 0), (0, 1)  # two parameters of chunk 0


def test_each_needed_range_is_cut_where_its_holders_ranges_end() -> None:
    # old DP=2 halves of A (10 elements) on ranks 0 and 1; new: rank 0 needs 0..7, rank 1 needs 7..10
    held = [[(A, 0, 5)], [(A, 5, 10)]]
    needed = [[(A, 0, 7)], [(A, 7, 10)]]
    assert transfers(held, needed) == [(0, 0, (A, 0, 7), 0, 5), (1, 0, (A, 0, 7), 5, 7), (1, 1, (A, 7, 10), 7, 10)]


def test_a_rank_takes_what_it_holds_itself_before_a_lower_rank_holding_it_too() -> None:
    held = [[(A, 0, 10)], [(A, 0, 10)]]  # two instances: both hold all of A
    needed = [[(A, 0, 10)], [(A, 0, 10)]]
    assert [(source, target) for source, target, *_ in transfers(held, needed)] == [(0, 0), (1, 1)]


def test_elements_no_survivor_holds_are_refused_by_name() -> None:
    with pytest.raises(Unmovable, match=r"elements 5 to 10 of parameter \(0, 1\) have no surviving holder"):
        transfers([[(A, 0, 10), (B, 0, 5)]], [[(A, 0, 10), (B, 0, 10)]])
