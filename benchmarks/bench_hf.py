"""Cost of ft_plugins on a Hugging Face Trainer (one process, CPU, the tiny GPT-2 of examples/hf_trainer).

  steps  per optimizer step, every feature that runs here (mstx on its no-op backend, resume, ttp's
         built-in engine) against none, interleaved in one process so that the machine's load drifts
         alike for both: ``--blocks`` times, three short training runs of ``--steps`` steps each, off /
         on / off (``ft_plugins.torch.disable()`` / ``enable()`` between them, a fresh Trainer each),
         one intra-op thread (on a shared machine, torch's thread pool waiting on descheduled threads
         swamps everything else). A run's figure is its median step, from one step's end to the next (so
         ``train()``'s ~0.2 s of set-up and a step slowed by another job do not count), by the wall clock
         and by the process's CPU time (less moved by other jobs sharing the machine). Each block gives the
         ratio on / mean of its two offs, and the A/A ratio off / off (the noise floor); prints the median
         and range of both, and the fastest run with the hooks against the fastest without.
  hooks  in one process: the hooks' own work per optimizer step, timed directly (robust to machine noise)
  dump   in one process: the dying gasp's writer (model, optimizer, scheduler, RNG files,
         trainer_state.json, then the manifest) against the Trainer's own ``_save_checkpoint`` of the
         same state (without the commit), fastest of ``--saves``.
  instructions  (``--instructions S1,S2``, needs valgrind) the whole step as instructions executed, which
         neither the machine's load nor its clock moves: one training process per run under callgrind,
         S1 and S2 steps, with every feature and with none; a step's count is (I(S2) - I(S1)) / (S2 - S1),
         so set-up cancels out (string hashing fixed, so that dictionaries are laid out alike). Four runs of
         minutes each, two at a time.

    python benchmarks/bench_hf.py [--steps 40] [--blocks 9] [--saves 5] [--instructions 20,80]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = "mstx,resume,ttp"  # every feature that runs here
CHILD = r"""
import json, os, sys, tempfile, time
import ft_plugins.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
mode, steps = sys.argv[1], int(sys.argv[2])
if mode in ("steps", "count"):  # one intra-op thread (in count mode: no spinning pool threads)
    torch.set_num_threads(1)
set_seed(7)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (512, 16)).unbind()]
out = tempfile.mkdtemp()
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))

