"""MindCluster's ``recover`` strategy through MindIO's handlers, outside MindSpeed-LLM.

One real 4-rank torchrun run of Megatron's ``pretrain()`` (CPU, gloo, DP=4), launched as ``ft-plugins run --
torchrun ...`` with ``FT_PLUGINS=ttp,recover`` and the MindIO stand-in on the path (so ttp's MindIO engine is
chosen, ARF switched on): rank 1 is SIGKILLed as step 3 begins; the launcher starts one new process for it,
and the stand-in's controller (tests/fakes/mindio_ttp/arf.py) calls stop and clean on the survivors, waits
for the replacement's ``ARF FINISH``, then rebuild_group, repair and rollback. The survivors keep their
processes, nothing is read from disk, and the final save equals the uninterrupted run's bit for bit.

In-process: a handler called out of order, or for a layout it cannot repair, answers MindIO's failure code
(through the stand-in's own wrapping of the handler) and says why in one line; MindIO's dump path then still
works. The same fault without ft_plugins ends the job (tests/torch_megatron/test_recover.py's negative control, the
same DP=4 launch and fault); with recover off, the old handlers decline and MindIO can only dump.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from support import FAKES
from ttp_runs import DP4, ITERS, Job, assert_no_step_logged_twice, run_with_mindio, same_as_reference

EXIT_PROBE = Path(__file__).resolve().parent / "fixtures" / "exit_probe"
FIRST = 2  # rank 1 dies as the step after 2 completed steps begins
ORDER = ["stop", "clean", "replacement", "rebuild_group", "repair", "rollback"]


@pytest.fixture(scope="module")
def arf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]]]:
    return run_with_mindio(tmp_path_factory.mktemp("mindio_recover"), DP4, "--save-interval", "100",
                           probes=(EXIT_PROBE,), FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=f"rank=1,step={FIRST},kind=kill")


def _controller(calls: list[dict[str, Any]]) -> list[tuple[str, Any, Any]]:
    """What the stand-in's controller did: (action, rank, MindIO's answer) in order."""
    return [(c["api"].removeprefix("fake_controller_"), c["args"][0], c["args"][-1]) for c in calls
            if c["api"].startswith("fake_controller_")]


def test_the_job_ends_with_exit_0_and_the_uninterrupted_runs_final_save(arf_run: tuple[Job, list],
                                                                        dp4_reference: Job) -> None:
    job, _ = arf_run
    assert job.returncode == 0, job.output[-5000:]
    assert len(job.lines("firing injected fault")) == 1
    assert job.tracker() == str(ITERS)
    assert same_as_reference(job, dp4_reference, ITERS) == []  # model, optimizer, scheduler, RNG, counters


def test_the_controller_drove_every_handler_in_mindios_order_and_each_answered_0(arf_run: tuple[Job, list]) -> None:
    _, calls = arf_run
    done = _controller(calls)
    assert not [c for c in calls if c["api"].startswith("fake_processor_")], [  # a refusal, and why
        c for c in calls if c["api"].startswith("fake_processor_")]
    assert [action for action, _, _ in done if action != "replacement"][:1] == ["fault"]
    stages = [action for action, _, _ in done if action != "fault"]
    assert sorted(set(stages), key=stages.index) == ORDER, done
    by_stage = {stage: {rank: answer for action, rank, answer in done if action == stage} for stage in ORDER}
    assert by_stage["stop"] == by_stage["clean"] == {0: 0, 2: 0, 3: 0}, "stop and clean on the survivors only"
    assert by_stage["replacement"] == {1: True}, "the replacement reported ARF FINISH"
    assert by_stage["rebuild_group"] == by_stage["rollback"] == {0: 0, 1: 0, 2: 0, 3: 0}
    assert by_stage["repair"] == {0: 0, 1: 0}, "the source and the one rank lacking the state"
    repair = [c["args"][1] for c in calls if c["api"] == "fake_controller_repair"]
    assert "'repair_type': 'send', 'src': [0], 'dst': [1]" in repair[0] and "'repair_type': 'recv'" in repair[1]


def test_the_survivors_keep_their_processes_one_new_process_joins_through_the_handlers(
        arf_run: tuple[Job, list]) -> None:
    job, calls = arf_run
    started = {c["rank"]: c["pid"] for c in calls if c["api"] == "tft_init_processor"}  # the last start per rank
    first: dict[str, int] = {}
    for c in calls:
        if c["api"] == "tft_init_processor":
            first.setdefault(c["rank"], c["pid"])
    replacement = re.search(r"rank 1 exited with code -9; replacement pid (\d+) started", job.output)
    assert replacement and started["1"] == int(replacement.group(1)) != first["1"], "exactly one new process"
    assert len({c["pid"] for c in calls}) == 5
    for rank in ("0", "2", "3"):
        assert job.lines(f"MindIO stop on rank {rank} (pid {first[rank]})"), f"rank {rank} stopped in its own process"
        assert ("tft_pause_train", first[rank]) in {(c["api"], c["pid"]) for c in calls if c["args"] == [ITERS]}
    assert {(c["api"], c["rank"]) for c in calls if c["api"].startswith("torch_npu.npu.")} == {
        (api, rank) for api in ("torch_npu.npu.stop_device", "torch_npu.npu.restart_device") for rank in "023"}
    assert [c["args"][0] for c in calls if c["api"] == "tft_report_error" and c["pid"] == started["1"]] == [
        "RS_PREREPAIR_FINISH"]
    assert job.lines("MindIO rollback on rank 1 in") and job.lines(
        f"every rank stands at step {FIRST}, training continues at step {FIRST + 1}")


def test_every_rank_the_replacement_too_destroys_its_rebuilt_group_before_the_interpreter_exits(
        arf_run: tuple[Job, list]) -> None:
    """The exit drain (``ft_plugins.torch.clean_exit``) on the groups the repair rebuilt: the replacement, whose
    exit once died with gloo's exit race (SIGABRT after training), and the survivors each leave with no process
    group up (``fixtures/exit_probe``); the rank SIGKILLed never got to exit."""
    job, calls = arf_run
    exits = {c["rank"]: (c["pid"], c["dist_initialized"]) for c in calls if c["api"] == "exit"}
    replacement = re.search(r"rank 1 exited with code -9; replacement pid (\d+) started", job.output)
    assert replacement and len([c for c in calls if c["api"] == "exit"]) == 4, exits
    assert {rank: up for rank, (_, up) in exits.items()} == {"0": False, "1": False, "2": False, "3": False}
    assert exits["1"][0] == int(replacement.group(1))


def test_nothing_read_or_dumped_every_step_trained_once(arf_run: tuple[Job, list]) -> None:
    job, _ = arf_run
    assert not job.lines("loading checkpoint"), "the replacement read nothing from disk"
    assert not job.lines("dumped") and not job.lines("refused")
    assert sorted(path.name for path in job.save.iterdir()) == ["ft_events", "ft_write_speed.json", "iter_0000006",
                                                                "latest_checkpointed_iteration.txt"]
    assert_no_step_logged_twice(job)


# -- in process: refusals, and the dump after them --------------------------------------------------------
@pytest.fixture
def mindio(monkeypatch: pytest.MonkeyPatch, isolated_vendor_modules: None) -> Any:
    """The stand-in's ``framework_ttp`` imported here; every vendor module it brought (taskd's too) is gone
    afterwards."""
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delenv("FT_FAKE_RECORD", raising=False)
    monkeypatch.setenv("RANK", "0")
    import mindio_ttp.framework_ttp as api

    return api


@pytest.mark.parametrize("arf", [True, False], ids=["recovery", "dump"])
def test_the_stand_ins_destroy_calls_end_its_threads_as_mindios_do(mindio: Any, arf: bool, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread of the stand-in still polling its store (a C++ call, the GIL released) when the interpreter
    finalizes is ended inside that call and aborts the process: "terminate called without an active exception"
    at the end of a healthy run."""
    monkeypatch.setenv("FT_FAKE_RECORD", str(tmp_path / "calls.jsonl"))  # the store's file beside it

    def running() -> list[str]:
        return sorted(thread.name for thread in threading.enumerate() if thread.name.startswith("mindio-"))

    mindio.tft_init_controller(0, 2, False, enable_arf=arf)
    mindio.tft_start_controller("127.0.0.1", 0)
    mindio.tft_init_processor(0, 2, False, enable_arf=arf)
    mindio.tft_start_processor("127.0.0.1", 0)
    assert running() == (["mindio-controller", "mindio-processor"] if arf else ["mindio-processor"])
    mindio.tft_destroy_controller()
    mindio.tft_destroy_processor()
    assert running() == []


