"""The MindIO engine on one real torchrun gloo run of Megatron's ``pretrain()`` (DP=2, ``--ckpt-format
torch``) with the fake MindIO on the path (tests/fakes/mindio_ttp: PyTorch's handler signatures, a
controller thread that dumps on a reported error). Rank 1 is SIGKILLed as step 4 begins; the fake
controller makes the survivor save and rename, and the committed dump must equal the uninterrupted
reference run's save of step 3; a plain ``--load`` relaunch (MindIO engine on, no fault) ends equal
to the reference. The recorded calls show MindSpeed-LLM's wiring order. Further runs: rank 0 killed,
the victim killed inside its update, SIGTERM inside an update (MindIO makes SIGTERM do nothing), and
MindSpeed-LLM's native high availability switched on (``ttp`` steps aside). The fake's controller
lives in every process; the real one runs on rank 0 or, under MindCluster (``MINDX_TASK_ID``), in
TaskD's process, so a rank 0 death without TaskD takes MindIO's controller with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from support import FAKES, path_first, read_records
from ttp_runs import ITERS, Job, committed_dump, resumed_to_the_end, run_job, same_as_reference

STEP = 3  # completed steps when rank 1 dies
FAR = ("--save-interval", "100")  # no periodic save: whatever is not lost is the dump's doing
HANDLERS = ["save_ckpt", "rename", "exit", "stop", "clean", "repair", "rollback", "rebuild_group", "stream_sync"]
UPDATE_CALLS = ("tft_start_updating_os", "tft_end_updating_os", "tft_pause_train")
MINDSPEED_ENTRY = Path(__file__).resolve().parent / "fixtures" / "mindspeed_entry.py"


def _with_mindio(record: Path) -> dict[str, str]:
    path = path_first(FAKES)
    return {"PYTHONPATH": path, "FT_FAKE_RECORD": str(record), "FT_PLUGINS": "ttp,resume", "TTP_ADDR": "127.0.0.1"}


@pytest.fixture(scope="module")
def mindio_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("mindio")
    record = workdir / "mindio.jsonl"
    job = run_job(workdir, *FAR, **_with_mindio(record), FT_PLUGINS_INJECT_FAULT=f"rank=1,step={STEP},kind=kill")
    return job, read_records(record)


def _scenario(tmp_path_factory: pytest.TempPathFactory, name: str, *faults: str, entry: Path | None = None,
              **env: str) -> tuple[Job, list[dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp(name)
    record = workdir / "mindio.jsonl"
    mindio = _with_mindio(record)
    if entry is not None:  # a MindSpeed-LLM-shaped entry: its package beside the entry script
        mindio["PYTHONPATH"] = os.pathsep.join([str(entry.parent), mindio["PYTHONPATH"]])
    job = run_job(workdir, *FAR, **({"entry": entry} if entry else {}), **mindio, **env,
                  **({"FT_PLUGINS_INJECT_FAULT": ";".join(faults)} if faults else {}))
    return job, read_records(record) if record.exists() else []


@pytest.fixture(scope="module")
def resumed(mindio_run: tuple[Job, list]) -> Job:
    """Megatron's plain ``--load`` on the dump, the MindIO engine on again, no fault."""
    save = mindio_run[0].save
    return run_job(save.parent, "--load", str(save), *FAR, save=save, **_with_mindio(save.parent / "resumed.jsonl"))


def _of(calls: list[dict[str, Any]], rank: str) -> list[dict[str, Any]]:
    return [call for call in calls if call["rank"] == rank]


def _dumps(calls: list[dict[str, Any]], rank: str) -> list[tuple[str, Any]]:
    """What the controller had ``rank`` do: its save and rename calls with their step, in order (the loss may
    reach the controller before or after the rank's own error report)."""
    return [(c["api"], c["args"][0]) for c in _of(calls, rank) if c["api"].startswith("fake_controller_")]


