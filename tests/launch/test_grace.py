"""The grace the workers get before SIGKILL covers their dump: estimated from the write this job's saves recorded,
planned by ``ft-plugins run``, given by torchrun's agent also when a worker dies (torch's own stop then waits a
fixed 30 s), checked by ``ft-plugins doctor`` and written into a job's pods by ``ft-plugins k8s``.

The real-process test stops a real torchrun whose rank 1 dies while rank 0's dying gasp (its SIGTERM handler)
takes 3 s: with ``--grace 8`` it finishes, with ``--grace 1`` torchrun's SIGKILL cuts it short. A grace under
torchrun's 30 s keeps the test to seconds; the estimate never plans one under 30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from support import PYTHON, TORCHRUN, free_port

from ft_plugins import grace
from ft_plugins.checkpoint import write_manifest
from ft_plugins.launch import doctor, k8s, shutdown

GB = 10**9
SLOW = grace.Measured(17 * GB, 40.0, "save of iteration 100")  # one writer of a 70B job's rank at 425 MB/s
FAST = grace.Measured(GB // 10, 0.5, "dump of iteration 3")


def _recorded(save: Path, measured: grace.Measured) -> Path:
    save.mkdir(parents=True, exist_ok=True)
    grace.record(str(save), measured)
    return save


def test_the_record_is_read_back_and_the_estimate_has_its_margin(tmp_path: Path) -> None:
    save = _recorded(tmp_path / "ckpt", SLOW)
    assert grace.measured(str(save)) == SLOW
    assert grace.needed(SLOW) == pytest.approx(40.0 * grace.MARGIN + grace.FIXED)
    assert grace.grace_for(SLOW, grace.TORCHRUN_GRACE) == 65.0
    assert grace.grace_for(FAST, grace.TORCHRUN_GRACE) == grace.TORCHRUN_GRACE, "never under the launcher's own"
    (save / grace.RECORD).write_text("{not json")
    assert grace.measured(str(save)) is None and grace.measured(None) is None


def test_the_estimate_rests_on_the_slowest_write_of_a_bounded_history(tmp_path: Path) -> None:
    """The latest write may have met a quiet file system: a dump then must not be planned at its speed."""
    save = tmp_path / "ckpt"
    slow = grace.Measured(10 * GB, 50.0, "save of iteration 100")  # 200 MB/s
    for write in (slow, grace.Measured(10 * GB, 10.0, "dump of iteration 150"),
                  grace.Measured(12 * GB, 12.0, "save of iteration 200")):  # the latest: 1 GB/s
        _recorded(save, write)
    found = grace.measured(str(save))
    assert (found.written, found.seconds) == (12 * GB, pytest.approx(60.0)), "the largest size at the slowest speed"
    assert found.what == "save of iteration 100, the slowest of the 3 writes recorded"
    quick = grace.Measured(GB // 10, 0.05, "dump of iteration 300")  # 2 GB/s
    for _ in range(grace.HISTORY - 1):
        grace.record(str(save), quick)
    found = grace.measured(str(save))  # the two oldest fell out of the history, the slowest tenth is passed over
    assert (found.seconds, found.what) == (pytest.approx(6.0), "dump of iteration 300, the 4th slowest of the "
                                                                 f"{grace.HISTORY} writes recorded (the 3 slower passed "
                                                                 "over as outliers)")
    grace.record(str(save), quick)
    assert grace.measured(str(save)).written == GB // 10
    (save / grace.RECORD).write_text(json.dumps({"written": slow.written, "seconds": 50.0, "what": slow.what}))
    assert grace.measured(str(save)) == slow, "a record of one write, as earlier releases kept"


def test_the_largest_writer_of_a_checkpoint(tmp_path: Path) -> None:
    for shard, size in (("mp_rank_00", 300), ("mp_rank_01", 500)):
        (tmp_path / "torch" / shard).mkdir(parents=True)
        (tmp_path / "torch" / shard / "model_optim_rng.pt").write_bytes(b"x" * size)
    (tmp_path / "torch" / "mp_rank_01" / "distrib_optim.pt").write_bytes(b"x" * 200)
    (tmp_path / "dist").mkdir()
    for name, size in (("__0_0.distcp", 400), ("__1_0.distcp", 900), (".metadata", 10)):
        (tmp_path / "dist" / name).write_bytes(b"x" * size)
    assert grace.largest_writer(str(tmp_path / "torch")) == 700
    assert grace.largest_writer(str(tmp_path / "dist")) == 900
    assert grace.largest_writer(str(tmp_path / "missing")) == 0
    # committed, the sizes its manifest records count, not the files' (here grown since): one read, no stat each
    for save, grown in (("torch", "mp_rank_00/model_optim_rng.pt"), ("dist", "__0_0.distcp")):
        write_manifest(tmp_path / save)
        with open(tmp_path / save / grown, "ab") as handle:
            handle.write(b"x" * 1000)
    assert grace.largest_writer(str(tmp_path / "torch")) == 700
    assert grace.largest_writer(str(tmp_path / "dist")) == 900


@pytest.mark.parametrize("count, unit, said", [(251, "B", "251 B"), (50_300, "B", "50.3 kB"), (3.4e6, "B", "3.4 MB"),
                                               (17 * GB, "B", "17.00 GB"), (1.2e6, "B/s", "1.2 MB/s"),
                                               (425e6, "B/s", "425 MB/s"), (2.5e9, "B/s", "2.5 GB/s")])
def test_sizes_and_speeds_are_said_in_the_unit_that_shows_them(count: float, unit: str, said: str) -> None:
    assert grace.amount(count, unit) == said


def test_run_plans_the_grace_the_dump_needs(tmp_path: Path) -> None:
    save = _recorded(tmp_path / "ckpt", SLOW)
    command = [TORCHRUN, "--nproc-per-node", "8", "pretrain_gpt.py", "--save", str(save)]
    planned = shutdown.plan(command, {}, None, msrun=False)
    assert planned.seconds == 65.0 and planned.warning is None
    assert planned.changes == {grace.GRACE_VAR: "65", grace.SHUTDOWN_VAR: "65", grace.GRACE_FOLLOWS_VAR: str(save)}
    assert planned.line == ("dying gasp: a dump needs about 65 s (17.00 GB by its largest writer at 425 MB/s, measured "
                            "on the save of iteration 100); the workers get 65 s after SIGTERM before SIGKILL")
    given = shutdown.plan([*command, "--shutdown-timeout", "40"], {}, None, msrun=False)
    assert given.seconds == 40.0 and grace.SHUTDOWN_VAR not in given.changes
    assert "shorter than the dump needs (65 s)" in given.warning
    assert shutdown.plan(command, {}, 90.0, msrun=False).seconds == 90.0
    unmeasured = shutdown.plan([TORCHRUN, "train.py", f"--save={tmp_path / 'new'}"], {}, None, msrun=False)
    assert unmeasured.seconds == grace.TORCHRUN_GRACE and "no write measured yet in" in unmeasured.line
    assert "raises the grace to what it needs" in unmeasured.line


def test_a_grace_not_given_follows_the_writes_the_job_records_after_its_start(tmp_path: Path,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The torchrun process's close of the workers: the planned grace until a save records a slower write, then
    what that write needs (said once); a given grace (no directory to follow) stays as given; a worker of such a
    job never warns (its grace follows the estimate)."""
    closes: list[float] = []

    def close(death_sig: object = None, timeout: float = 30) -> None:
        closes.append(timeout)

    save = tmp_path / "ckpt"
    following = shutdown.Planned(30.0, str(save))
    following.torch_close(close, None, (), {})
    _recorded(save, SLOW)
    with caplog.at_level("WARNING", logger="ft_plugins.launch"):
        following.torch_close(close, None, (), {"death_sig": 15})
        following.torch_close(close, None, (), {})
    shutdown.Planned(30.0, None).torch_close(close, None, (), {})
    assert closes == [30.0, 65.0, 65.0, 30.0]
    assert [record.getMessage() for record in caplog.records] == [
        f"dying gasp: {grace.describe(SLOW)}; the workers get 65 s after SIGTERM before SIGKILL"]
    assert grace.warn_if_short(str(save), {grace.GRACE_VAR: "30", grace.GRACE_FOLLOWS_VAR: str(save)}) is None
    assert "longer than ft-plugins run's grace of 30 s" in grace.warn_if_short(str(save), {grace.GRACE_VAR: "30"})