class Driver:
    """Stands in for ttp's MindIO driver: the groups the handlers reported to MindIO again."""

    def __init__(self) -> None:
        self.reported: list[list[int]] = []

    def report_layout(self, numbering: list[int]) -> None:
        self.reported.append(list(numbering))


class Writer:
    """Stands in for the dump writer: what MindIO's save and rename handlers asked of it."""

    def __init__(self) -> None:
        self.saved: list[Any] = []
        self.committed: list[int] = []

    def save(self, reason: str, frozen: Any, commit: bool = True) -> None:
        self.saved.append(frozen)

    def save_dir(self) -> str:
        return "unused"

    def commit(self, save_dir: str, iteration: int) -> str:
        self.committed.append(iteration)
        return "committed"


@pytest.fixture
def wired(mindio: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Writer]:
    """A worker's MindIO wiring after 2 completed steps (the step tracker inside step 3), every handler registered."""
    from mindio_ttp import arf

    from ft_plugins.steps import StepTracker
    from ft_plugins.torch.megatron import mindio_recover
    from ft_plugins.torch.megatron.mindio import MindioDriver

    tracker, writer = StepTracker(), Writer()
    recovery = mindio_recover.MindioRecovery(SimpleNamespace(settings={"timeout": 5.0}, recoveries=[]),
                                             SimpleNamespace(tracker=tracker, writer=writer))
    recovery.objects = ("model", "optimizer", "scheduler")
    driver = MindioDriver(None, tracker, writer)
    for kind, handler in {"save_ckpt": driver.save, "rename": driver.rename, **recovery.handlers()}.items():
        getattr(mindio, f"tft_register_{kind}_handler")(handler)
    tracker.begin(FIRST, "step 3's payload")
    monkeypatch.setattr(mindio_recover, "megatron_args", lambda: SimpleNamespace(use_distributed_optimizer=False))
    monkeypatch.setattr(mindio_recover, "_data_parallel", lambda: (None, [0, 1, 2, 3]))
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)
    return arf, recovery, writer


