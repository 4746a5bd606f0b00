"""The test backend with NCCL's semantics (``tests/fakes/blocking_backend``) and ft_plugins' abort on it, in real
processes (``fixtures/blocking_probe.py``): its collectives give gloo's results; a collective whose peer was lost
(SIGKILL) or is silent (SIGSTOP) blocks until ft_plugins' ``LossWatch`` reads the launcher's word of the loss and
aborts the communicators, and then fails with ``DistBackendError``. On gloo (the control) the lost peer's collective
fails by itself, with no word and no abort."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ft_plugins.torch.abort import blocks
from support import FAKES, free_port

PROBE = Path(__file__).resolve().parent / "fixtures" / "blocking_probe.py"


def _probe(backend: str, world: int) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    ranks = [subprocess.Popen([sys.executable, str(PROBE), str(FAKES / "blocking_backend"), backend],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=120)[0])
    finally:
        for process in ranks:
            process.kill()
    return [json.loads(line) for output in outputs for line in output.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def blocking() -> list[dict]:
    return _probe("blocking", 4)


@pytest.fixture(scope="module")
def gloo() -> list[dict]:
    return _probe("gloo", 3)


def _results(lines: list[dict], what: str) -> dict[int, list[dict]]:
    found: dict[int, list[dict]] = {}
    for line in lines:
        if line["what"] == what:
            found.setdefault(line["rank"], []).append(line)
    return found


@pytest.mark.parametrize("backend, world", [("blocking", 4), ("gloo", 3)])
def test_its_collectives_give_gloos_results(backend: str, world: int, request: pytest.FixtureRequest) -> None:
    done = _results(request.getfixturevalue(backend), "collectives")
    assert sorted(done) == list(range(world)), done
    for rank, (line,) in done.items():
        assert line["all_reduce"] == world * (world + 1) / 2
        assert line["all_gather"] == [float(r) for r in range(world)]
        assert line["reduce_scatter"] == world * rank
        assert line["broadcast"] == 1.0
        assert line["recv"] == (5.0 if rank == 1 else 0.0)


def test_a_lost_or_silent_peer_blocks_until_the_word_of_the_loss_aborts(blocking: list[dict]) -> None:
    faults = _results(blocking, "fault")
    assert sorted(faults) == [0, 1], blocking
    for lines in faults.values():
        assert len(lines) == 2  # rank 2 SIGKILLed, then rank 3 SIGSTOPped
        for line in lines:
            assert line["outcome"] == "DistBackendError", line
            assert line["announced"] is not None and line["ended"] >= line["announced"] > line["began"], line


def test_on_gloo_a_lost_peer_fails_the_collective_by_itself(gloo: list[dict]) -> None:
    faults = _results(gloo, "fault")
    assert sorted(faults) == [0, 1], gloo
    for (line,) in faults.values():  # nobody aborts on gloo, and no word of the loss comes
        assert line["outcome"] != "returned" and line["announced"] is None, line


@pytest.mark.parametrize("backend, blocking", [
    ("gloo", False), ("fake", False), ("nccl", True), ("hccl", True), ("cpu:gloo,cuda:nccl", True),
    ("cpu:gloo,npu:hccl", True), ("blocking", True), ("ucc", True),
])
def test_every_backend_but_gloo_and_fake_counts_as_blocking(backend: str, blocking: bool) -> None:
    assert blocks(backend) is blocking


class _Group:
    """A process group as ``abort_blocking`` meets it in torch's registry; ``abort`` recorded."""

    def __init__(self, calls: list[str], name: str, fails: bool = False) -> None:
        self.calls, self.name, self.fails = calls, name, fails

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")
        if self.fails:
            raise RuntimeError("cannot abort")


def _registry(monkeypatch: pytest.MonkeyPatch, groups: dict[str, str], failing: str = "") -> list[str]:
    import torch.distributed as dist

    calls: list[str] = []
    registry = {_Group(calls, name, fails=name == failing): (backend, None) for name, backend in groups.items()}
    monkeypatch.setattr(dist.distributed_c10d, "_pg_map", registry)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)  # the fakes' records ask it
    return calls


def test_an_abort_ends_every_group_that_blocks_and_leaves_gloo_s_alone(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.torch.abort import abort_blocking

    calls = _registry(monkeypatch, {"world": "nccl", "data_gloo": "gloo", "mixed": "cpu:gloo,cuda:nccl",
                                    "held": "fake", "broken": "nccl"}, failing="broken")
    with caplog.at_level("WARNING", logger="ft_plugins.torch"):
        assert abort_blocking("a test") == 2
    assert calls == ["abort world", "abort mixed", "abort broken"]
    assert "a nccl group not aborted (a test): RuntimeError: cannot abort" in caplog.text
    assert "aborted this rank's 2 communicators (a test)" in caplog.text


def test_on_hccl_the_npu_is_stopped_and_restarted_before_the_groups_abort(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ft_plugins.torch.abort import abort_blocking
    from support import read_records, vendor_modules_isolated

    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FT_FAKE_RECORD", str(record))
    monkeypatch.syspath_prepend(str(FAKES))
    calls = _registry(monkeypatch, {"world": "hccl", "data_gloo": "gloo"})
    with vendor_modules_isolated():
        assert abort_blocking("a test") == 1
    assert [(call["api"], call["args"]) for call in read_records(record)] == [
        ("torch_npu.npu.stop_device", [0]), ("torch_npu.npu.restart_device", [0])]
    assert calls == ["abort world"]


@pytest.mark.parametrize("default, aborted", [("nccl", ["abort world"]), ("gloo", [])])
def test_a_dump_aborts_first_only_where_the_default_group_blocks(
        monkeypatch: pytest.MonkeyPatch, default: str, aborted: list[str]) -> None:
    import torch.distributed as dist

    from ft_plugins.torch.abort import abort_for_dump

    calls = _registry(monkeypatch, {"world": default})
    monkeypatch.setattr(dist, "get_backend", lambda group=None: default)
    abort_for_dump("SIGTERM")
    assert calls == aborted