def test_msrun_s_grace_follows_what_its_workers_report_in_a_directory_of_the_launch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A MindSpore job names no save directory: ``ft-plugins run`` gives its workers an empty directory to report
    what their dump needs (every rank's file at their saves' speed); msrun's kill of the workers, and the run's own
    stop, wait for that, never under msrun's planned 20 s. A given ``--grace`` is followed by nothing."""
    reports = tmp_path / "reports"
    reports.mkdir()
    command = ["msrun", "--worker_num", "8", "--local_worker_num", "8", "train.py"]
    planned = shutdown.plan(command, {}, None, msrun=True, reports=str(reports))
    assert planned.seconds == 20.0 and planned.changes == {grace.GRACE_VAR: "20",
                                                           grace.GRACE_FOLLOWS_VAR: str(reports)}
    assert planned.line == ("dying gasp: what a dump needs is reported by the workers after a save, and raises the "
                            "grace to it; the workers get 20 s after SIGTERM before SIGKILL")
    given = shutdown.plan(command, {}, 5.0, msrun=True)
    assert given.changes == {grace.GRACE_VAR: "5"} and "raises the grace" not in given.line
    following = shutdown.Planned(planned.seconds, planned.changes[grace.GRACE_FOLLOWS_VAR])
    assert following.seconds() == 20.0
    _recorded(reports, SLOW)
    with caplog.at_level("WARNING", logger="ft_plugins.launch"):
        assert following.seconds() == 65.0
    assert [record.getMessage() for record in caplog.records] == [
        f"dying gasp: {grace.describe(SLOW)}; the workers get 65 s after SIGTERM before SIGKILL"]


