"""``ft-plugins report`` on events written here by hand (no process started): the goodput arithmetic, each fault's
row, and the reader's one-line refusals and notes on bad input. Real jobs' reports: tests/torch_megatron (the in-place
recoveries of test_replicated_dump.py, the dump + restart of test_recover_flags.py and test_auto_restart.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ft_plugins import events
from ft_plugins.cli import main
from ft_plugins.report.goodput import DETECTION, DUMP, IN_PLACE, RESTART, SAVES, STARTUP, analyse
from ft_plugins.report.reading import Refused, read

T0 = 1_800_000_000.0  # an epoch time: the events' clock


def near(seconds: float) -> Any:
    return pytest.approx(seconds, abs=1e-3)  # float seconds near T0 keep about 7 digits after the point


def write(folder: Path, name: str, head: dict[str, Any], *lines: dict[str, Any], tail: str = "") -> None:
    """One process's events file: its start (``head``: rank, attempt, ...), then ``lines``, times from T0."""
    folder.mkdir(parents=True, exist_ok=True)
    start = {"t": T0 + head.pop("at", 0.0), "ev": "start", "job": "j1", "role": "worker", "host": "n0", "attempt": 0,
             **head}
    body = [start] + [{**line, "t": T0 + line["t"], **({"end": T0 + line["end"]} if "end" in line else {})}
                      for line in lines]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in body) + tail)


def steps(first: int, last: int, at: float, seconds: float = 1.0) -> list[dict[str, Any]]:
    return [{"t": at + (n - first) * seconds, "ev": "step", "step": n, "end": at + (n - first + 1) * seconds}
            for n in range(first, last + 1)]


def in_place_job(folder: Path) -> None:
    """2 ranks: set-up 2 s, steps 1-3 (1 s each), a save of 0.5 s (rank 1's save before the steps cut short),
    rank 1 killed at 5.6 s (noticed at 5.7 s), repaired in place at 7.0 s (every rank stands at step 3), steps 4-5,
    end at 9 s."""
    write(folder, "launcher", {"role": "launcher", "rank": None},
          {"t": 5.7, "ev": "fault", "rank": 1, "kind": "death", "code": -9, "noticed": "launcher"},
          {"t": 5.7, "ev": "replacement", "rank": 1, "generation": 1}, {"t": 9.0, "ev": "end"})
    write(folder, "rank0", {"rank": 0}, *steps(1, 3, 2.0), {"t": 5.0, "ev": "save_start", "step": 3},
          {"t": 5.5, "ev": "save_end", "step": 3, "bytes": 100},
          {"t": 5.8, "ev": "caught", "generation": 1}, {"t": 6.9, "ev": "recovered", "generation": 1, "step": 3},
          *steps(4, 5, 7.0), {"t": 9.0, "ev": "end"})
    write(folder, "rank1", {"rank": 1}, {"t": 1.0, "ev": "save_start", "step": 0},  # cut short: no end
          *steps(1, 3, 2.0), {"t": 5.0, "ev": "save_start", "step": 3}, {"t": 5.5, "ev": "save_end", "step": 3},
          {"t": 5.6, "ev": "fault", "rank": 1, "kind": "death", "completed": 3, "noticed": "injected"})
    write(folder, "rank1-new", {"rank": 1, "at": 5.75, "generation": 1, "life": 1},
          {"t": 7.0, "ev": "recovered", "generation": 1, "step": 3}, *steps(4, 5, 7.0), {"t": 9.0, "ev": "end"})


def test_in_place_fault_goodput_arithmetic_and_its_row(tmp_path: Path) -> None:
    in_place_job(tmp_path)
    report = analyse(read(str(tmp_path)))
    assert report.wall == near(9.0)
    assert report.badput[STARTUP] == near(2.0)
    assert report.badput[SAVES] == near(0.5)
    assert report.badput[DETECTION] == near(0.1)  # the shot at 5.6 s, the launcher's notice at 5.7 s
    assert report.badput[IN_PLACE] == near(1.3)  # to the last rank repaired, at 7.0 s
    assert report.productive == near(3.0 + 2.0)  # steps 1-3 and 4-5
    assert report.goodput == near(100 * 5.0 / 9.0)
    assert report.other == near(9.0 - 5.0 - 2.0 - 0.5 - 0.1 - 1.3)  # 5.5 s to 5.6 s
    [fault] = report.faults
    assert (fault.rank, fault.kind, fault.how, fault.steps_lost, fault.steps_recomputed) == (1, "death", "in place",
                                                                                             0, 0)
    assert fault.at == near(5.6) and fault.to_training == near(1.4)


