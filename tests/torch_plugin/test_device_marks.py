"""``ft_plugins.torch.device``: the dump's copies wait for the last step boundary on the device, never past their
deadline, then run on a stream of their own. The device here is a stand-in module with CUDA's names (events whose
completion the test decides, streams that record what ran on them); the real device, a kernel stuck on a CUDA
stream, is ``tests/gpu/test_side_stream_dump.py``'s (run where a GPU is)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from ft_plugins.torch import device
from ft_plugins.torch.device import DeviceMarks, DeviceStuck


class FakeDevice:
    """``torch.cuda`` as the marks use it: ``done`` says whether the device reached the recorded event."""

    def __init__(self) -> None:
        self.done = False
        self.current: Any = "default stream"
        self.recorded = 0
        self.synchronized: list[Any] = []
        self.devices: list[int] = []

    def Event(self) -> Any:  # noqa: N802 (torch's name)
        fake = self

        class Event:
            def record(self) -> None:
                fake.recorded += 1

            def query(self) -> bool:
                return fake.done

        return Event()

    def Stream(self) -> Any:  # noqa: N802
        fake = self

        class Stream:
            def synchronize(self) -> None:
                fake.synchronized.append(self)

        return Stream()

    def current_device(self) -> int:
        return 3

    @contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.devices.append(index)
        yield

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    made = FakeDevice()
    monkeypatch.setattr(device, "accelerator", lambda: made)
    return made


def test_the_copies_run_on_a_stream_of_their_own_once_the_boundary_is_reached(fake: FakeDevice) -> None:
    marks = DeviceMarks()
    marks.mark()
    marks.mark()
    fake.done = True
    with marks.side_stream(5.0):
        inside = fake.current
    assert fake.recorded == 2 and inside != "default stream" and fake.current == "default stream"
    assert fake.synchronized == [inside], "the dump's stream is drained before the dump goes on"
    assert fake.devices == [3], "on the device the marks were recorded on, whatever thread the dump runs in"


def test_the_device_is_looked_up_until_one_is_found_and_then_never_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two marks a step: the lookup (which asks every device module whether it is in use) only until a device is."""
    made, found, lookups = FakeDevice(), [], []
    monkeypatch.setattr(device, "accelerator", lambda: lookups.append(1) or (made if found else None))
    marks = DeviceMarks()
    marks.mark()
    found.append(True)
    for _ in range(3):
        marks.mark()
    assert len(lookups) == 2 and made.recorded == 3


def test_a_boundary_not_reached_within_the_deadline_copies_nothing(fake: FakeDevice) -> None:
    marks = DeviceMarks()
    marks.mark()
    entered, started = [], time.monotonic()
    with pytest.raises(DeviceStuck, match="within 0.2 s"):
        with marks.side_stream(0.2):
            entered.append(True)
    assert not entered and time.monotonic() - started >= 0.2


def test_a_boundary_reached_during_the_wait_lets_the_copies_go_on(fake: FakeDevice) -> None:
    import threading

    marks = DeviceMarks()
    marks.mark()
    threading.Timer(0.1, lambda: setattr(fake, "done", True)).start()
    with marks.side_stream(10.0):
        assert fake.current != "default stream"


def test_deadline_0_copies_on_the_current_stream_without_waiting(fake: FakeDevice) -> None:
    marks = DeviceMarks()
    marks.mark()  # never reached: a deadline would end in DeviceStuck
    with marks.side_stream(0):
        assert fake.current == "default stream"


def test_without_a_mark_or_a_device_the_copies_run_as_they_stand(fake: FakeDevice,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with DeviceMarks().side_stream(5.0):  # no step began: nothing to wait for
        assert fake.current == "default stream"
    monkeypatch.setattr(device, "accelerator", lambda: None)
    marks = DeviceMarks()
    marks.mark()
    with marks.side_stream(5.0):
        pass
    assert fake.recorded == 0


def test_a_cuda_that_is_claimed_but_not_in_use_is_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU shim of the examples answers ``is_available()`` with True; no CUDA runtime was started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not torch.cuda.is_initialized() and device.accelerator() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert device.accelerator() is torch.cuda


def test_the_gpu_check_says_why_it_does_not_run_on_a_machine_without_cuda() -> None:
    """``tests/gpu`` (left out of the suite unless ``GPU_CHECKS=1``) is skipped with its reason here, not broken."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    gpu = Path(__file__).resolve().parents[1] / "gpu"
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"GPU_CHECKS": "1"}  # a skip is no failure there
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(gpu)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=gpu.parents[1])
    assert run.returncode == 5, run.stdout[-3000:] + run.stderr[-2000:]  # pytest's "no test ran"
    assert "2 skipped" in run.stdout and "needs a CUDA device" in run.stdout, run.stdout[-3000:]


def test_the_device_drill_needs_cuda_in_use() -> None:
    from ft_plugins.faults import Fault
    from ft_plugins.torch.drill import stuck_kernel

    with pytest.raises(RuntimeError, match="at=device needs a CUDA device in use"):
        stuck_kernel(Fault(0, 3, "term", "device", seconds=5))


def test_the_trainers_dump_copies_behind_the_marks_of_its_steps(fake: FakeDevice, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The Trainer's glue marks each step's start and each update (inside its bracket), and its dump writes on the
    dump's own stream once the device reached the latest mark; a mark never reached writes nothing."""
    from types import SimpleNamespace

    from ft_plugins.torch.hf import ttp as hf_ttp

    dump = hf_ttp.TrainerDump(SimpleNamespace(settings={"save_dir": None, "device_wait": 0.3}))
    dump._refusal, dump._take_rng = "", dict  # inside a Trainer.train it serves; an empty RNG state
    written: list[tuple[Any, int]] = []
    monkeypatch.setattr(hf_ttp, "abort_for_dump", lambda reason: None)
    monkeypatch.setattr(dump, "_write", lambda reason, started, at, step: written.append((fake.current, step)))
    dump.on_event("step_begin", None, SimpleNamespace(global_step=0), None, {})
    assert fake.recorded == 1
    dump.update(lambda: fake.recorded, None, (), {})
    assert fake.recorded == 2 and dump.tracker.peek().completed == 0, "the mark follows the update, inside it"
    dump.on_event("step_end", None, SimpleNamespace(global_step=1), None, {})
    dump.on_event("step_begin", None, SimpleNamespace(global_step=1), None, {})
    with caplog.at_level("ERROR", logger="ft_plugins.ttp"):
        dump.save("SIGTERM", dump.tracker.peek())
    assert written == [] and "dump failed: DeviceStuck" in caplog.text, "the device never reached step 2's start"
    fake.done = True
    dump.save("SIGTERM", dump.tracker.peek())
    assert written == [(fake.synchronized[0], 1)], "step 1 written on the dump's own stream, drained after"
    assert fake.current == "default stream"
