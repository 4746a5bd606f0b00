"""The ft_plugins demo: a real 2-rank Megatron GPT pretrain() on CPU, with ft_plugins on by one import.

Run 1 is what this machine really has: no Ascend runtime, so TaskD and mstx say they are off and
why, and training is untouched. Run 2 puts the recording stand-ins of TaskD and torch_npu from
``tests/fakes`` on the path (clearly simulated: they record calls instead of profiling), launched
through ``ft-plugins run`` with no import in the entry script, to show
what ft_plugins does on an Ascend node: which TaskD calls each rank made, and which ranges.
Run 3 damages the newest checkpoint of run 2 as a crash during a save can, then restarts with
``--load``: Megatron alone fails on it; with ft_plugins the job skips it, says why, and resumes
from the newest intact one.
Run 4 kills a rank in the middle of a job whose periodic saves are far away, then launches the
same command again: Megatron alone starts from scratch; with ``FT_PLUGINS=ttp,resume`` the
survivor dumps the last completed step and the relaunch resumes from it. One line each: steps
lost, time to dump, time back to the step where the fault hit.
Run 5 is the same fault under ``ft-plugins run`` with ``FT_PLUGINS=ttp,recover``: the job never
stops. torchrun replaces only the lost worker, the survivor keeps its process and sends the new one
the state of the last completed step, and the job ends with exit 0, no checkpoint read or written; then
``ft-plugins report`` on its save directory: goodput, and what the fault cost.

    python examples/megatron_gpt/demo.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKES = REPO / "tests" / "fakes"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LOAD_ERROR = "could not load the checkpoint"  # megatron's message when its load fails
FT_RUN = (sys.executable, "-m", "ft_plugins.cli", "run", "--")  # `ft-plugins run --`, this interpreter's


def train(workdir: Path, simulate_ascend: bool, *extra: str, iters: int = 6, must_succeed: bool = True,
          launcher: tuple[str, ...] = ()) -> tuple[int, dict[int, dict], list[str]]:
    """One 2-rank run into ``workdir`` (``launcher`` before torchrun): exit code, each rank's ft_plugins
    report, the log lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE"))}
    if simulate_ascend:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKES), env.get("PYTHONPATH")]))
        env["FT_FAKE_RECORD"] = str(workdir / "vendor_calls.jsonl")
    command = [*launcher, TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(HERE / "pretrain_gpt.py"),
               "--train-iters", str(iters), "--save", str(workdir / "checkpoints"), "--save-interval", "3",
               "--ft-report-dir", str(workdir / "reports"), *extra]
    log = workdir / "train.log"
    with log.open("w") as handle:
        result = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=workdir)
    if result.returncode != 0 and must_succeed:
        sys.exit(f"training failed (exit {result.returncode}); see {log}")
    lines = log.read_text().splitlines()
    reports = {int(p.stem.split("_")[1]): json.loads(p.read_text())
               for p in sorted((workdir / "reports").glob("*.json"))}
    return result.returncode, reports, lines


def show_command(*args: str) -> None:
    """``ft-plugins ARGS``, run and shown as on a terminal."""
    print(f"\n  $ ft-plugins {' '.join(args)}")
    result = subprocess.run([sys.executable, "-m", "ft_plugins.cli", *args], capture_output=True, text=True)
    print("\n".join(f"  {line}" for line in (result.stdout + result.stderr).splitlines()))


def show_log(lines: list[str], *markers: str) -> None:
    print("\n".join(f"    {line.strip()}" for line in lines
                    if line.startswith("[ft_plugins") or any(marker in line for marker in markers)))


def crash_after_save(checkpoints: Path) -> Path:
    """What a node failure during the last save can leave: the tracker names iteration 6, but
    rank 0's model file of that iteration lost its second half."""
    damaged = checkpoints / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt"
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    return damaged