def test_dump_and_restart_counts_the_dump_the_restart_and_the_steps_trained_again(tmp_path: Path) -> None:
    """Rank 0 raises in step 4 at 5.2 s; its dump of step 2 (not 3: say the save was older) ends at 5.6 s;
    attempt 1 starts at 6 s and trains from step 3 at 8 s: step 3 is lost and trained again."""
    write(tmp_path, "rank0", {"rank": 0}, *steps(1, 3, 2.0),
          {"t": 5.2, "ev": "gasp", "reason": "InjectedFault in step 4", "kind": "exception", "completed": 3},
          {"t": 5.6, "ev": "dump", "step": 2, "seconds": 0.4})
    write(tmp_path, "rank0-attempt1", {"rank": 0, "attempt": 1, "at": 6.0},
          {"t": 7.0, "ev": "resume", "chosen": "ckpt/iter_0000002", "skipped": []}, *steps(3, 5, 8.0))
    report = analyse(read(str(tmp_path)))
    [fault] = report.faults
    assert (fault.rank, fault.kind, fault.how) == (0, "exception", "dump + restart")
    assert fault.to_training == near(8.0 - 5.2)
    assert (fault.steps_lost, fault.steps_recomputed) == (1, 1)
    assert report.badput[DUMP] == near(0.4)
    assert report.badput[RESTART] == near(8.0 - 5.6)
    assert report.badput["steps recomputed"] == near(1.0)
    assert report.productive == near(3.0 + 2.0)


def test_msrun_started_again_is_a_restart_and_a_survivor_names_the_lost_peer(tmp_path: Path) -> None:
    """msrun has no restart attempts: rank 1 dies after step 3 at 5.1 s, rank 0 sees its process exit at 5.2 s and
    dumps step 3 by 5.5 s; msrun started again (another launcher: attempt 0 again) trains from step 4 at 9 s. A
    worker of the first launch starting late is no restart."""
    first, second = {"parent": 100, "host": "n0"}, {"parent": 200, "host": "n0"}
    write(tmp_path, "rank0", {"rank": 0, **first}, *steps(1, 3, 2.0),
          {"t": 5.2, "ev": "fault", "rank": 1, "kind": "death", "noticed": "peer"},
          {"t": 5.5, "ev": "dump", "step": 3, "seconds": 0.3})
    write(tmp_path, "rank1", {"rank": 1, **first}, *steps(1, 3, 2.0))
    write(tmp_path, "rank1-late", {"rank": 1, "at": 5.3, **first}, *steps(9, 9, 5.4))
    for rank in (0, 1):
        write(tmp_path, f"rank{rank}-again", {"rank": rank, "at": 7.0, **second}, *steps(4, 5, 9.0))
    [fault] = analyse(read(str(tmp_path))).faults
    assert (fault.rank, fault.kind, fault.how, fault.steps_lost) == (1, "death", "dump + restart", 0)
    assert fault.to_training == near(9.0 - 5.2)


def test_a_hang_begins_when_the_rank_went_quiet(tmp_path: Path) -> None:
    write(tmp_path, "launcher", {"role": "launcher", "rank": None},
          {"t": 9.0, "ev": "fault", "rank": 1, "kind": "hang", "quiet": 4.0, "section": "step", "noticed": "watchdog"},
          {"t": 9.1, "ev": "fault", "rank": 1, "kind": "signal", "code": -15, "noticed": "launcher"})
    write(tmp_path, "rank0", {"rank": 0}, *steps(1, 3, 2.0), {"t": 10.0, "ev": "recovered", "generation": 1, "step": 3},
          *steps(4, 4, 10.0))
    [fault] = analyse(read(str(tmp_path))).faults
    assert (fault.rank, fault.kind, fault.how, fault.section) == (1, "hang", "hang kill, in place", "step")
    assert fault.at == near(5.0) and fault.to_training == near(5.0)


