"""The Trainer's dying gasp on real 2-rank torchrun runs (gloo, CPU), chained: each run resumes with plain
``resume_from_checkpoint=True`` from the checkpoint the previous fault left, the last one ends
bit-identical (model and optimizer) to the uninterrupted reference. Faults: rank 1 SIGKILLed in forward,
in its optimizer update, while writing its part of a save, and SIGTERM to torchrun while a rank hangs.
Negative control: the same faults without ft_plugins, in one torchrun launch restarting its workers after each
(each attempt resumes stock-style from what the previous one left): every step since the last periodic save lost,
and the save the kill interrupted left without rank 1's RNG file (stock resumes from it all the same: transformers
says so at info level only)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from hf_runs import Job, run_trainer, same_state, start_trainer

from ft_plugins.checkpoint import verify
from ft_plugins.checkpoint.manifest import MANIFEST

TTP = {"FT_PLUGINS": "resume,ttp"}
ARGS = ("--save-steps", "4")
# (fault, the checkpoint the survivor writes): K = the steps every rank completed
CHAIN = (("rank=1,step=3,kind=kill,at=forward", 3),
         ("rank=1,step=5,kind=kill,at=update", 6),  # rank 0 completes step 6: its update has no collective
         ("rank=1,step=8,kind=kill,at=save", 8))  # replaces the checkpoint-8 the fault left incomplete


def _dumped(job: Job, step: int) -> None:
    dumps = job.lines("dumped")
    assert job.returncode != 0 and len(dumps) == 1, job.output[-4000:]
    assert f"checkpoint-{step} in" in dumps[0] and dumps[0].endswith("committed")
    checkpoint = job.checkpoint(step)
    assert (checkpoint / MANIFEST).exists() and verify(checkpoint).intact
    assert {f"rng_state_{rank}.pth" for rank in (0, 1)} <= {path.name for path in checkpoint.iterdir()}


# stock, one launch: torchrun restarts the workers after each kill (TORCHELASTIC_RESTART_COUNT = the attempt)
STOCK_CHAIN = ("rank=1,step=3,kind=kill,at=forward", "rank=1,step=5,kind=kill,at=update,attempt=1",
               "rank=1,step=8,kind=kill,at=save,attempt=2", "rank=1,step=10,kind=hang,attempt=3")


def _sigterm_while_rank_1_hangs(workdir: Path, out: Path, fault: str, launcher: tuple[str, ...] = (),
                                **env: Any) -> Job:
    """Started with ``fault`` (the last one a hang), SIGTERM to torchrun once the hang fires."""
    process, final = start_trainer(workdir, out, *ARGS, launcher=launcher, FT_PLUGINS_INJECT_FAULT=fault, **env)
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if "firing injected fault" in line and "kind=hang" in line:
            process.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both ranks
            break
    rest, _ = process.communicate(timeout=300)
    return Job(process.returncode, "".join(lines) + rest, out, final)


def _stock_chain_loses_every_step_since_the_last_save(workdir: Path) -> None:
    stock = _sigterm_while_rank_1_hangs(workdir, workdir / "stock", ";".join(STOCK_CHAIN), ft=False,
                                        launcher=("--standalone", "--max-restarts", str(len(STOCK_CHAIN) - 1)))
    fired = stock.lines("firing injected fault")
    why = [line for line in stock.output.splitlines() if "rror" in line or "exitcode" in line or "Traceback" in line]
    assert stock.returncode != 0 and len(fired) == len(STOCK_CHAIN), (stock.returncode, fired, why[:40])
    assert all(f"attempt={attempt}" in line for attempt, line in enumerate(fired))
    assert not stock.lines("dumped")
    # forward at 3: nothing (ft_plugins: checkpoint-3); update at 5: back to 4 (ft_plugins: 6); save of 8: a
    # checkpoint-8 without rank 1's part (ft_plugins: a whole one); SIGTERM at 10: back to 8 (ft_plugins: 10).
    # Only the periodic saves remain, the last one incomplete.
    assert sorted(path.name for path in stock.out.glob("*checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert (stock.checkpoint(4) / "rng_state_1.pth").exists()
    assert not (stock.checkpoint(8) / "rng_state_1.pth").exists()


def test_each_fault_leaves_the_last_completed_step_and_the_chain_ends_bit_identical(
        reference: Job, tmp_path: Path) -> None:
    _stock_chain_loses_every_step_since_the_last_save(tmp_path)
    out = tmp_path / "out"
    for number, (fault, step) in enumerate(CHAIN):
        job = run_trainer(tmp_path, out, *ARGS, FT_PLUGINS_INJECT_FAULT=fault, **TTP)
        _dumped(job, step)
        if number:
            assert job.lines(f"newest checkpoint {out / f'checkpoint-{CHAIN[number - 1][1]}'} is intact")
    job = _sigterm_while_rank_1_hangs(tmp_path, out, "rank=1,step=10,kind=hang", **TTP)
    _dumped(job, 10)
    assert job.lines("SIGTERM: rank")
    assert not job.lines("no RNG state came from")  # both ranks alive: each RNG file is the rank's own
    final = run_trainer(tmp_path, out, *ARGS, **TTP)
    assert final.returncode == 0 and final.lines(f"newest checkpoint {out / 'checkpoint-10'} is intact"), \
        final.output[-3000:]
    assert same_state(reference.final, final.final) == []


def test_a_rank_leaving_through_sys_exit_mid_training_ends_the_job_and_rank_0_dumps(tmp_path: Path) -> None:
    """A script's own ``sys.exit`` on rank 1 in step 4: the exit drain stands aside (its barrier would meet
    rank 0's next collective and both would wait for gloo's timeout, 30 minutes), rank 0's collective fails at
    once and it dumps checkpoint-3."""
    job = run_trainer(tmp_path, tmp_path / "out", *ARGS, timeout=240, **TTP,
                      FT_PLUGINS_INJECT_FAULT="rank=1,step=3,kind=exit")
    assert job.lines("kind=exit"), job.output[-4000:]
    _dumped(job, 3)