def _answer(arf: Any, kind: str, payload: Any = None) -> int:
    """The handler called as MindIO calls it; MindIO's answer (0 done, 1 failed)."""
    from mindio_ttp import framework_ttp

    return arf._run(framework_ttp, kind, payload)


def _repair(**info: Any) -> tuple:
    return FIRST, False, [1], {"type": [0], "repair_type": "send", "src": [0], "dst": [1], "rank_list": [0, 1], **info}


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "refused" in r.getMessage()]


def test_handlers_called_out_of_order_answer_the_failure_code_and_say_why_in_one_line(
        wired: tuple, caplog: pytest.LogCaptureFixture) -> None:
    arf, recovery, _ = wired
    caplog.set_level(logging.ERROR, "ft_plugins.recover")
    assert [_answer(arf, "repair", _repair()), _answer(arf, "rollback", FIRST), _answer(arf, "clean"),
            _answer(arf, "rebuild_group", [1])] == [1, 1, 1, 1]
    assert _refusals(caplog) == [
        f"recover: MindIO {kind} refused on rank 0: {kind} called before any other handler (expected after "
        f"{after}); MindIO falls back to its dump"
        for kind, after in (("repair", "rebuild_group"), ("rollback", "rebuild_group or repair"), ("clean", "stop"),
                            ("rebuild_group", "clean"))]
    assert recovery.stage == "", "a refusal changes nothing"