def restarted_job(folder: Path, launcher: tuple[dict[str, Any], ...], first: dict[str, Any] | None,
                  rank0: tuple[dict[str, Any], ...] = (), rank1: tuple[dict[str, Any], ...] = ()) -> None:
    """2 ranks, steps 1-3, a fault at 5.0 s met by a dump and torchrun's restart (attempt 1 trains from 8 s);
    ``launcher``: the launcher's lines (none: plain torchrun, no launcher file); ``first``: the first gasp, at 5.0 s
    (None: none); each rank's own lines after that; the dump at 5.5 s."""
    if launcher:
        write(folder, "launcher", {"role": "launcher", "rank": None}, *launcher)
    gasp = [] if first is None else [{"t": 5.0, "ev": "gasp", "reason": "SIGTERM", "kind": "signal", "completed": 3}]
    for rank, lines in ((0, rank0), (1, rank1)):
        write(folder, f"rank{rank}", {"rank": rank}, *steps(1, 3, 2.0),
              *(gasp if first is not None and first["rank"] == rank else []), *lines,
              *([{"t": 5.5, "ev": "dump", "step": 3, "seconds": 0.5}] if rank == 0 else []))
        write(folder, f"rank{rank}-attempt1", {"rank": rank, "attempt": 1, "at": 6.0}, *steps(4, 5, 8.0))


def seen(t: float, rank: int, code: int) -> dict[str, Any]:
    """A worker the launcher found failed."""
    return {"t": t, "ev": "fault", "rank": rank, "kind": events.exit_kind(code), "code": code, "noticed": "launcher"}


STOPPED = {"t": 5.3, "ev": "gasp", "reason": "SIGTERM", "kind": "signal", "completed": 3}  # torchrun's stop, seen