class Clock(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_end(self, *args, **kwargs):
        self.ends.append((time.perf_counter(), time.process_time()))

def median_step(ends, clock):
    steps = sorted(1000 * (later[clock] - earlier[clock]) for earlier, later in zip(ends, ends[1:]))
    return steps[len(steps) // 2]

def run(hooked):
    ft_plugins.torch.enable() if hooked else ft_plugins.torch.disable()
    args = TrainingArguments(output_dir=out, max_steps=steps, save_strategy="no", per_device_train_batch_size=4,
                             lr_scheduler_type="constant", report_to=[], use_cpu=True, disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    clock = Clock()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    return trainer, median_step(clock.ends, 0), median_step(clock.ends, 1)

if mode == "count":  # one run, FT_PLUGINS deciding what is on (instructions counted from outside)
    run(True)
    sys.exit(0)
run(False), run(True)  # warm-up: first-call costs (imports, allocator) out of the blocks
if mode == "steps":
    blocks = [[run(hooked)[1:] for hooked in (False, True, False)] for _ in range(int(sys.argv[3]))]
    print(json.dumps({"wall": [[wall for wall, _ in block] for block in blocks],
                      "cpu": [[cpu for _, cpu in block] for block in blocks]}))
else:
    trainer = run(True)[0]
    from ft_plugins.checkpoint import commit
    from ft_plugins.torch.hf.rng import RngState
    from ft_plugins.torch.hf.ttp import _write_checkpoint
    saves, dumps = [], []
    for attempt in range(int(sys.argv[3])):
        trainer.state.global_step = 1000 + attempt
        started = time.perf_counter()
        trainer._save_checkpoint(trainer.model, None)
        saves.append(time.perf_counter() - started)
        started = time.perf_counter()
        target = os.path.join(out, f"dump-{attempt}")
        _write_checkpoint(trainer, target, RngState().take())
        commit(target)
        dumps.append(time.perf_counter() - started)
    from ft_plugins.torch.hf import events
    dump = next(listener for listener in events.LISTENERS if hasattr(listener, "tracker"))
    rounds, runs = 2000, []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            events.dispatch("step_begin", trainer.args, trainer.state, trainer.control, {})
            dump.tracker.update(lambda: None)
            events.dispatch("step_end", trainer.args, trainer.state, trainer.control, {})
        runs.append((time.perf_counter() - started) / rounds)
    print(json.dumps({"save_ms": 1000 * min(saves), "dump_ms": 1000 * min(dumps), "hooks_us": 1e6 * min(runs)}))
"""


def _run_child(features: str, args: tuple[str, ...], prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")},
           "FT_PLUGINS": features, "FT_PLUGINS_MSTX_BACKEND": "noop", "PYTHONPATH": ROOT}
    result = subprocess.run([*prefix, sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    return result


def _child(features: str, *args: str) -> dict[str, float]:
    return dict(json.loads(_run_child(features, args).stdout.strip().splitlines()[-1]))


def _instructions(features: str, steps: int) -> int:
    """Instructions a whole training process of ``steps`` steps executes (callgrind's count)."""
    result = _run_child(features, ("count", str(steps)), ("env", "PYTHONHASHSEED=0", "valgrind", "--tool=callgrind",
                                                         "--callgrind-out-file=/dev/null"))
    return int(re.search(r"Collected : (\d+)", result.stderr).group(1))


def _instruction_ratio(spec: str) -> None:
    if shutil.which("valgrind") is None:
        print("instructions: valgrind is not installed (apt-get install valgrind)")
        return
    short, long = (int(value) for value in spec.split(","))
    runs = [(features, steps) for features in (ALL, "none") for steps in (short, long)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(runs, pool.map(lambda run: _instructions(*run), runs)))
    per_step = {features: (counts[(features, long)] - counts[(features, short)]) / (long - short)
                for features in (ALL, "none")}
    print(f"per step, instructions executed (callgrind, {short} and {long} steps, set-up cancelled): bare "
          f"{per_step['none'] / 1e6:.2f} M, all features {per_step[ALL] / 1e6:.2f} M: ratio "
          f"{per_step[ALL] / per_step['none']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--instructions", metavar="S1,S2", help="also count instructions under valgrind")
    options = parser.parse_args()
    if options.instructions:
        _instruction_ratio(options.instructions)
    measured = _child(ALL, "steps", str(options.steps), str(options.blocks))
    fastest_bare: dict[str, float] = {}
    for clock in ("wall", "cpu"):
        blocks = measured[clock]
        ratios = [on / ((off + again) / 2) for off, on, again in blocks]
        floor = [again / off for off, _, again in blocks]
        bare = [step for off, _, again in blocks for step in (off, again)]
        fastest_bare[clock] = min(bare)
        fastest = min(on for _, on, _ in blocks) / fastest_bare[clock]
        print(f"per step, {'wall clock' if clock == 'wall' else 'CPU time of the process'} ({options.blocks} "
              f"blocks of off/on/off, {options.steps} steps each, in one process): bare median "
              f"{statistics.median(bare):.2f} ms; ratio all features / bare: median {statistics.median(ratios):.4f} "
              f"(range {min(ratios):.4f}-{max(ratios):.4f}), fastest on / fastest off {fastest:.4f}; A/A off/off: "
              f"median {statistics.median(floor):.4f} (range {min(floor):.4f}-{max(floor):.4f})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    timed = _child(ALL, "dump", "4", str(options.saves))
    print(f"the hooks' own work per optimizer step (step events with the step range and the step tracker's RNG "
          f"snapshot, the update bracket), in-process: {timed['hooks_us']:.1f} us = "
          f"{timed['hooks_us'] / 10 / fastest_bare['wall']:.3f} % of the fastest bare step")
    print(f"dump {timed['dump_ms']:.1f} ms (written and committed) vs Trainer._save_checkpoint "
          f"{timed['save_ms']:.1f} ms: {timed['dump_ms'] / timed['save_ms']:.2f}x (fastest of {options.saves})")


if __name__ == "__main__":
    main()