@pytest.mark.parametrize("layout, info, why", [
    ({"use_distributed_optimizer": True}, {}, "megatron's distributed optimizer in one instance: a lost rank's "
     "optimizer shard has no other holder (FT_PLUGINS_TTP_REPLICAS=2, or --num-distributed-optimizer-instances 2)"),
    ({}, {"type": [1]}, "expert (MoE) optimizer state is not repaired in place yet"),
    ({}, {"repair_type": "load_ckpt"}, "repair type 'load_ckpt' (e.g. a checkpoint load) is not done in place"),
    ({}, {"dst": [5]}, "rank 5 outside this rank's data-parallel group [0, 1, 2, 3]: no replica of this state there"),
], ids=["distributed-optimizer-one-instance", "moe", "checkpoint-load", "outside-the-group"])
def test_a_layout_the_handlers_cannot_repair_is_refused_then_mindios_dump_still_works(
        wired: tuple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, layout: dict, info: dict,
        why: str) -> None:
    arf, recovery, writer = wired
    from ft_plugins.torch.megatron import mindio_recover

    monkeypatch.setattr(mindio_recover, "megatron_args", lambda: SimpleNamespace(
        **{"use_distributed_optimizer": False, **layout}))
    caplog.set_level(logging.ERROR, "ft_plugins.recover")
    recovery.stage = "rebuild_group"
    assert _answer(arf, "repair", _repair(**info)) == 1
    [line] = _refusals(caplog)
    assert line == f"recover: MindIO repair refused on rank 0: {why}; MindIO falls back to its dump"
    assert _answer(arf, "dump", FIRST) == 0  # MindIO's fallback: its save handler, then its rename handler
    [frozen] = writer.saved
    assert (frozen.completed, frozen.torn, frozen.payload) == (FIRST, False, "step 3's payload")
    assert writer.committed == [FIRST]


def test_a_memory_error_is_refused_by_clean_with_mindios_code(wired: tuple, caplog: pytest.LogCaptureFixture) -> None:
    _, recovery, _ = wired
    recovery.stage = "stop"
    assert recovery.clean(True, None, None) == 1
    assert _refusals(caplog) == ["recover: MindIO clean refused on rank 0: a memory error (UCE) on this device is "
                                 "not repaired in place; MindIO falls back to its dump"]


def test_without_recover_the_old_handlers_decline_and_mindio_can_only_dump(mindio: Any) -> None:
    from mindio_ttp import arf

    from ft_plugins.torch.megatron.mindio import _declined

    for kind in ("rebuild_group", "repair", "rollback"):
        getattr(mindio, f"tft_register_{kind}_handler")(_declined(kind))
    assert [_answer(arf, "rebuild_group", [1]), _answer(arf, "repair", _repair()), _answer(arf, "rollback", FIRST)] \
        == [1, 1, 1]