def test_the_rank_is_the_one_the_launcher_found_failed_not_the_first_to_notice(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at 5.0 s writes nothing; torchrun finds it failed at 5.1 s and stops rank 0, which gasps at
    5.3 s and dumps: the launcher's record names rank 1, though only rank 0 wrote of the fault."""
    restarted_job(tmp_path, (seen(5.1, 1, -9),), None, rank0=(STOPPED,))
    [fault] = analyse(read(str(tmp_path))).faults
    assert (fault.rank, fault.kind, fault.how) == (1, "death", "dump + restart")
    assert fault.at == near(5.1) and fault.to_training == near(8.0 - 5.1)


def test_without_the_launchers_record_the_first_to_gasp_is_named(tmp_path: Path) -> None:
    """Plain torchrun: rank 1, SIGTERMed, gasps at 5.0 s; rank 0 gasps when torchrun stops it, at 5.3 s."""
    restarted_job(tmp_path, (), {"rank": 1}, rank0=(STOPPED,))
    [fault] = analyse(read(str(tmp_path))).faults
    assert (fault.rank, fault.kind, fault.how) == (1, "signal", "dump + restart")


def test_several_found_failed_in_one_look_the_one_the_workers_name_else_the_first(tmp_path: Path) -> None:
    """Both ranks' exits fell between two looks of the launcher (one time, both named): rank 1's own SIGTERM gasp
    picks it; with no rank's own record, the look's first is named."""
    look = (seen(5.4, 0, 1), seen(5.4, 1, 143))
    restarted_job(tmp_path / "gasped", look, {"rank": 1}, rank0=(STOPPED,))
    assert [fault.rank for fault in analyse(read(str(tmp_path / "gasped"))).faults] == [1]
    restarted_job(tmp_path / "silent", look, None)
    assert [fault.rank for fault in analyse(read(str(tmp_path / "silent"))).faults] == [0]


def test_a_rank_that_names_itself_at_fault_is_named_before_the_first_the_launcher_found_exited(tmp_path: Path) -> None:
    """Rank 0's drill raises at 5.0 s; under ``recover`` its peer falls back and exits first (the launcher's look
    finds rank 1 at 5.2 s, rank 0 at 5.4 s): the rank at fault is the one that says so, not the first to exit."""
    shot = {"t": 5.0, "ev": "fault", "rank": 0, "kind": "exception", "section": "forward", "noticed": "injected"}
    restarted_job(tmp_path, (seen(5.2, 1, 1), seen(5.4, 0, 1)), None, rank0=(shot,))
    [fault] = analyse(read(str(tmp_path))).faults
    assert (fault.rank, fault.kind, fault.how) == (0, "exception", "dump + restart")


def test_no_events_is_refused_saying_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(Refused, match=f"no events found: looked for \\*.jsonl in {tmp_path} and {tmp_path}/ft_events"):
        read(str(tmp_path))


def test_a_save_directory_is_read_through_its_events_folder(tmp_path: Path) -> None:
    in_place_job(tmp_path / events.FOLDER)
    assert read(str(tmp_path)).folder == str(tmp_path / events.FOLDER)


def test_a_last_line_cut_short_is_read_up_to_and_said(tmp_path: Path) -> None:
    in_place_job(tmp_path)
    write(tmp_path, "rank1", {"rank": 1}, *steps(1, 3, 2.0), tail='{"t": 1800000005.6, "ev": "fau')
    record = read(str(tmp_path))
    assert record.notes == ["rank1.jsonl: its last line was cut short (the process ended as it wrote); read up to it"]
    assert [len(process.of("step")) for process in record.processes if process.path.endswith("rank1.jsonl")] == [3]


def test_two_jobs_in_one_folder_are_refused_unless_one_is_chosen(tmp_path: Path) -> None:
    in_place_job(tmp_path)
    write(tmp_path, "other", {"rank": 0, "job": "j2"}, *steps(1, 2, 0.0))
    with pytest.raises(Refused, match=r"events of 2 jobs in .* \(j1, j2\): choose one with --job ID"):
        read(str(tmp_path))
    assert [process.job for process in read(str(tmp_path), job="j2").processes] == ["j2"]


def test_a_node_whose_clock_disagrees_is_shifted_onto_the_first_and_said(tmp_path: Path) -> None:
    """Rank 1 on node n1, whose clock runs 30 s ahead: its step ends meet rank 0's once shifted."""
    write(tmp_path, "rank0", {"rank": 0}, *steps(1, 4, 2.0))
    write(tmp_path, "rank1", {"rank": 1, "host": "n1", "at": 30.0}, *steps(1, 4, 32.0))
    record = read(str(tmp_path))
    assert record.notes == ["clocks: n1 runs 30.00 s ahead of n0 (from 4 step ends, which a collective makes "
                            "simultaneous); n0's clock assumed, n1's times shifted"]
    assert analyse(record).wall == near(6.0)


def test_the_save_interval_weighs_the_job_s_save_cost_against_its_faults_that_recomputed_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Steps of 1 s, saves of 0.5 s after steps 2 and 4 (2.5 s apart), rank 0 raising after step 6 with no dump, the
    restart resuming from step 4 at 10 s: steps 5 and 6 trained again, the job ends at 14 s. One save costs 0.5 s, one
    fault recomputing steps per 14 s: the optimum is the square root of 2 x 0.5 x 14."""
    write(tmp_path, "rank0", {"rank": 0}, *steps(1, 2, 1.0), {"t": 3.0, "ev": "save_start", "step": 2},
          {"t": 3.5, "ev": "save_end", "step": 2}, *steps(3, 4, 3.5), {"t": 5.5, "ev": "save_start", "step": 4},
          {"t": 6.0, "ev": "save_end", "step": 4}, *steps(5, 6, 6.0),
          {"t": 8.2, "ev": "gasp", "reason": "RuntimeError in step 7", "kind": "exception", "completed": 6})
    write(tmp_path, "rank0-attempt1", {"rank": 0, "attempt": 1, "at": 9.0},
          {"t": 9.5, "ev": "resume", "chosen": "ckpt/iter_0000004", "skipped": []}, *steps(5, 8, 10.0),
          {"t": 14.0, "ev": "end"})
    report = analyse(read(str(tmp_path)))
    [fault] = report.faults
    assert fault.steps_recomputed == 2
    advice = report.interval
    assert advice is not None and not advice.at_least
    assert (advice.saves, advice.faults, advice.current_steps) == (2, 1, 2)
    assert advice.save_cost == near(0.5) and advice.between_faults == near(14.0) and advice.current == near(2.5)
    optimum = (2 * 0.5 * 14.0) ** 0.5
    assert advice.optimum == near(optimum) and advice.optimum_steps == round(optimum)

    def waste(interval: float) -> float:  # saving, and half an interval recomputed per fault
        return 0.5 / interval + interval / (2 * 14.0)

    assert advice.lost == near(14.0 * (waste(2.5) - waste(optimum)))
    assert 0 < advice.lost < 1
    code, out, _ = cli(capsys, str(tmp_path))
    assert code == 0 and f"optimum {optimum:.2f} s ({round(optimum)} steps); current 2.50 s (2 steps)" in out
    assert json.loads(cli(capsys, str(tmp_path), "--json")[1])["interval"]["optimum"] == near(optimum)


def test_without_a_fault_that_recomputed_steps_the_interval_is_a_lower_bound(tmp_path: Path) -> None:
    """The in-place repair recomputed nothing: the rate of faults the interval guards against is unknown, and the
    job's 9 s without one bound it: with one 0.5 s save, the optimum is at least the square root of 2 x 0.5 x 9."""
    in_place_job(tmp_path)
    report = analyse(read(str(tmp_path)))
    advice = report.interval
    assert advice is not None and advice.at_least and advice.faults == 0 and advice.saves == 1
    assert advice.optimum == near(3.0) and advice.current is None and advice.lost is None
    from ft_plugins.report.table import render

    assert "optimum at least 3.00 s (3 steps) while faults stay that rare; current -" in render(report)


def test_a_job_that_finished_no_save_has_no_interval_advice(tmp_path: Path) -> None:
    write(tmp_path, "rank0", {"rank": 0}, {"t": 1.0, "ev": "save_start", "step": 0}, *steps(1, 3, 2.0),
          {"t": 5.0, "ev": "end"})
    report = analyse(read(str(tmp_path)))
    assert report.interval is None and report.badput[SAVES] == 0


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_refuses_in_one_line_and_reports_as_text_json_and_a_picture(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = cli(capsys, str(tmp_path))
    assert code == 3 and len(err.splitlines()) == 1 and err.startswith("ft-plugins report: no events found")
    in_place_job(tmp_path)
    code, out, err = cli(capsys, str(tmp_path))
    assert code == 0, err
    assert "goodput              55.6 %" in out and "in place" in out
    assert json.loads(cli(capsys, str(tmp_path), "--json")[1])["faults"][0]["kind"] == "death"
    for name, magic in (("timeline.png", b"\x89PNG"), ("timeline.svg", b"<?xml")):
        code, _, err = cli(capsys, str(tmp_path), "--plot", str(tmp_path / name))
        assert code == 0, err
        assert (tmp_path / name).read_bytes().startswith(magic)


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    in_place_job(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails, as where it is not installed
    code, _, err = cli(capsys, str(tmp_path), "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert err.strip() == "ft-plugins report: --plot needs matplotlib: pip install 'ft-plugins[report]'"


def test_events_go_beside_the_checkpoints_unless_placed_elsewhere_or_ft_plugins_is_off() -> None:
    argv = ["pretrain_gpt.py", "--save", "/ckpt", "--lr", "1"]
    assert events.directory({}, argv) == "/ckpt/ft_events"
    assert events.directory({}, ["train.py", "--save=/ckpt"]) == "/ckpt/ft_events"
    assert events.directory({}, ["run_clm.py", "--output_dir", "/out"]) == "/out/ft_events"  # Hugging Face scripts
    assert events.directory({}, ["train.py", "--output-dir=/out"]) == "/out/ft_events"
    assert events.directory({"FT_PLUGINS_EVENTS_DIR": "/elsewhere"}, argv) == "/elsewhere"
    assert events.directory({"FT_PLUGINS_EVENTS_DIR": "off"}, argv) is None
    assert events.directory({"FT_PLUGINS": "none"}, argv) is None
    assert events.directory({}, ["train.py"]) is None


def test_a_process_keeps_its_steps_in_memory_and_writes_them_at_its_end(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_PLUGINS_EVENTS_DIR", str(tmp_path))
    monkeypatch.setattr(events, "_recorder", None)
    events.start("worker")
    events.step(1, events.time.time())
    [path] = tmp_path.iterdir()
    assert [json.loads(line)["ev"] for line in path.read_text().splitlines()] == ["start"]
    events.emit("fault", rank=1, kind="death")
    events.end(0)
    assert [json.loads(line)["ev"] for line in path.read_text().splitlines()] == ["start", "fault", "step", "end"]
    monkeypatch.setattr(events, "_recorder", None)


def test_steps_are_written_by_the_process_s_writer_thread_never_by_the_training_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch of steps goes to disk from the writer thread (a file system answering slowly holds no step); the
    last steps at the end from the caller, after the batch the thread was writing."""
    monkeypatch.setenv("FT_PLUGINS_EVENTS_DIR", str(tmp_path))
    monkeypatch.setattr(events, "_recorder", None)
    monkeypatch.setattr(events, "FLUSH_EVERY", 0.0)  # a batch at every step
    writers: list[tuple[str, bytes]] = []
    real_write = events.os.write

    def slow_write(fd: int, data: bytes) -> int:
        writers.append((threading.current_thread().name, data))
        time.sleep(0.05)  # a file system that answers in 50 ms
        return real_write(fd, data)

    events.start("worker")
    monkeypatch.setattr(events.os, "write", slow_write)
    events.step(1, time.time())
    deadline = time.monotonic() + 30
    while not any(b'"ev": "step"' in data for _, data in writers) and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread's first batch, however busy the machine
    for number in range(2, 6):
        events.step(number, time.time())
    events.end(0)
    monkeypatch.setattr(events.os, "write", real_write)
    [path] = tmp_path.iterdir()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(line["step"] for line in lines if line["ev"] == "step") == [1, 2, 3, 4, 5]
    batches = [name for name, data in writers if b'"ev": "step"' in data]
    assert batches and batches[0] == "ft_plugins-events", writers
    assert threading.main_thread().name not in batches[:-1], writers  # at most the end's own flush
    assert lines[-1]["ev"] == "end"
    monkeypatch.setattr(events, "_recorder", None)


def test_a_forked_copy_writes_its_steps_to_a_file_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process forked after its parent began its events (a warm spare from its template) has no writer thread of
    its parent's: its first step begins its own file, and its steps are written there."""
    monkeypatch.setenv("FT_PLUGINS_EVENTS_DIR", str(tmp_path))
    monkeypatch.setattr(events, "_recorder", None)
    monkeypatch.setattr(events, "FLUSH_EVERY", 0.0)
    events.start("worker")
    events.step(1, time.time())
    child = os.fork()
    if child == 0:
        try:
            for number in (7, 8):
                events.step(number, time.time())
            events.end(0)
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    events.end(0)
    files = {path.name.split("-")[-2]: path for path in tmp_path.iterdir()}
    assert sorted(files) == sorted([str(os.getpid()), str(child)])
    steps_of = {pid: sorted(json.loads(line)["step"] for line in path.read_text().splitlines()
                            if json.loads(line)["ev"] == "step") for pid, path in files.items()}
    assert steps_of == {str(os.getpid()): [1], str(child): [7, 8]}
    monkeypatch.setattr(events, "_recorder", None)


def test_a_process_that_becomes_another_rank_keeps_the_batch_its_writer_was_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread is inside a batch's write when the process begins its events again as another rank (a warm
    spare taking a lost rank's place): the old descriptor is closed after that write, not under it (the batch was
    lost, or went to whatever file got the descriptor's number next)."""
    monkeypatch.setenv("FT_PLUGINS_EVENTS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(events, "_recorder", None)
    monkeypatch.setattr(events, "FLUSH_EVERY", 0.0)
    events.start("worker")
    old = events._recorder
    writing, real_write = threading.Event(), events.os.write

    def slow_write(fd: int, data: bytes) -> int:
        if b'"ev": "step"' in data and threading.current_thread().name == "ft_plugins-events":
            writing.set()
            time.sleep(0.3)
        return real_write(fd, data)

    monkeypatch.setattr(events.os, "write", slow_write)
    events.step(1, time.time())
    assert writing.wait(30)
    monkeypatch.setenv("RANK", "3")
    events.start("worker")  # a new file; the old descriptor closed once the batch is written
    events.end(0)
    monkeypatch.setattr(events.os, "write", real_write)
    [path] = tmp_path.iterdir()  # the process's one file (its host, pid and role), a start line per rank it was
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["ev"], line.get("rank")) for line in lines] == [("start", 0), ("step", None), ("start", 3),
                                                                  ("end", None)], lines
    assert old.fd == -1
    monkeypatch.setattr(events, "_recorder", None)
