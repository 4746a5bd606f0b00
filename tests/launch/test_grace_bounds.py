"""The grace before SIGKILL has an upper bound. One save that met a stalled file system (timed with its barriers: 40
minutes) set the grace of every stop for the next 32 saves to its time × 1.5 + 5 s, an hour, and torchrun's stop,
msrun's and a pod's ``terminationGracePeriodSeconds`` all waited that long for a worker that does not end. Now, from
ten writes on, the slowest tenth recorded is passed over, and an estimated grace never passes
``FT_PLUGINS_GRACE_MAX`` (600 s unless set), said where the estimate is given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support import PYTHON, TORCHRUN

from ft_plugins import grace
from ft_plugins.config import GRACE_MAX_VAR, ConfigError, load
from ft_plugins.launch import shutdown

GB = 10**9
NORMAL = grace.Measured(10 * GB, 20.0, "save of iteration {}")  # 500 MB/s: a dump needs 35 s
STALLED = grace.Measured(10 * GB, 2400.0, "save of iteration 40")  # the file system stalled for 40 minutes
HOUR = STALLED.seconds * grace.MARGIN + grace.FIXED  # what the slowest write alone asked for


def _saves(save: Path, normal: int) -> Path:
    """``normal`` saves at the usual speed recorded, the stalled one the fourth write (or the last, with fewer)."""
    save.mkdir(parents=True, exist_ok=True)
    iterations = [iteration for iteration in range(10, 10 * normal + 20, 10) if iteration != 40][:normal]
    writes = [grace.Measured(NORMAL.written, NORMAL.seconds, NORMAL.what.format(iteration)) for iteration in iterations]
    writes.insert(3, STALLED)
    for write in writes:
        grace.record(str(save), write)
    return save


def _torchrun_stop(save: Path) -> float:
    """The seconds torchrun's stop of the workers waits before SIGKILL, in a job started with torchrun's 30 s and
    following its save directory (``ft-plugins run`` without ``--grace``)."""
    waited: list[float] = []

    def close(death_sig: object = None, timeout: float = 30) -> None:
        waited.append(timeout)

    shutdown.Planned(grace.TORCHRUN_GRACE, str(save)).torch_close(close, None, (), {})
    return waited[0]


def test_one_stalled_save_among_normal_ones_does_not_rule_once_ten_writes_are_recorded(tmp_path: Path) -> None:
    save = _saves(tmp_path / "ckpt", normal=9)  # 10 writes: the stalled one and 9 at 500 MB/s
    assert _torchrun_stop(save) == 35.0, f"not the {HOUR:.0f} s the stalled save alone asked for"
    found = grace.measured(str(save))
    assert grace.needed(found) == pytest.approx(NORMAL.seconds * grace.MARGIN + grace.FIXED)
    assert found.what == ("save of iteration 10, the 2nd slowest of the 10 writes recorded (the slowest passed over "
                          "as an outlier)")


def test_the_cap_bounds_every_stop_and_the_estimate_says_it_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(GRACE_MAX_VAR, raising=False)
    save = _saves(tmp_path / "ckpt", normal=3)  # too few writes to call the slowest an outlier: it counts
    found = grace.measured(str(save))
    assert grace.needed(found) == pytest.approx(HOUR)
    with caplog.at_level("WARNING", logger="ft_plugins.launch"):
        assert _torchrun_stop(save) == 600.0
    said = caplog.records[-1].getMessage()
    assert said.startswith("dying gasp: a dump needs about 3605 s (") and said.endswith(
        f"more than {GRACE_MAX_VAR}=600 s, the most an estimated grace gives: a dump that long is cut short; raise "
        f"{GRACE_MAX_VAR} where the file system is this slow; the workers get 600 s after SIGTERM before SIGKILL")
    planned = shutdown.plan([TORCHRUN, "pretrain_gpt.py", "--save", str(save)], {}, None, msrun=False)
    assert planned.seconds == 600.0 and planned.changes[grace.SHUTDOWN_VAR] == "600"
    assert f"more than {GRACE_MAX_VAR}=600 s" in planned.line and planned.warning is None  # nothing the user set
    assert shutdown.plan([TORCHRUN, "t.py", "--save", str(save)], {}, 4000.0, msrun=False).seconds == 4000.0, \
        "--grace is the user's: never cut"
    monkeypatch.setenv(GRACE_MAX_VAR, "120")
    assert _torchrun_stop(save) == 120.0
    assert grace.grace_for(found, shutdown.GRACE) == 120.0  # msrun's stop
    assert grace.grace_for(grace.Measured(GB, 1.0, "save"), grace.TORCHRUN_GRACE) == 30.0, "the launcher's own stays"
    monkeypatch.setenv(GRACE_MAX_VAR, "10")
    assert _torchrun_stop(save) == grace.TORCHRUN_GRACE, "never under the launcher's own"


def test_the_pods_grace_is_bounded_too(tmp_path: Path) -> None:
    pytest.importorskip("ruamel.yaml")
    from test_grace import JOB

    (tmp_path / "job.yaml").write_text(JOB)
    save = _saves(tmp_path / "ckpt", normal=3)
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(tmp_path / "job.yaml"), "--save", str(save)],
                            capture_output=True, text=True, env={**_environ(), GRACE_MAX_VAR: "900"})
    assert result.returncode == 0, result.stderr
    assert "terminationGracePeriodSeconds: 900" in result.stdout, result.stdout
    assert f"more than {GRACE_MAX_VAR}=900 s" in result.stderr


def _environ() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("FT_PLUGINS")}


@pytest.mark.parametrize("raw", ["ten", "0", "-5", "nan", "inf"])
def test_a_malformed_cap_is_one_line_naming_it_and_the_fix(raw: str, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as refused:
        load({}, env={GRACE_MAX_VAR: raw})  # a start: ft-plugins run exits 2, a worker turns ft_plugins off
    assert str(refused.value) == (f"{GRACE_MAX_VAR}={raw!r} is not valid: give the most seconds an estimated grace "
                                  "before SIGKILL may reach, a number greater than 0 (default 600)")
    monkeypatch.setenv(GRACE_MAX_VAR, raw)
    with caplog.at_level("WARNING", logger="ft_plugins.grace"):
        assert grace.cap() == 600.0  # where nothing checked it first (ft-plugins k8s, doctor)
    assert [record.getMessage() for record in caplog.records] == [f"{refused.value}; 600 s used"]