def show(reports: dict[int, dict]) -> None:
    for rank, report in reports.items():
        for name, entry in report.items():
            state = "on " if entry["enabled"] else "off"
            detail = entry["activity"] if entry["enabled"] else entry["reason"]
            print(f"  rank {rank}  {name:6} {state}  {detail}")


def show_vendor_calls(record: Path) -> None:
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    for rank in sorted({c["rank"] for c in calls}, key=str):  # None: the torchrun launcher itself
        mine = [c for c in calls if c["rank"] == rank]
        taskd = [f"{c['api']}({', '.join(map(repr, c['args']))})" for c in mine if "taskd" in c["api"]]
        ranges = Counter(c["args"][0].split()[0] for c in mine if c["api"] == "mstx.range_start")
        steps = [c["args"][0] for c in mine if c["api"] == "mstx.range_start" and c["args"][0].startswith("step")]
        print(f"  {'launcher' if rank is None else f'rank {rank}'}: {'; '.join(taskd)}")
        print(f"          mstx ranges: {dict(ranges)}  ({', '.join(steps)} on the current stream)")


def _resume_from(workdir: Path) -> tuple[str, ...]:
    return "--load", str(workdir / "checkpoints"), "--override-opt_param-scheduler"


def _iterations(lines: list[str], iters: int) -> list[tuple[int, datetime]]:
    """(iteration, time) of Megatron's progress lines, found anywhere in a line (two ranks' output may share one)."""
    progress = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/" + f"{iters:8d} \\|")
    found = (progress.search(line) for line in lines)
    return [(int(match.group(2)), datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f"))
            for match in found if match]


def dying_gasp_act(workdir: Path, iters: int = 8, fault_step: int = 5) -> None:
    """A rank SIGKILLed as step ``fault_step + 1`` starts; the same command is then launched again,
    as a scheduler would (over torchrun's default static rendezvous, ``--max-restarts`` restarts fail to
    rebuild the gloo groups, ft_plugins or not; ``--standalone`` with a fresh store per attempt works, as
    tests/torch_megatron/test_auto_restart.py shows in one command)."""
    fault = f"rank=1,step={fault_step},kind=kill"
    print(f"\n== Run 4: FT_PLUGINS_INJECT_FAULT={fault!r} (rank 1 SIGKILLed after {fault_step} completed steps),"
          " periodic saves every 100 steps, then the same command again")
    for label, features in (("Megatron alone  ", "none"), ("with ft_plugins ", "ttp,resume")):
        run = workdir / f"dying_gasp_{features.replace(',', '_')}"
        run.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE"))}
        env["FT_PLUGINS"] = features
        save = str(run / "checkpoints")
        command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
                   str(HERE / "pretrain_gpt.py"), "--train-iters", str(iters), "--save", save, "--load", save,
                   "--save-interval", "100"]
        logs = []
        for attempt, extra in enumerate(({"FT_PLUGINS_INJECT_FAULT": fault}, {})):
            log = run / f"train_{attempt}.log"
            with log.open("w") as handle:
                subprocess.run(command, env={**env, **extra}, stdout=handle, stderr=subprocess.STDOUT, cwd=run)
            logs.append(log.read_text().splitlines())
        before, after = _iterations(logs[0], iters), _iterations(logs[1], iters)
        lost = before[-1][0] - (after[0][0] - 1)
        back = next(stamp for number, stamp in after if number == fault_step + 1) - before[-1][1]
        dump = next((line.split(" in ")[1].split(" ms")[0] for line in logs[0] if "dumped mp_rank_00" in line), None)
        dumped = f"dump {dump} ms after the fault" if dump else "no dump"
        print(f"  {label} steps lost: {lost}; {dumped}; step {fault_step + 1} done again "
              f"{back.total_seconds():.1f} s after step {fault_step} (relaunch included); logs in {run}")


