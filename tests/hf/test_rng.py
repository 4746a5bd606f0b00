"""The RNG snapshot the Trainer's dump takes every step: always what ``numpy.random.get_state()`` says, without
paying numpy's full getter when the generator did not move."""

from __future__ import annotations

import random
from typing import Callable

import numpy
import pytest
import torch

from ft_plugins.torch.hf import rng


def _same(taken: tuple, expected: tuple) -> bool:
    return (taken[0], taken[2], taken[3], taken[4]) == (expected[0], expected[2], expected[3], expected[4]) \
        and numpy.array_equal(taken[1], expected[1])


@pytest.fixture
def full_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the full getter's calls made by a NumpyState built after this fixture."""
    calls: list[int] = []
    original = numpy.random.get_state

    def counted(*args: object, **kwargs: object) -> tuple:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(numpy.random, "get_state", counted)
    numpy.random.seed(11)
    return calls


def test_every_move_of_the_generator_is_seen(full_reads: list[int]) -> None:
    take = rng.NumpyState()
    moves = [lambda: None, lambda: numpy.random.rand(3), lambda: numpy.random.standard_normal(),  # gauss cached
             lambda: numpy.random.standard_normal(),  # the cached one spent: the words do not move
             lambda: numpy.random.randint(0, 9, size=624),  # a whole twist: the position comes back round
             lambda: numpy.random.seed(11),
             lambda: numpy.random.set_state((*numpy.random.RandomState(5).get_state()[:3], 1, 0.25)),  # a resume
             lambda: numpy.random.standard_normal()]
    for move in moves:
        move()
        assert _same(take(), numpy.random.get_state())


def test_an_unmoved_generator_is_not_read_again(full_reads: list[int]) -> None:
    take = rng.NumpyState()
    assert take._address is not None, "this numpy's layout is not the one read: every snapshot pays ~100 us"
    _read_again_only_when_moved(take, full_reads, lambda: torch.rand(3), lambda: numpy.random.rand())


def _read_again_only_when_moved(take: Callable[[], tuple], reads: list[int], other: Callable[[], object],
                                own: Callable[[], object]) -> None:
    """Another generator's draws leave ``take``'s answer as it was, without a full read; its own draw does not."""
    first = take()
    before = len(reads)
    for _ in range(5):
        other()
        assert take() is first
    assert len(reads) == before
    own()
    assert take() is not first and len(reads) == before + 1


def test_a_cached_gaussian_is_read_every_time(full_reads: list[int]) -> None:
    numpy.random.standard_normal()
    take = rng.NumpyState()
    assert take()[3] == 1
    reads = len(full_reads)
    take(), take()
    assert len(full_reads) == reads + 2


def test_a_layout_other_than_the_one_read_gets_the_full_getter(monkeypatch: pytest.MonkeyPatch,
                                                                full_reads: list[int]) -> None:
    monkeypatch.setattr(rng, "_RAW_SIZE", rng._RAW_SIZE - 4)  # as if numpy had moved its position field
    take = rng.NumpyState()
    assert take._address is None
    reads = len(full_reads)
    assert _same(take(), numpy.random.get_state())
    assert len(full_reads) == reads + 2


def test_a_taken_state_is_restored_in_every_generator() -> None:
    taken = rng.RngState().take()
    expected = (numpy.random.rand(), torch.rand(1).item(), random.random())
    numpy.random.rand(5), torch.rand(5), random.random()
    rng.restore(taken)
    assert (numpy.random.rand(), torch.rand(1).item(), random.random()) == expected


@pytest.fixture
def python_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the full getter's calls made by a PythonState built after this fixture."""
    calls: list[int] = []
    original = random.getstate

    def counted() -> tuple:
        calls.append(1)
        return original()

    monkeypatch.setattr(random, "getstate", counted)
    random.seed(11)
    return calls


def test_every_move_of_pythons_generator_is_seen(python_reads: list[int]) -> None:
    take = rng.PythonState()
    moves = [lambda: None, lambda: random.random(), lambda: random.gauss(0, 1),  # a Gaussian cached
             lambda: random.gauss(0, 1),  # the cached one spent: the words do not move
             lambda: [random.getrandbits(32) for _ in range(624)],  # a whole twist: the index comes back round
             lambda: random.seed(11),
             lambda: random.setstate((*random.Random(5).getstate()[:2], 0.25)),  # a resume with a cached Gaussian
             lambda: random.gauss(0, 1)]
    for move in moves:
        move()
        assert take() == random.getstate()


def test_an_unmoved_python_generator_is_not_read_again(python_reads: list[int]) -> None:
    take = rng.PythonState()
    assert take._address is not None, "this Python's layout is not the one read: every snapshot builds 625 integers"
    _read_again_only_when_moved(take, python_reads, lambda: numpy.random.rand(), lambda: random.random())


def test_another_python_layout_gets_the_full_getter(monkeypatch: pytest.MonkeyPatch, python_reads: list[int]) -> None:
    monkeypatch.setattr(rng, "_PY_OFFSET", rng._PY_OFFSET + 4)  # as if the words were laid out elsewhere
    take = rng.PythonState()
    assert take._address is None
    reads = len(python_reads)
    assert take() == random.getstate()
    assert len(python_reads) == reads + 2