def test_with_elastic_the_downgrade_refuses_what_cannot_scale_in_and_the_upgrade_says_growing_back_is_a_restart(
        mindio: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """MindIO's ZIT handlers, called as MindIO calls them: each refusal answers MindIO's failure code (it then takes
    its dump) and says why in one line; nothing changed (the run at DP=2 itself: test_elastic.py)."""
    from mindio_ttp import arf

    from ft_plugins.steps import StepTracker
    from ft_plugins.torch.megatron import mindio_elastic, mindio_recover

    recovery = mindio_elastic.MindioElastic(SimpleNamespace(settings={"timeout": 5.0}, recoveries=[]),
                                            SimpleNamespace(tracker=StepTracker(), writer=Writer(), mindio=Driver()),
                                            SimpleNamespace(changes=[]))
    recovery.objects = ("model", "optimizer", "scheduler")
    for kind, handler in recovery.handlers().items():
        getattr(mindio, f"tft_register_{kind}_handler")(handler)
    monkeypatch.setattr(mindio_elastic, "megatron_args", lambda: SimpleNamespace(data_parallel_size=2))  # TP=2
    monkeypatch.setenv("WORLD_SIZE", "4")
    caplog.set_level(logging.ERROR, "ft_plugins.recover")
    params = '{"scale-in-strategy": "DP"}'
    assert _answer(arf, "zit_downgrade_rebuild", ([0, 1], [0, 1], params)) == 1  # before stop and clean
    recovery.stage = "clean"
    recovery.resize.cannot = "context parallelism (--context-parallel-size): its groups are not resized yet"
    assert _answer(arf, "zit_downgrade_rebuild", ([0, 1], [0, 1], params)) == 1
    recovery.resize.cannot = ""
    assert _answer(arf, "zit_downgrade_rebuild", ([2, 3], [2, 3], params)) == 1
    assert _answer(arf, "zit_downgrade_rebuild", ([0, 1, 2], [0, 1, 2], params)) == 1
    with pytest.raises(mindio_recover.Refused, match="growing back in place"):
        recovery.upgrade_rebuild([2, 3], None, '{"scale-out-strategy": "DP"}')
    assert recovery.stage == "clean" and recovery.resize.size == 0 and recovery.downgrades == 0
    fallback = "; MindIO falls back to its dump"
    assert _refusals(caplog) == [
        "recover: MindIO zit_downgrade_rebuild refused on rank 0: zit_downgrade_rebuild called before any other "
        "handler (expected after clean)" + fallback,
        "recover: MindIO zit_downgrade_rebuild refused on rank 0: this run cannot go on at a smaller data-parallel "
        "size: context parallelism (--context-parallel-size): its groups are not resized yet" + fallback,
        "recover: MindIO zit_downgrade_rebuild refused on rank 0: rank 0 is not among the ranks MindIO keeps (2, 3)"
        + fallback,
        "recover: MindIO zit_downgrade_rebuild refused on rank 0: MindIO keeps 3 ranks, not whole model replicas of 2"
        + fallback,
        "recover: MindIO zit_upgrade_rebuild refused on rank 0: " + mindio_elastic.GROWING + fallback]


@pytest.fixture
def elastic(mindio: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A worker's MindIO ZIT handlers at rank 0 of 4 (DP=4, one rank a replica) after stop and clean, holding step
    2; its store an in-process one; the stand-in's wrapping of the handlers."""
    from mindio_ttp import arf
    from torch.distributed import HashStore

    from ft_plugins.steps import StepTracker
    from ft_plugins.torch.megatron import mindio_elastic

    recovery = mindio_elastic.MindioElastic(SimpleNamespace(settings={"timeout": 5.0}, recoveries=[]),
                                            SimpleNamespace(tracker=StepTracker(), writer=Writer(), mindio=Driver()),
                                            SimpleNamespace(changes=[]))
    recovery.objects, recovery.stage, recovery.store = ("model", "optimizer", "scheduler"), "clean", HashStore()
    recovery.mine, recovery.replica = (FIRST, None, 8, 0.0), (0,)
    for kind, handler in recovery.handlers().items():
        getattr(mindio, f"tft_register_{kind}_handler")(handler)
    monkeypatch.setattr(mindio_elastic, "megatron_args", lambda: SimpleNamespace(data_parallel_size=4))
    monkeypatch.setenv("WORLD_SIZE", "4")
    return arf, recovery


def _peer_stands(recovery: Any, rank: int, step: int, replica: list[int]) -> None:
    """Rank ``rank``'s standing in the first downgrade, as its own handler writes it."""
    from torch.distributed import PrefixStore

    from ft_plugins.recovery import key

    store = PrefixStore("mindio/downgrade/", recovery._launcher_store())
    store.set(key(1, f"standing/{rank}"), json.dumps([step, 0, replica]))


@pytest.mark.parametrize("step, replica, why", [
    (FIRST - 1, [1], f"the ranks MindIO keeps do not all hold one completed step (rank 0: step {FIRST}, rank 1: "
     f"step {FIRST - 1}): a downgrade hands no state over"),
    (FIRST, [1, 2], "MindIO keeps ranks of model replicas without rank 2: only whole model replicas go on"),
], ids=["steps-differ", "replica-not-whole"])
def test_a_downgrade_the_kept_ranks_disagree_on_is_refused_before_anything_changed(
        elastic: tuple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, step: int,
        replica: list[int], why: str) -> None:
    """Decided alike on every kept rank from what each says of itself, before the size is set or a group rebuilt;
    MindIO's list of kept ranks is taken in rank order, whatever its order."""
    arf, recovery = elastic
    resized: list[int] = []
    monkeypatch.setattr(recovery.resize, "to", lambda size, refuse: resized.append(size))
    _peer_stands(recovery, 1, step, replica)
    caplog.set_level(logging.ERROR, "ft_plugins.recover")
    assert _answer(arf, "zit_downgrade_rebuild", ([1, 0], [1, 0], '{"scale-in-strategy": "DP"}')) == 1
    assert _refusals(caplog) == [f"recover: MindIO zit_downgrade_rebuild refused on rank 0: {why}; MindIO falls back "
                                 "to its dump"]
    assert resized == [] and recovery.downgrades == 0 and recovery.stage == "clean"


def test_a_downgrade_failing_after_the_size_was_set_leaves_nothing_half_set(
        elastic: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups' rebuild fails after the kept ranks agreed: no size stays set for a later handler, no scale-in
    is announced, no repair in place follows (MindIO's rules after a downgrade: the dump)."""
    arf, recovery = elastic
    from ft_plugins import events
    from ft_plugins.torch.megatron.mindio_recover import Refused

    emitted: list[str] = []
    monkeypatch.setattr(events, "emit", lambda kind, **fields: emitted.append(kind))
    monkeypatch.setattr(recovery.resize, "to", lambda size, refuse: setattr(recovery.resize, "size", size) or 4)

    def failing(*args: Any) -> list[str]:
        raise RuntimeError("the store went away")

    monkeypatch.setattr(recovery.regroup, "join", failing)
    monkeypatch.setattr("ft_plugins.torch.megatron.mindio_elastic.megatron_roots", lambda objects: ())
    _peer_stands(recovery, 1, FIRST, [1])
    assert _answer(arf, "zit_downgrade_rebuild", ([0, 1], [0, 1], '{"scale-in-strategy": "DP"}')) == 1
    assert recovery.resize.size == 0 and emitted == [] and recovery.downgrades == 0
    assert recovery.report_layout.__self__.reported == []  # MindIO told nothing new
    recovery.downgrades = 1  # as after one that succeeded
    with pytest.raises(Refused, match="a repair in place after a scale-in"):
        recovery._rebuild([1])


def test_after_a_scale_in_clean_holds_the_groups_at_the_size_they_stand(
        wired: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's ``WORLD_SIZE`` stays the job's first size; MindIO's stop and clean before its dump after a
    downgrade hold the groups as they stand (rank 1 of 2), so that the dump meets no rank that is gone."""
    _, recovery, _ = wired
    from torch.distributed import HashStore

    from ft_plugins.torch.megatron import mindio_recover

    held: list[tuple[int, int]] = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 1)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: 2)
    monkeypatch.setattr(recovery, "_standing", lambda: (FIRST + 1, None))
    recovery.store = HashStore()
    monkeypatch.setattr(mindio_recover, "megatron_roots", lambda objects: ())
    monkeypatch.setattr(recovery.regroup, "hold", lambda rank, world, store, roots: held.append((rank, world)) or [])
    recovery.stage = "stop"
    assert recovery.clean(False, None, None) == 0
    assert held == [(1, 2)]


class Recorded:
    """A MindIO ``framework_ttp`` as a release before ZIT has it (or with it): each call recorded."""

    def __init__(self, zit: bool) -> None:
        self.calls: list[tuple[str, dict]] = []
        kinds = ("save_ckpt", "rename", "exit", "stop", "clean", "repair", "rollback", "rebuild_group", "stream_sync")
        zit_kinds = ("zit_downgrade_rebuild", "zit_upgrade_rebuild", "zit_upgrade_repair", "zit_upgrade_rollback")
        for name in [*(f"tft_register_{kind}_handler" for kind in (*kinds, *(zit_kinds if zit else ()))),
                     "tft_start_controller", "tft_start_processor", "tft_set_optimizer_replica",
                     "tft_set_dp_group_info", "set_mindio_export_version", "tft_init_controller"]:
            setattr(self, name, self._recorder(name))
        if zit:
            def tft_init_processor(rank, world_size, enable_local_copy, enable_tls=True, tls_info="",  # noqa: ANN
                                   enable_uce=True, enable_arf=False, enable_zit=False):
                self.calls.append(("tft_init_processor", {"enable_zit": enable_zit}))
        else:
            def tft_init_processor(rank, world_size, enable_local_copy, enable_tls=True, tls_info="",  # noqa: ANN
                                   enable_uce=True, enable_arf=False):
                self.calls.append(("tft_init_processor", {}))
        self.tft_init_processor = tft_init_processor

    def _recorder(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, kwargs))

    def called(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.mark.parametrize("zit", [True, False], ids=["with-zit", "before-zit"])
def test_a_mindio_before_zit_keeps_recovers_handlers_and_its_dump(
        zit: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With ``elastic`` on, ZIT is switched on and its handlers registered only where MindIO has them: a MindIO
    before ZIT is neither given ``enable_zit`` (a TypeError there had turned the whole MindIO engine off) nor asked
    to register them; the run keeps recover's handlers and the dump, and says so in one line."""
    from ft_plugins.torch.megatron import mindio
    from ft_plugins.vendors.mindio import Endpoint, zit_lacking

    api = Recorded(zit)
    lacking = ("" if zit else "tft_init_processor's enable_zit, tft_register_zit_downgrade_rebuild_handler, "
               "tft_register_zit_upgrade_rebuild_handler, tft_register_zit_upgrade_repair_handler, "
               "tft_register_zit_upgrade_rollback_handler")
    assert zit_lacking(api) == lacking
    told: list[str] = []
    recovery = SimpleNamespace(ZIT=True, without_zit=told.append, replacing=lambda: None,
                               handlers=lambda: {kind: print for kind in (
                                   "stop", "clean", "repair", "rollback", "rebuild_group", "zit_downgrade_rebuild",
                                   "zit_upgrade_rebuild", "zit_upgrade_repair", "zit_upgrade_rollback")})
    driver = mindio.MindioDriver(SimpleNamespace(where=Endpoint("127.0.0.1", "127.0.0.1", 0)), None, None)
    driver.recovery = recovery
    monkeypatch.setattr(mindio, "load_framework_api", lambda: api)
    monkeypatch.setattr(mindio.TorchProcess, "rebooted", lambda self: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MINDX_TASK_ID", raising=False)
    assert driver.initialize_distributed(lambda: "initialized", None, (), {}) == "initialized"
    assert driver.process is not None, "the MindIO engine stays on"
    assert [kwargs for name, kwargs in api.calls if name == "tft_init_processor"] == [
        {"enable_zit": True} if zit else {}]
    assert told == ([] if zit else [lacking])
    driver.process.wire(0, [], [0], {**recovery.handlers(), "save_ckpt": print, "rename": print, "exit": print,
                                     "stream_sync": print})
    registered = [name for name in api.called() if name.startswith("tft_register_zit_")]
    assert len(registered) == (4 if zit else 0), api.called()


def test_a_failed_step_stops_children_ending_raising_in_the_main_thread_unless_recover_may_repair_it() -> None:
    """Without recover the main thread only waits for MindIO's dump and exit, while torchrun ends the data
    loader workers (torch's SIGCHLD handler would raise in that wait); a process that may be repaired
    trains on and keeps the data loader's watch on its workers."""
    from ft_plugins.steps import StepTracker
    from ft_plugins.torch.megatron.mindio import MindioDriver

    def data_loader(signum: int, frame: Any) -> None:  # what torch's DataLoader installs
        raise RuntimeError("DataLoader worker is killed by signal: Terminated.")

    previous = signal.signal(signal.SIGCHLD, data_loader)
    try:
        repairable = MindioDriver(None, StepTracker(), Writer())
        repairable.recovery = object()
        repairable.step_failed()
        assert signal.getsignal(signal.SIGCHLD) is data_loader
        MindioDriver(None, StepTracker(), Writer()).step_failed()
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGCHLD, previous)