def in_place_act(workdir: Path, iters: int = 8, fault_step: int = 5) -> None:
    """Run 4's fault once more, recovered in place: one command, no relaunch, no checkpoint."""
    fault = f"rank=1,step={fault_step},kind=kill"
    print("\n== Run 5: the same fault under `ft-plugins run` with FT_PLUGINS=ttp,recover (in-place recovery)")
    run = workdir / "in_place"
    run.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE"))}
    env.update(FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=fault)
    save = run / "checkpoints"
    command = [*FT_RUN, TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(HERE / "pretrain_gpt.py"), "--train-iters", str(iters), "--save", str(save),
               "--save-interval", "100"]
    log = run / "train.log"
    with log.open("w") as handle:
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=run).returncode
    lines = log.read_text().splitlines()
    show_log([line for line in lines if "recover:" in line])
    steps = [number for number, _ in _iterations(lines, iters)]
    written = sorted(path.name for path in save.glob("iter_*")) if save.exists() else []
    print(f"  exit code {code}; steps trained {steps[0] if steps else '-'}..{steps[-1] if steps else '-'} "
          f"({len(steps)} progress lines for {iters} steps); checkpoints written: {', '.join(written) or 'none'} "
          f"(only pretrain()'s final save); logs in {run}")
    print("\n  what the fault cost, from the events every process of the job wrote beside its checkpoints:")
    show_command("report", str(save))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    workdir = parser.parse_args().workdir or Path(tempfile.mkdtemp(prefix="ft_plugins_demo_"))
    real, simulated = workdir / "this_machine", workdir / "simulated_ascend"
    alone, resumed = workdir / "crash_megatron_alone", workdir / "crash_with_ft_plugins"
    for directory in (real, simulated, alone, resumed):
        directory.mkdir(parents=True, exist_ok=True)

    print("== Run 1: this machine (no Ascend runtime), `import ft_plugins.torch` in the entry script")
    _, reports, lines = train(real, simulate_ascend=False)
    show_log(lines)
    show(reports)

    print("\n== Run 2: simulated Ascend node (recording stand-ins of TaskD and torch_npu from tests/fakes),"
          "\n   launched as `ft-plugins run -- torchrun ...` with no ft_plugins import in the entry script")
    _, reports, lines = train(simulated, True, "--no-ft-plugins-import", launcher=FT_RUN)
    show_log(lines)
    show(reports)
    print("\n  vendor calls recorded:")
    show_vendor_calls(simulated / "vendor_calls.jsonl")

    damaged = crash_after_save(simulated / "checkpoints")
    print(f"\n== Run 3: restart after a crash that left {damaged.relative_to(simulated)} cut in half")
    print(f"  (tracker still says {(simulated / 'checkpoints' / 'latest_checkpointed_iteration.txt').read_text().strip()})")
    show_command("ckpt", "latest", str(simulated / "checkpoints"), "--json")
    for copy in (alone, resumed):
        shutil.copytree(simulated / "checkpoints", copy / "checkpoints", dirs_exist_ok=True)
    print("\n  Megatron alone (--no-ft-plugins-import), --load checkpoints:")
    code, _, lines = train(alone, False, *_resume_from(alone), "--no-ft-plugins-import", iters=9,
                           must_succeed=False)
    trained = sum(1 for line in lines if " iteration " in line and "/       9 |" in line)
    # each rank says it; two ranks' output can share one line, so count the message, not the lines
    said = sum(line.count(LOAD_ERROR) for line in lines)
    failure = f"megatron said {LOAD_ERROR!r} on {said} rank{'s' if said > 1 else ''}" if said else "no load error"
    print(f"    exit code {code}, {trained} iterations trained; {failure}")
    print("\n  with ft_plugins, the same command:")
    code, reports, lines = train(resumed, False, *_resume_from(resumed), iters=9)
    show_log(lines, "iteration        9/", "loaded checkpoint from")
    show({rank: {"resume": report["resume"]} for rank, report in reports.items()})
    dying_gasp_act(workdir)
    in_place_act(workdir)
    print(f"\nlogs, checkpoints and reports: {workdir}")


if __name__ == "__main__":
    main()