def test_one_log_line_names_the_engine_rank_0_speaks_for_the_job(mindio_run: tuple[Job, list]) -> None:
    job, _ = mindio_run
    assert len(job.lines("ttp enabled (engine mindio (mindio_ttp is installed): MindIO TTP controller "
                         "127.0.0.1:8000, TLS off)")) == 1, job.output[-3000:]


def test_controller_on_rank0_and_processors_start_before_init_process_group(mindio_run: tuple[Job, list]) -> None:
    _, calls = mindio_run
    for rank in ("0", "1"):
        started = [(c["api"], c["args"], c["kwargs"]) for c in _of(calls, rank) if not c["dist_initialized"]]
        controller = [("tft_init_controller", [0, 2, False], {"enable_arf": False, "enable_zit": False}),
                      ("tft_start_controller", ["127.0.0.1", 8000, False, ""], {})]
        processor = [("tft_init_processor", [int(rank), 2, False, False, ""],
                      {"enable_uce": True, "enable_arf": False, "enable_zit": False}),
                     ("tft_start_processor", ["127.0.0.1", 8000, ""], {})]
        assert started == (controller if rank == "0" else []) + processor


def test_replicas_groups_handlers_and_train_wired_once_the_optimizer_exists(mindio_run: tuple[Job, list]) -> None:
    _, calls = mindio_run
    for rank in (0, 1):
        wired = [(c["api"], c["args"]) for c in _of(calls, str(rank))
                 if c["dist_initialized"] and c["api"] not in UPDATE_CALLS][:len(HANDLERS) + 4]
        assert [api for api, _ in wired] == ["tft_set_optimizer_replica", "tft_set_dp_group_info",
                                             *(f"tft_register_{kind}_handler" for kind in HANDLERS),
                                             "set_mindio_export_version", "tft_exception_handler"]
        assert wired[0][1] == [rank, repr([{"rank_list": [0, 1], "replica_cnt": 2, "replica_shift": 0}])]
        assert wired[1][1] == [rank, repr([0, 1])]
        assert (wired[2][1], wired[3][1]) == (["save"], ["rename"])
        assert (wired[-2][1], wired[-1][1]) == (["MindSpeed-LLM"], ["train"])


