"""The Trainer resumed by another number of processes (torchrun's elastic restart, ``--nnodes MIN:MAX``).

The Trainer makes its global batch from the process count (per-device batch x processes x gradient accumulation)
and finds its place in the data by steps: resumed at half the processes, each step reads half the samples and the
skip past the steps done lands half-way, so the samples of the last steps are trained on again. With ``elastic``,
the gradient accumulation is set so that the checkpoint's global batch is kept, which puts every step on exactly the
samples it had at the old size (the sampler's order does not depend on the process count), and a process with no
RNG file of its own (more processes than wrote the checkpoint) loads rank 0's: ``set_seed`` gave every rank the
same generators, the relation its own file would have had. Where the per-device batch times the processes does not
divide the global batch, or ``elastic`` is off, one line says what the Trainer's own resume does instead.

Accelerate's ``load_state`` restores model, optimizer and scheduler at any process count, and each process's RNG
file where there is one. Its global batch and place in the data are the script's own loop's, which ft_plugins does
not change: a change of process count is said in one line (what keeps them), and with ``elastic`` a process with
no RNG file of its own loads rank 0's, as for the Trainer.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from inspect import signature
from typing import Any, Callable

from ft_plugins.patching import Patch
from ft_plugins.rank import on_rank_zero
from ft_plugins.torch.hf.targets import ACCELERATOR, TRAINER
from ft_plugins.torch.store import distributed

log = logging.getLogger("ft_plugins.elastic")

_RNG_FILE = re.compile(r"rng_state(?:_(\d+))?\.pth$")
_ACCELERATE_RNG_FILE = re.compile(r"random_states_(\d+)\.pkl$")
OWN_ACCUMULATION = "4.46"  # from this transformers release the Trainer accumulates itself, not its Accelerator


@dataclass(frozen=True)
class Batch:
    """How a global batch is made: per-device batch x processes x gradient accumulation."""

    per_device: int
    processes: int
    accumulation: int

    @property
    def size(self) -> int:
        return self.per_device * self.processes * self.accumulation


class TrainerResize:
    """``keep``: the checkpoint's global batch kept (``elastic``); otherwise a change of size is only said."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    def patches(self) -> tuple[Patch, ...]:
        loop = Patch(TRAINER, "Trainer._inner_training_loop", self.loop, required=self.keep)  # resume's: a line
        return (loop, Patch(TRAINER, "Trainer._load_rng_state", self.load_rng_state)) if self.keep else (loop,)

    def loop(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        checkpoint = kwargs.get("resume_from_checkpoint")
        if isinstance(checkpoint, (str, os.PathLike)) and os.path.isdir(checkpoint):
            self._fit(trainer, kwargs.get("args") or trainer.args, os.fspath(checkpoint))
        return wrapped(*args, **kwargs)

    def _fit(self, trainer: Any, args: Any, checkpoint: str) -> None:
        saved = saved_batch(checkpoint)
        now = Batch(args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps)
        if saved is None or saved.size == now.size:
            return
        step = _global_step(checkpoint)
        whole = saved.size % (now.per_device * now.processes) == 0
        if self.keep and whole:
            accumulation = saved.size // (now.per_device * now.processes)
            _set_accumulation(trainer, args, accumulation)
            on_rank_zero(log.warning, "elastic: %s was written by %d processes, %d resume it: gradient accumulation "
                         "%d (was %d) keeps the global batch of %d samples and the data position (%d samples read)",
                         checkpoint, saved.processes, now.processes, accumulation, now.accumulation, saved.size,
                         step * saved.size)
            return
        if self.keep:
            fix = (f"no gradient accumulation keeps it at {now.processes} processes of {now.per_device}: run a number "
                   f"of processes that divides {saved.size // now.per_device}")
        else:
            fix = "FT_PLUGINS=...,elastic keeps it"
        on_rank_zero(log.warning, "%s: %s was written by %d processes with a global batch of %d samples, %d "
                     "resume it with %d: the Trainer counts its place in the data in steps, so %s; %s",
                     "elastic" if self.keep else "resume", checkpoint, saved.processes, saved.size, now.processes,
                     now.size, _misplaced(step, saved, now), fix)

    def load_rng_state(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict) -> Any:
        checkpoint = kwargs.get("checkpoint", args[0] if args else None)
        if not isinstance(checkpoint, (str, os.PathLike)) or not os.path.isdir(checkpoint):
            return wrapped(*args, **kwargs)
        world, index = trainer.args.world_size, trainer.args.process_index
        own = f"rng_state_{index}.pth" if world > 1 else "rng_state.pth"
        stand_in = next((name for name in ("rng_state_0.pth", "rng_state.pth")
                         if os.path.isfile(os.path.join(checkpoint, name))), None)
        if os.path.isfile(os.path.join(checkpoint, own)) or stand_in is None:
            return wrapped(*args, **kwargs)
        log.info("elastic: %s has no RNG file for process %d: it takes %s (every rank's generators started alike)",
                 checkpoint, index, stand_in)
        with tempfile.TemporaryDirectory(prefix="ft_plugins-rng-") as directory:  # a checkpoint is never changed
            shutil.copyfile(os.path.join(checkpoint, stand_in), os.path.join(directory, own))
            return wrapped(directory)


class AcceleratorResize:
    """Accelerate's ``load_state`` by another number of processes than saved: said; ``keep`` (``elastic``): a process
    with no RNG file of its own loads rank 0's."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    def patches(self) -> tuple[Patch, ...]:
        # the name Accelerator.load_state calls: accelerate.accelerator's own import of checkpointing's function
        return (Patch(ACCELERATOR, "load_accelerator_state", self.load_accelerator_state, required=self.keep),)

    def load_accelerator_state(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        call = signature(wrapped).bind_partial(*args, **kwargs)
        directory, index = os.fspath(call.arguments["input_dir"]), int(call.arguments["process_index"])
        saved = [int(match.group(1)) for match in map(_ACCELERATE_RNG_FILE.match, os.listdir(directory)) if match]
        dist = distributed()
        processes = dist.get_world_size() if dist is not None else 1
        if not saved or max(saved) + 1 == processes:
            return wrapped(*args, **kwargs)
        written = max(saved) + 1
        rng = ("a process with no RNG file of its own loads random_states_0.pkl (set_seed gives every process the "
               "same generators unless device_specific)" if self.keep else
               "a process with no RNG file of its own keeps its start-up generators (FT_PLUGINS=...,elastic gives "
               "it rank 0's)") if processes > written else "the RNG files of processes no longer there are unused"
        on_rank_zero(log.warning, "%s: %s was written by %d processes, %d load it: Accelerate keeps no global batch "
                     "or place in the data, the script's loop does: its global batch stays with a gradient "
                     "accumulation %d/%d times as large, and a skip counted in batches (skip_first_batches) now "
                     "skips %d/%d times the samples; %s", "elastic" if self.keep else "resume", directory, written,
                     processes, written, processes, processes, written, rng)
        if self.keep and index not in saved and 0 in saved:
            log.info("elastic: %s has no RNG file for process %d: it takes random_states_0.pkl", directory, index)
            call.arguments["process_index"] = 0
            return wrapped(*call.args, **call.kwargs)
        return wrapped(*args, **kwargs)


def saved_batch(checkpoint: str) -> Batch | None:
    """The global batch a Trainer checkpoint was trained with: its processes (its RNG files), its per-device batch
    and accumulation (its ``training_args.bin``); None when it does not say."""
    ranks = [match.group(1) for match in map(_RNG_FILE.match, os.listdir(checkpoint)) if match]
    arguments = os.path.join(checkpoint, "training_args.bin")
    if not ranks or not os.path.isfile(arguments):
        return None
    import torch

    try:  # the Trainer's own pickle of its TrainingArguments: plain fields read, no device set up
        saved = torch.load(arguments, weights_only=False)
        per_device, accumulation = int(saved.per_device_train_batch_size), int(saved.gradient_accumulation_steps)
    except Exception as exc:
        log.info("elastic: %s cannot be read (%s: %s): its global batch is unknown", arguments, type(exc).__name__,
                 exc)
        return None
    processes = max(int(rank) + 1 if rank is not None else 1 for rank in ranks)
    return Batch(per_device, processes, accumulation)


def _global_step(checkpoint: str) -> int:
    from transformers.trainer_callback import TrainerState

    return int(TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json")).global_step)


def _misplaced(step: int, saved: Batch, now: Batch) -> str:
    """What the Trainer's resume at ``now`` does with the data after ``step`` steps at ``saved`` (in its first
    epoch)."""
    read, skipped = step * saved.size, step * now.size
    if skipped < read:
        return f"samples {skipped} to {read - 1} of the order are trained on again"
    return f"samples {read} to {skipped - 1} of the order are never trained on"


def _set_accumulation(trainer: Any, args: Any, accumulation: int) -> None:
    """The Trainer's accumulation, and its Accelerator's where that one divides the loss (before transformers
    4.46: the Accelerator accumulates)."""
    import transformers
    from packaging.version import Version

    object.__setattr__(args, "gradient_accumulation_steps", accumulation)  # TrainingArguments may be frozen
    if Version(transformers.__version__) < Version(OWN_ACCUMULATION):
        trainer.accelerator.gradient_accumulation_steps = accumulation