def test_the_command_line_is_read_as_argparse_reads_it() -> None:
    """The last ``--save`` and the last shutdown flag win, in either spelling, as with argparse."""
    command = [TORCHRUN, "--shutdown_timeout=12", "train.py", "--save", "/a", "--save=/b"]
    assert grace.save_dir_of(command) == "/b"
    assert grace.shutdown_given(command, {grace.SHUTDOWN_VAR: "50"}) == 12.0
    assert grace.shutdown_given([TORCHRUN, "train.py"], {grace.SHUTDOWN_VAR: "50"}) == 50.0
    assert grace.shutdown_given([TORCHRUN, "--shutdown-timeout", "soon"], {}) is None
    assert grace.shutdown_given([TORCHRUN, "--shutdown_timeout=12", "--shutdown-timeout", "5"], {}) == 5.0


def test_run_says_the_grace_at_start_and_hands_it_to_torchrun(tmp_path: Path) -> None:
    save = _recorded(tmp_path / "ckpt", SLOW)
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "run", "--features", "none", "--dry-run", "--", TORCHRUN,
                             "--nproc-per-node", "2", "train.py", "--save", str(save)],
                            capture_output=True, text=True, env={**os.environ, "FT_PLUGINS": "none"})
    assert result.returncode == 0, result.stderr
    assert "export FT_PLUGINS_GRACE=65" in result.stdout and "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=65" in result.stdout
    assert "ft-plugins run: dying gasp: a dump needs about 65 s" in result.stderr