def test_the_layout_is_reported_in_mindios_numbering_after_the_ranks_were_numbered_anew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a downgrade torch's ranks 0 and 1 are MindIO's 2 and 5: the data-parallel group and the optimizer's
    replicas go to MindIO as it numbers them, so that its choice of dump ranks reads the groups as they stand."""
    from ft_plugins.torch.megatron import mindio

    monkeypatch.setattr("torch.distributed.get_rank", lambda: 1)
    monkeypatch.setattr("torch.distributed.get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(mindio, "megatron", lambda name: SimpleNamespace(get_data_parallel_group=lambda: "dp"))
    monkeypatch.setattr(mindio, "megatron_args", lambda: SimpleNamespace(use_distributed_optimizer=True,
                                                                         num_distributed_optimizer_instances=2))
    assert mindio.layout([2, 5]) == (5, [{"rank_list": [2, 5], "replica_cnt": 2, "replica_shift": 0}], [2, 5])
    assert mindio.layout() == (1, [{"rank_list": [0, 1], "replica_cnt": 2, "replica_shift": 0}], [0, 1])


def test_each_update_bracketed_and_reported_as_the_step_it_completes(mindio_run: tuple[Job, list]) -> None:
    _, calls = mindio_run
    for rank in ("0", "1"):
        reported = [(c["api"], c["args"]) for c in _of(calls, rank) if c["api"] in UPDATE_CALLS]
        assert reported == [call for step in range(1, STEP + 1) for call in (
            ("tft_start_updating_os", [-1]), ("tft_end_updating_os", [step]), ("tft_pause_train", [step]))]


def test_fake_controller_drives_the_survivors_dump_bit_identical_to_a_normal_save(
        mindio_run: tuple[Job, list], reference: Job) -> None:
    job, calls = mindio_run
    committed_dump(job, STEP)
    assert ("tft_report_error", "RS_UNKNOWN") in [(c["api"], c["args"][0]) for c in _of(calls, "0")]
    assert _dumps(calls, "0") == [("fake_controller_save", STEP), ("fake_controller_rename", STEP)]
    assert job.lines(f"MindIO dump of step {STEP}: rank 0 dumped mp_rank_00 of iteration {STEP} in")
    assert job.lines(f"MindIO rename of step {STEP}: committed: {job.iteration(STEP)}")
    assert same_as_reference(job, reference, STEP) == []

def test_plain_load_resumes_at_k_plus_one_and_ends_bit_identical(resumed: Job, reference: Job) -> None:
    resumed_to_the_end(resumed, reference, STEP)


def test_rank0_killed_the_survivor_dumps_and_commits(tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job, calls = _scenario(tmp_path_factory, "mindio_rank0", f"rank=0,step={STEP},kind=kill")
    committed_dump(job, STEP)
    assert job.lines(f"MindIO dump of step {STEP}: rank 1 dumped mp_rank_00 of iteration {STEP} in")
    assert _dumps(calls, "1") == [("fake_controller_save", STEP), ("fake_controller_rename", STEP)]
    assert same_as_reference(job, reference, STEP) == []


def test_victim_killed_in_its_update_the_survivor_dumps_the_step_it_completed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    """Every gradient of step 4 was reduced before the victim died, so the survivor may complete its update of step
    4 (its update has no collective) or be refused it, when the controller's dump began first
    (``tft_start_updating_os`` raises under a dump, as MindIO's does): which one is a race between the survivor
    reaching its update and the controller noticing the loss. Either way the dump holds exactly the last step
    the survivor reported completed, never a half-updated state."""
    job, calls = _scenario(tmp_path_factory, "mindio_kill_in_update", f"rank=1,step={STEP},kind=kill,at=update")
    survivor = [(c["api"], c["args"]) for c in _of(calls, "0")]
    completed = max(args[0] for api, args in survivor if api == "tft_end_updating_os")
    began = [args for api, args in survivor if api == "tft_start_updating_os"]
    assert (completed, len(began)) in ((STEP + 1, STEP + 1), (STEP, STEP + 1)), survivor
    committed_dump(job, completed)
    assert _dumps(calls, "0") == [("fake_controller_save", completed), ("fake_controller_rename", completed)]
    assert same_as_reference(job, reference, completed) == []


def test_sigterm_inside_an_update_does_nothing_as_mindio_makes_it_and_training_ends_unharmed(
        tmp_path_factory: pytest.TempPathFactory, reference: Job) -> None:
    job, calls = _scenario(tmp_path_factory, "mindio_term", f"rank=1,step={STEP},kind=term,at=update")
    assert job.returncode == 0, job.output[-3000:]
    assert job.lines(f"firing injected fault rank=1,step={STEP},kind=term,at=update")
    assert not [c for c in calls if c["api"].startswith("fake_controller")], "no dump"
    assert same_as_reference(job, reference, ITERS) == []  # the final save: nothing half-updated, nothing lost


def test_native_high_availability_on_ttp_steps_aside_on_a_real_run(tmp_path_factory: pytest.TempPathFactory,
                                                                   reference: Job) -> None:
    """MindSpeed-LLM's own train loop (by-name copies), with the variable MindCluster sets for its native HA."""
    job, calls = _scenario(tmp_path_factory, "mindio_native_ha", entry=MINDSPEED_ENTRY, HIGH_AVAILABILITY="dump")
    assert job.returncode == 0, job.output[-3000:]
    assert job.lines("mindspeed-shaped train loop running")
    assert len(job.lines("ttp requested but disabled: MindSpeed-LLM's native high availability "
                         "(HIGH_AVAILABILITY=dump) is on: "
                         "its own dying-gasp wiring runs, ttp steps aside")) == 1, job.output[-3000:]
    made = [c["api"] for c in calls if c["api"].startswith(("tft_", "set_mindio"))]
    assert made == [], "ft_plugins made no MindIO call"
    assert same_as_reference(job, reference, ITERS) == []
