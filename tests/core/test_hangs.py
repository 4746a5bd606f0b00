"""``hangs`` without processes: the bounds learned from the job's steps, the launcher's judgement of who hung
(one rank, or every rank alike), the progress record, the stacks' reading, the options and the start-up lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ft_plugins import progress
from ft_plugins.config import ConfigError, load
from ft_plugins.faults import Fault, parse_faults
from ft_plugins.features import declared_options
from ft_plugins.features.hangs import Bounds, Hangs
from ft_plugins.launch import doctor, environment, watchdog
from ft_plugins.launch.stalls import (ALL, HANG, WAIT, Watch, ahead, behind, judge, main_frames, overdue, stuck,
                                     waits_on_peers)
from ft_plugins.progress import BETWEEN, DATA, END, EVAL, GC, RECOVERY, SAVE, SETUP, STEP, Record

DEFAULTS = {option.name: option.default for option in Hangs.options}
SETTINGS = {**DEFAULTS, "floor": 3.0, "factor": 5.0, "warmup": 60.0, "warmup_steps": 1, "save": 30.0}


def _record(step: int, section: int, seq: int, begun: int | None = None, pid: int = 7) -> Record:
    return Record(pid, 0x1234, seq, step, step if begun is None else begun, section)


def test_a_step_bound_is_a_multiple_of_the_slowest_step_seen_after_warm_up_with_a_floor() -> None:
    bounds = Bounds(SETTINGS)
    assert bounds.step() == 60.0  # nothing learned: the warm-up bound
    bounds.learn(4.0, begun=1)  # the first step of the process (compilation): stands in until a later one is seen
    assert bounds.slowest == 0.0 and bounds.step() == 20.0
    bounds.learn(40.0, begun=1)
    assert bounds.step() == 60.0  # never above the warm-up bound
    bounds.learn(0.2, begun=2)
    assert bounds.step() == 3.0  # the floor
    bounds.learn(1.5, begun=3)
    bounds.learn(0.4, begun=4)
    assert bounds.slowest == 1.5 and bounds.step() == 7.5


def test_set_up_the_first_steps_pauses_saves_evaluations_and_recoveries_have_bounds_of_their_own() -> None:
    bounds = Bounds({**SETTINGS, "data": 20.0, "gc": 15.0})
    bounds.learn(0.1, begun=2)
    assert bounds.bound(SETUP, 0) == bounds.bound(END, 9) == 60.0  # set-up; after the training loop
    assert bounds.bound(STEP, 1) == 60.0  # a warm-up step
    assert bounds.bound(STEP, 2) == bounds.bound(BETWEEN, 2) == 3.0
    assert (bounds.bound(DATA, 2), bounds.bound(GC, 2), bounds.bound(SAVE, 2)) == (20.0, 15.0, 30.0)
    assert bounds.bound(EVAL, 2) == bounds.bound(RECOVERY, 2) == 900.0
    bounds.learn(10.0, begun=5)  # steps grew past what a save is given: the save's bound grows with them
    assert bounds.bound(SAVE, 6) == 50.0


def test_the_defaults_bound_a_step_tightly_and_give_pauses_and_a_whole_job_stall_a_minute() -> None:
    bounds = Bounds(DEFAULTS)
    bounds.learn(0.06, begun=3)  # a 60 ms step: 5 x is under the floor
    assert bounds.bound(STEP, 3) == 1.0
    assert bounds.bound(DATA, 3) == bounds.bound(GC, 3) == DEFAULTS["stall"] == 60.0


def test_the_launcher_learns_the_steps_its_workers_timed() -> None:
    """Each worker times its own steps (a look of the launcher may fall between two short steps, or be late)."""
    bounds, watch = Bounds(SETTINGS), Watch(pid=7, moved=0.0)
    watch.observe(_record(0, SETUP, 1), 0.0, bounds)
    watch.observe(Record(7, 1, 3, 1, 1, BETWEEN, 20.0, 1), 25.0, bounds)  # the warm-up step: 20 s, stands in
    assert (bounds.warm, bounds.slowest) == (20.0, 0.0)
    watch.observe(Record(7, 1, 9, 4, 4, STEP, 1.5, 3), 25.1, bounds)  # steps 2 and 3 ran between two looks
    watch.observe(Record(7, 1, 11, 4, 4, BETWEEN, 0.5, 4), 25.2, bounds)
    assert (bounds.slowest, bounds.step()) == (1.5, 7.5)
    watch.observe(Record(7, 1, 12, 4, 4, SAVE, 0.5, 4), 40.0, bounds)
    assert watch.moved == 40.0 and watch.where() == "save of step 4"


def test_a_report_of_another_process_or_an_unchanged_one_is_no_progress() -> None:
    bounds, watch = Bounds(SETTINGS), Watch(pid=7, moved=0.0)
    watch.observe(_record(3, STEP, 9, pid=6), 1.0, bounds)  # the file still holds the previous process's report
    assert not watch.reporting and watch.moved == 0.0
    watch.observe(_record(3, STEP, 9), 2.0, bounds)
    watch.observe(_record(3, STEP, 9), 9.0, bounds)
    assert watch.moved == 2.0 and watch.quiet(9.0) == 7.0


def _watches(now: float, **quiet: tuple[float, int]) -> dict[int, Watch]:
    """rank -> a watch quiet for ``seconds`` in ``section`` (after warm-up)."""
    watches = {}
    for name, (seconds, section) in quiet.items():
        watch = Watch(pid=7, moved=now - seconds)
        watch.record = _record(5, section, 1, begun=5)
        watches[int(name[1:])] = watch
    return watches


def test_who_is_overdue_and_who_may_be_stopped_by_it() -> None:
    bounds = Bounds(SETTINGS)
    bounds.learn(0.5, begun=2)  # a step bound of 3 s
    watches = _watches(100.0, r0=(3.5, STEP), r1=(1.6, STEP), r2=(0.1, STEP), r3=(10.0, SAVE))
    assert overdue(watches, 100.0, bounds) == [0]
    assert stuck(watches, 100.0, bounds) == [0, 1]  # quiet for half its bound: a hang may have stopped it too


def test_one_rank_outside_any_collective_among_waiting_peers_is_the_hang() -> None:
    verdict = judge([0, 1, 2, 3], [], {0: True, 1: False, 2: True, 3: True}, repeated=False)
    assert verdict.kind == HANG and verdict.culprits == [1] and verdict.victims == [0, 2, 3]
    assert judge([1], [0, 2], {1: False}, repeated=False).culprits == [1]  # its peers still move


def test_where_every_rank_waits_the_one_missing_from_its_peers_collective_is_the_hang() -> None:
    """Rank 1 waits in a receive nobody sends; ranks 0 and 2 entered one more collective on their group than it did
    and wait for it there."""
    entered = {0: {7: 12, 9: 3}, 1: {7: 11, 9: 3}, 2: {7: 12}}
    assert behind(entered) == {1} and ahead(entered) == {0, 2}
    missing = behind(entered) - ahead(entered)
    verdict = judge([0, 1, 2], [], {0: True, 1: True, 2: True}, repeated=False, missing=missing)
    assert (verdict.kind, verdict.culprits, verdict.victims) == (HANG, [1], [0, 2])
    assert behind({0: {7: 12}, 1: {7: 12}}) == set()  # nobody missing: every rank stalled alike (below)


def test_every_rank_stalled_alike_is_told_apart_and_never_answered_by_a_replacement() -> None:
    nobody_waits = judge([0, 1], [], {0: False, 1: False}, repeated=False)
    assert nobody_waits.kind == ALL and "outside collectives" in nobody_waits.why
    everybody_waits = judge([0, 1], [], {0: True, 1: True}, repeated=False)
    assert everybody_waits.kind == ALL and everybody_waits.culprits == []
    again = judge([0, 1], [], {0: True, 1: False}, repeated=True)  # a hang at the step of the one just answered
    assert again.kind == ALL and again.culprits == []
    # stopped outside collectives alike, within the bound for that (a file system, a machine slowed for all): waited
    # on; every rank waiting in a collective is no slowdown: answered at once
    assert judge([0, 1], [], {0: False, 1: False}, repeated=False, stalled=False).kind == WAIT
    assert judge([0, 1], [], {0: True, 1: True}, repeated=False, stalled=False).kind == ALL
    assert judge([0, 1], [], {0: True, 1: False}, repeated=True, stalled=False).kind == ALL
    assert judge([0, 1], [], {0: True, 1: False}, repeated=False, stalled=False).kind == HANG  # one rank's hang


def test_ranks_waiting_for_a_peer_within_its_bound_or_on_another_node_are_left_waiting() -> None:
    assert judge([0], [1], {0: True}, repeated=False).kind == WAIT  # rank 1 in a long save
    # rank 1's data loader stalled; ranks 0 and 2 waited for it at the last look; now it moved on and they are not
    # yet past the host sync behind their collective: freed, a full bound from now, never taken for hung
    freed = judge([0, 2], [1], {0: False, 2: False}, repeated=False, waited={0, 2, 3})
    assert (freed.kind, freed.freed, freed.culprits) == (WAIT, [0, 2], [])
    assert judge([0, 2], [1], {0: False, 2: False}, repeated=False, waited={3}).kind == HANG
    assert judge([0, 1], [], {0: True, 1: True}, repeated=False, remote=True, patient=True).kind == WAIT
    assert judge([0, 1], [], {0: True, 1: True}, repeated=False, remote=True, patient=False).kind == ALL


def test_a_node_that_sees_only_its_own_ranks_says_so() -> None:
    """With ranks on other nodes, a node whose every rank stopped outside collectives cannot tell its own hang
    from a file system not answering: it does not claim to know about the others."""
    stopped = judge([1], [], {1: False}, repeated=False, remote=True)
    assert stopped.kind == ALL and "every rank of this node stopped outside collectives" in stopped.why
    assert "not seen from here" in stopped.why and "no rank waits for another" not in stopped.why
    waiting = judge([0], [], {0: True}, repeated=False, remote=True, patient=False)
    assert waiting.kind == ALL and "none is missing from it here" not in waiting.why


STACKS = """Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/ft_plugins/triggers.py", line 85 in watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f0000001234 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/venv/lib/python3.11/site-packages/megatron/core/distributed/distributed_data_parallel.py", line 9 in x
"""


def test_a_main_thread_is_found_in_a_faulthandler_dump_and_its_innermost_frame_says_whether_it_waits() -> None:
    frames = main_frames(STACKS, 0x7F0000001234)
    assert len(frames) == 2 and waits_on_peers(frames)
    assert not waits_on_peers(main_frames(STACKS, 0x7F0000000002))
    assert main_frames(STACKS, 0x1234) == [] and not waits_on_peers([])
    forward = ['File "/m/megatron/core/transformer/attention.py", line 3 in forward',
               'File "/m/megatron/core/distributed/distributed_data_parallel.py", line 9 in forward']
    assert not waits_on_peers(forward)  # a model's forward inside Megatron's DDP wrapper waits for nobody
    # MindSpore: the step's collectives run asynchronously; Python blocks where the train step cell synchronises
    synchronising = ['File "/v/mindspore/common/api.py", line 708 in compile',
                     'File "/v/mindspore/nn/wrap/cell_wrapper.py", line 447 in _no_sens_impl',
                     'File "/v/mindspore/train/model.py", line 1220 in _train_process']
    assert waits_on_peers(synchronising)
    assert not waits_on_peers(['File "/s/train.py", line 70 in on_train_step_end',
                               'File "/v/mindspore/train/model.py", line 1227 in _train_process'])


def test_msrun_s_running_workers_are_numbered_as_msrun_numbers_them(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import faulthandler
    from types import SimpleNamespace

    from ft_plugins.launch.msrun_watch import running_workers

    class Proc:
        def __init__(self, pid: int, code: int | None = None) -> None:
            self.pid, self.code = pid, code

        def poll(self) -> int | None:
            return self.code

    procs = {0: Proc(os.getpid()), 1: Proc(12, -9)}

    def manager(local: int, world: int, node: int) -> SimpleNamespace:
        return SimpleNamespace(local_worker_num=local, worker_num=world, node_rank=node, proc_rank_map=procs)

    assert running_workers(manager(2, 2, -1), str(tmp_path)) == {0: procs[0]}  # one node; the exited one left out
    assert running_workers(manager(2, 8, 3), str(tmp_path)) == {6: procs[0]}  # --node_rank 3
    assert running_workers(manager(2, 8, -1), str(tmp_path)) == {}  # ranks the cluster assigns: none reported yet
    monkeypatch.setattr(faulthandler, "register", lambda *args, **kwargs: None)
    progress.Reporter(str(tmp_path), 5)  # this process reports as rank 5
    assert running_workers(manager(2, 8, -1), str(tmp_path)) == {5: procs[0]}


def test_a_worker_reports_into_a_mapped_file_and_writes_its_stacks_when_asked(tmp_path: Path) -> None:
    code = ("import os, signal, sys, time\n"
            "from ft_plugins import progress\n"
            "assert progress.start(3, {'FT_PLUGINS_PROGRESS': sys.argv[1]})\n"
            "progress.report(progress.STEP, 11)\n"
            "time.sleep(0.2)\n"
            "progress.report(progress.BETWEEN, 11)\n"
            "progress.report(progress.STEP, 12)\n"
            "progress.report(progress.RECOVERY)  # a fault cut step 12 short: it teaches nothing\n"
            "progress.report(progress.STEP)\n"
            "progress.report(progress.BETWEEN, 12)\n"
            "print(progress.read(sys.argv[1], 3).lasted_begun, flush=True)  # still step 11\n"
            "progress.report(progress.STEP, 13)\n"
            "time.sleep(0.3)\n"
            "progress.report(progress.STEP, 14)  # step 13's end not reported: it lasted until step 14 began\n"
            "with progress.within(progress.SAVE):\n"
            "    print(progress.read(sys.argv[1], 3).section_name, flush=True)\n"
            "os.kill(os.getpid(), progress.STACKS_SIGNAL)\n"
            "time.sleep(0.2)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.split() == ["1", "save"], result.stderr
    record = progress.read(str(tmp_path), 3)
    assert record is not None and record[2:6] == (11, 14, 4, STEP)  # set-up, 8 for the steps, save, the step again
    assert 0.3 <= record.lasted < 10 and record.lasted_begun == 3  # step 13 (step 12 a fault cut short)
    assert main_frames(Path(progress.stacks_path(str(tmp_path), 3)).read_text(), record.thread)
    assert progress.read(str(tmp_path), 4) is None


WORKER = ("import os, signal, sys, time\n"
          "from ft_plugins import progress\n"
          "from ft_plugins.triggers import watch_signal\n"
          "assert progress.start(int(sys.argv[2]), {'FT_PLUGINS_PROGRESS': sys.argv[1]})\n"
          "if sys.argv[3] == 'answers':  # a dying gasp that takes a second, then its own exit code\n"
          "    watch_signal(signal.SIGTERM, lambda: (time.sleep(1.0), os._exit(7)), 'gasp')\n"
          "else:  # deaf, as a rank in a driver call\n"
          "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "print('ready', flush=True)\n"
          "while True:\n"
          "    time.sleep(1)\n")


def _workers(directory: Path, *kinds: str) -> list[subprocess.Popen]:
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(directory), str(rank), kind],
                                stdout=subprocess.PIPE, text=True) for rank, kind in enumerate(kinds)]
    assert all(worker.stdout is not None and worker.stdout.readline().strip() == "ready" for worker in workers)
    return workers


def test_a_hung_rank_that_answers_sigterm_gets_the_grace_and_one_deaf_to_it_is_killed(tmp_path: Path) -> None:
    answers, deaf = _workers(tmp_path, "answers", "deaf")
    watchdog.stop([answers, deaf], 10.0, watchdog.answering(str(tmp_path), {answers.pid: 0, deaf.pid: 1}))
    assert (answers.returncode, deaf.returncode) == (7, -signal.SIGKILL)  # its gasp ran to its end
    assert progress.read(str(tmp_path), 0).section == progress.DUMP


def test_negative_control_a_rank_taken_for_deaf_is_killed_in_its_dying_gasp(tmp_path: Path) -> None:
    (answers,) = _workers(tmp_path, "answers")
    watchdog.stop([answers], 10.0, lambda proc: False)
    assert answers.returncode == -signal.SIGKILL


def test_msrun_s_watch_stops_every_worker_stalled_alike_and_the_ones_that_answer_get_the_grace(
        tmp_path: Path) -> None:
    from types import SimpleNamespace

    from ft_plugins.launch.msrun_watch import MsrunWatch

    workers = _workers(tmp_path, "answers", "answers")  # both stopped outside any collective: a file system?
    manager = SimpleNamespace(local_worker_num=2, worker_num=2, node_rank=-1, proc_rank_map=dict(enumerate(workers)))
    watch = MsrunWatch(watchdog.Watchdog(SETTINGS, str(tmp_path)))
    assert watch.look(manager, time.monotonic()) is None  # first sight: each is in set-up, within its bound
    verdict = watch.look(manager, time.monotonic() + 10 * SETTINGS["warmup"])
    assert verdict is not None and verdict.kind == ALL, verdict
    assert [worker.returncode for worker in workers] == [7, 7]  # each one's dying gasp ran to its end


def _worker(code: str, directory: Path) -> subprocess.CompletedProcess:
    """``code`` run as a worker reporting into ``directory`` (its ``sys.argv[1]``), the features off."""
    return subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FT_PLUGINS": "none"})


def test_the_wait_for_a_batch_is_reported_as_data_loading(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from ft_plugins import progress\n"
            "progress.start(0, {'FT_PLUGINS_PROGRESS': sys.argv[1]})\n"
            "from ft_plugins.torch.megatron.hangs import _DataReported\n"
            "class Batches:\n"
            "    def __next__(self):\n"
            "        return progress.read(sys.argv[1], 0).section_name\n"
            "print(next(_DataReported(Batches())), progress.read(sys.argv[1], 0).section_name)\n")
    result = _worker(code, tmp_path)
    assert result.stdout.split() == ["data", "step"], result.stderr


def test_a_long_collection_on_the_main_thread_is_reported_as_gc_then_the_step_again(tmp_path: Path) -> None:
    """The drill's 1 s collection (``kind=slow,at=gc``) is seen from outside as ``gc``; a collection of a younger
    generation, or one on another thread, is not reported."""
    code = """if True:
        import gc, sys, threading
        from ft_plugins import progress
        from ft_plugins.faults import parse_faults, fire
        directory = sys.argv[1]
        progress.start(0, {'FT_PLUGINS_PROGRESS': directory})
        progress.report(progress.STEP, 4)
        seen = []
        look = threading.Timer(0.5, lambda: seen.append(progress.read(directory, 0).section_name))
        look.start()
        fire(parse_faults('rank=0,step=4,kind=slow,at=gc,seconds=1')[0])
        look.join()
        after = progress.read(directory, 0)
        gc.collect(1)
        other = threading.Thread(target=gc.collect)
        other.start(); other.join()
        print(seen[0], after.section_name, after.seq, progress.read(directory, 0).seq)
    """
    result = _worker(code, tmp_path)
    seen, after, seq, later = result.stdout.split()
    assert (seen, after) == ("gc", "step"), result.stderr
    assert seq == later == "4", result.stdout  # set-up, step, gc, step; nothing for the others


def test_options_are_declared_and_a_bad_value_names_the_variable() -> None:
    cfg = load(declared_options(), env={"FT_PLUGINS": "hangs", "FT_PLUGINS_HANGS_FLOOR": "2.5",
                                        "FT_PLUGINS_PROGRESS": "/tmp/x"})
    assert cfg.option("hangs", "floor") == 2.5 and cfg.option("hangs", "warmup_steps") == 2
    with pytest.raises(ConfigError, match="FT_PLUGINS_HANGS_GRACE='-1' is not valid"):
        load(declared_options(), env={"FT_PLUGINS_HANGS_GRACE": "-1"})


def test_asked_for_by_name_only_and_watched_by_torchrun_or_msrun() -> None:
    from ft_plugins.vendors import VendorUnavailable

    hangs = Hangs("pt", DEFAULTS)
    with pytest.raises(VendorUnavailable, match="only when asked for"):
        hangs.start()
    hangs.requested = True
    assert "torchrun; bounds: a step max(1 s, 5 x the slowest step)" in hangs.start()
    on_mindspore = Hangs("ms", DEFAULTS)
    on_mindspore.requested = True
    assert "by ft-plugins run's msrun; bounds:" in on_mindspore.start()


def test_the_run_summary_and_doctor_show_the_bounds() -> None:
    env = {**os.environ, "FT_PLUGINS": "ttp,hangs", "FT_PLUGINS_HANGS_FLOOR": "7"}
    notes = environment.plan(["torchrun", "--nproc-per-node", "2", "train.py"], env=env).notes
    assert any(note.startswith("hangs watched by torchrun: a step max(7 s, 5 x the slowest step)") for note in notes)
    assert not any("hangs" in note for note in environment.plan(["torchrun", "train.py"], env=os.environ).notes)
    notes = environment.plan(["msrun", "--worker_num=2", "--local_worker_num=2", "train.py"], env=env).notes
    assert any(note.startswith("hangs watched by msrun: a step max(7 s,") for note in notes)
    assert any("torchrun or msrun only" in note for note in environment.plan(["python", "train.py"], env=env).notes)
    check = {check.name: check for check in doctor.check_hangs(env)}["hangs"]
    assert check.status == doctor.OK and "max(7 s," in check.detail and "watched" in check.detail


def test_drills_for_hangs_parse() -> None:
    assert parse_faults("rank=1,step=3,kind=stuck,at=collective;rank=0,step=2,kind=slow,at=save,seconds=8") == (
        Fault(1, 3, "stuck", "collective"), Fault(0, 2, "slow", "save", seconds=8))
    assert str(parse_faults("rank=0,step=2,kind=slow")[0]).endswith("kind=slow,at=forward,attempt=0,seconds=10")
    assert parse_faults("rank=2,step=5,kind=slow,at=gc,seconds=3") == (Fault(2, 5, "slow", "gc", seconds=3),)


def _ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores ``signum`` now (Linux: its ``SigIgn`` mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_stuck_drill_ignores_sigterm(tmp_path: Path) -> None:
    code = ("from ft_plugins.faults import Fault, fire\n"
            "print('stuck', flush=True)\n"
            "fire(Fault(0, 0, 'stuck'))\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "stuck"
    deadline = time.monotonic() + 60
    while not _ignores(process.pid, signal.SIGTERM) and time.monotonic() < deadline:  # the drill took SIGTERM off
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert process.poll() is None, "SIGTERM ended it"
    process.kill()
    process.wait()