WORKER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    if os.environ["RANK"] == "1":
        while not os.path.exists(os.path.join(out, "ready")):
            time.sleep(0.05)
        sys.exit(1)  # a worker dies: torchrun stops the survivor
    def gasp(signum, frame):
        time.sleep(3.0)  # the dying gasp's write
        open(os.path.join(out, "finished"), "w").close()
        os._exit(143)
    signal.signal(signal.SIGTERM, gasp)
    open(os.path.join(out, "ready"), "w").close()
    time.sleep(120)
""")


def _stopped_by_torchrun(tmp_path: Path, seconds: str) -> Path:
    out = tmp_path / f"grace_{seconds}"
    out.mkdir()
    (out / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "TORCH_ELASTIC"))}
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "run", "--features", "none", "--grace", seconds, "--",
                             TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
                             str(out / "worker.py"), str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0 and (out / "ready").exists(), result.stderr[-3000:]
    return out


def test_torchrun_gives_a_survivor_the_grace_when_a_worker_dies(tmp_path: Path) -> None:
    assert (_stopped_by_torchrun(tmp_path, "8") / "finished").exists(), "the 3 s gasp finished inside 8 s"


def test_negative_control_a_grace_shorter_than_the_gasp_cuts_it_short(tmp_path: Path) -> None:
    """Also proves the grace is the agent's: torch's own stop after a worker died would wait 30 s."""
    assert not (_stopped_by_torchrun(tmp_path, "1") / "finished").exists()


def test_the_worker_warns_when_its_launchers_grace_is_shorter_than_the_dump(tmp_path: Path) -> None:
    slow, fast = _recorded(tmp_path / "slow", SLOW), _recorded(tmp_path / "fast", FAST)
    line = grace.warn_if_short(str(slow), {})
    assert line.startswith("a dump needs about 65 s") and "longer than torchrun's grace of 30 s" in line
    assert grace.warn_if_short(str(slow), {grace.GRACE_VAR: "65"}) is None
    assert grace.warn_if_short(str(fast), {}) is None and grace.warn_if_short(str(tmp_path / "none"), {}) is None


def test_doctor_names_the_dump_time_and_the_grace(tmp_path: Path) -> None:
    slow = doctor.check_grace(str(_recorded(tmp_path / "slow", SLOW)))
    assert slow.status == doctor.WARN and "`ft-plugins run` gives the workers 65 s" in slow.detail
    assert "ft-plugins k8s --save" in slow.fix
    assert doctor.check_grace(str(_recorded(tmp_path / "fast", FAST))).status == doctor.OK
    assert doctor.check_grace(None).detail.startswith("no --save DIR given")


JOB = """\
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: train
spec:
  tasks:
  - name: master
    template:
      spec:
        containers:
        - name: main
          image: x
  - name: worker
    template:
      spec:
        terminationGracePeriodSeconds: 120
        containers:
        - name: main
          image: x
"""


def test_k8s_raises_the_pods_grace_to_the_estimate_and_keeps_a_longer_one() -> None:
    pytest.importorskip("ruamel.yaml")
    edited, _ = k8s.edit(JOB, k8s.Options(termination_grace=(65, False)))
    assert [line.strip() for line in edited.splitlines() if "terminationGrace" in line] == [
        "terminationGracePeriodSeconds: 65", "terminationGracePeriodSeconds: 120"]
    forced, _ = k8s.edit(JOB, k8s.Options(termination_grace=(40, True)))
    assert forced.count("terminationGracePeriodSeconds: 40") == 2
    assert k8s.edit(edited, k8s.Options(termination_grace=(65, False)))[0] == edited, "a second run changes nothing"


def test_k8s_cli_takes_the_estimate_from_the_save_directory(tmp_path: Path) -> None:
    pytest.importorskip("ruamel.yaml")
    (tmp_path / "job.yaml").write_text(JOB)
    save = _recorded(tmp_path / "ckpt", SLOW)
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "k8s", str(tmp_path / "job.yaml"), "--save", str(save)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "terminationGracePeriodSeconds: 65" in result.stdout and "a dump needs about 65 s" in result.stderr
    assert grace.measured(str(save)) == SLOW, "read, never written"
