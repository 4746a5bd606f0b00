"""Megatron-LM's own ``pretrain_gpt.py`` at four refs (the vendored archives, ``../shared/vendor/megatron-lm``,
unpacked by scripts/setup.sh into ``.venv/megatron-lm-<ref>``), each over the megatron-core wheel of its release,
with ft_plugins switched on by the launcher prefix alone (``ft-plugins run -- torchrun ...``: its bootstrap
activates ``ft_plugins.torch`` in each worker; the user's script is not edited). On CPU the workers get the
example's CPU shim and what the older releases need besides from ``fixtures/megatron_lm`` (a ``sitecustomize``
first on the path, which ``ft-plugins run``'s own bootstrap chain-loads).

The refs, each over a megatron-core wheel:

- core_r0.8.0 over 0.8.0: its mock data has token ids up to 4095 (``--vocab-size 4096``); its ``load_checkpoint``
  calls ``torch.load`` with torch's default, ``weights_only=True`` since torch 2.6, which refuses the ``args`` it
  saved itself (the job's environment restores the old default); no distributed-optimizer instances, hence no
  ``replicas``.
- core_v0.12.1 over 0.12.1: ``--vocab-size 4096``; with the distributed optimizer ``recover`` refuses (no
  ``get_parameter_state_dp_reshardable``), and ``ttp``'s dump from the other instance takes its place.
- core_v0.19.0 over 0.19.2: 0.19.0's wheels are for Python 3.12 only; 0.19.2 is the one the suite uses.
- main (d98e8a6) over 0.19.2, the newest wheel there is: cannot run, its training side needs a newer megatron/core
  (``MAIN_CANNOT``); each of its tests is a strict xfail that checks that reason, and fails the day it runs.

For each: ``ttp`` (a rank killed after 3 steps, the survivor's dump committed and bit for bit the uninterrupted
run's save of step 3, a plain ``--load`` relaunch going on from it to a final save bit for bit the uninterrupted
run's); on core_v0.19.0 also ``resume`` (the newest save truncated: skipped, the one before loaded, the end bit for
bit the same) and ``recover`` (a rank killed after 2 steps, replaced in place, the final save the uninterrupted
run's); and, where the release has the distributed optimizer's instances, ``recover`` with ``replicas`` (4 ranks, DP=4,
``--use-distributed-optimizer``, ``distrib_optim.pt`` compared whole).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import PYTHON, TORCHRUN, free_port, run_to_end
from ttp_runs import ITERS, Job, committed_dump

HERE = Path(__file__).resolve().parent
SHIM = HERE / "fixtures" / "megatron_lm"
VENV = Path(sys.prefix)
# examples/megatron_gpt/pretrain_gpt.py's DEFAULTS, less its own dataset's and format's flags: the real script
# takes Megatron's mock data
TINY = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--train-iters", str(ITERS),
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--clip-grad", "0.0",
        "--tokenizer-type", "NullTokenizer", "--seed", "1234", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--mock-data")
DUMP_STEP, RECOVER_STEP = 3, 2
FINAL = f"iter_{ITERS:07d}/mp_rank_00"


@dataclass(frozen=True)
class Ref:
    """One Megatron-LM ref over one megatron-core wheel."""

    name: str  # the archive's folder: .venv/megatron-lm-<name>
    wheel: str  # the megatron-core side folder in .venv
    core: str  # the megatron-core release that wheel is
    args: tuple[str, ...]  # what this release's script needs besides TINY
    env: tuple[tuple[str, str], ...] = ()
    instances: bool = True  # --num-distributed-optimizer-instances: replicas possible
    reshardable: bool = True  # the distributed optimizer's get_parameter_state_dp_reshardable: recover with it

    @property
    def archive(self) -> Path:
        return VENV / f"megatron-lm-{self.name}"

    def path(self) -> str:
        return os.pathsep.join(filter(None, [str(SHIM), str(self.archive), str(VENV / self.wheel),
                                             os.environ.get("PYTHONPATH")]))

    def run(self, workdir: Path, *args: str, nproc: int = 2, supervised: bool = True, save: Path | None = None,
            **env: str) -> Job:
        """``pretrain_gpt.py`` of this ref under torchrun (behind ``ft-plugins run --`` if ``supervised``)."""
        save = save or workdir / "ckpt"
        launcher = [PYTHON, "-m", "ft_plugins.cli", "run", "--"] if supervised else []
        command = [*launcher, TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
                   str(self.archive / "pretrain_gpt.py"), *TINY, *self.args, "--save", str(save), *args]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "TORCHELASTIC"))}
        # megatron's argument check demands it whenever gradients are all-reduced asynchronously (0.8, 0.12)
        result = run_to_end(command, workdir, {**clean, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **dict(self.env),
                                               "PYTHONPATH": self.path(), **env}, timeout=400)
        job = Job(result.returncode, result.stdout + result.stderr, save)
        assert self.ran_here(job), job.output[-3000:]
        return job

    def ran_here(self, job: Job) -> bool:
        """The job trained with this archive's megatron.training over this wheel's megatron.core."""
        return (f"megatron.training from {self.archive / 'megatron' / 'training'}, megatron.core from "
                f"{VENV / self.wheel / 'megatron' / 'core'}") in job.output

    def differences(self, *pairs: tuple[Path, Path], rng: bool = True) -> list[list[str]]:
        """``ttp_runs.differences`` of each pair of ``model_optim_rng.pt`` (every tensor and counter a resume reads),
        or every tensor of each pair of ``distrib_optim.pt``, read where this release's classes unpickle."""
        path = os.pathsep.join([str(SHIM), str(self.archive), str(VENV / self.wheel), str(HERE), str(HERE.parent)])
        child = subprocess.run([PYTHON, "-c", COMPARE, json.dumps([[str(a), str(b)] for a, b in pairs]), str(rng)],
                               capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
        assert child.returncode == 0, child.stderr[-3000:]
        return json.loads(child.stdout.strip().splitlines()[-1])


COMPARE = """
import json, sys
import torch
from ttp_runs import _compare, differences
found = []
for left, right in json.loads(sys.argv[1]):
    if left.endswith("distrib_optim.pt"):
        each = []
        _compare(*(torch.load(path, map_location="cpu", weights_only=False) for path in (left, right)), "", each)
        found.append(each)
    else:
        found.append(differences(left, right, rng=sys.argv[2] == "True"))
print(json.dumps(found))
"""

REFS = {ref.name: ref for ref in (
    # mock data: token ids up to 4095; Megatron 0.8's load_checkpoint reads its own args with torch.load's default
    Ref("core_r0.8.0", "megatron-core-0.8", "0.8.0", ("--vocab-size", "4096"),
        (("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1"),), instances=False),
    Ref("core_v0.12.1", "megatron-core-0.12", "0.12.1", ("--vocab-size", "4096", "--ckpt-format", "torch"),
        reshardable=False),
    Ref("core_v0.19.0", "megatron-core-0.19", "0.19.2", ("--vocab-size", "128", "--ckpt-format", "torch")),
    Ref("main-d98e8a6", "megatron-core-0.19", "0.19.2", ("--vocab-size", "128", "--ckpt-format", "torch")),
)}


class CannotRun(Exception):
    """This ref's training side does not import over the newest megatron-core wheel there is."""


# Megatron-LM main's training side needs a megatron/core newer than any wheel: what it imports of it that 0.19.2 lacks
MAIN_NEEDS = ("cannot import name 'FullyShardedDataParallelV1' from "
              "'megatron.core.distributed.fsdp.mcore_fsdp_adapter'")
MAIN_CANNOT = pytest.mark.xfail(
    raises=CannotRun, strict=True,
    reason="Megatron-LM main (d98e8a6) does not import over megatron-core 0.19.2, the newest wheel: its "
           "megatron/training imports FullyShardedDataParallelV1 and V2 (megatron.core.distributed.fsdp."
           "mcore_fsdp_adapter), is_gated_delta_net_variant and the module megatron.core.telemetry, which came to "
           "megatron/core after 0.19.2; it runs only over megatron/core of its own commit, which no wheel holds")


@pytest.fixture(scope="module",
                params=[pytest.param(name, marks=[MAIN_CANNOT] if name.startswith("main") else [])
                        for name in sorted(REFS)])
def ref(request: pytest.FixtureRequest) -> Ref:
    ref = REFS[request.param]
    assert (ref.archive / "pretrain_gpt.py").is_file(), f"{ref.archive}: run scripts/setup.sh"
    installed = list((VENV / ref.wheel).glob(f"megatron_core-{ref.core}.dist-info"))
    assert installed, f"megatron-core {ref.core} is not in {VENV / ref.wheel}"
    print(f"{ref.name}: Megatron-LM's pretrain_gpt.py over megatron-core {ref.core}")
    # its training side imports over this wheel (or the ImportError that says why not), before any job
    probe = subprocess.run([PYTHON, "-c", "import megatron.training.training"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": ref.path()})
    if probe.returncode != 0:
        error = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"{ref.name} cannot run over megatron-core {ref.core}: {error}")
        if ref.name.startswith("main") and MAIN_NEEDS in error:
            raise CannotRun(error)
        raise AssertionError(probe.stderr[-3000:])
    return ref


# resume and recover run on the newest ref only: on the older ones ttp's dump and the plain load relaunch show the
# hooks work with that release's training loop and checkpoints (the CI's lanes fit their time)
NEWEST_REF_ONLY = pytest.mark.parametrize("ref", ["core_v0.19.0"], indirect=True)


@pytest.fixture(scope="module")
def reference(ref: Ref, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The uninterrupted run, without ft_plugins (plain torchrun), saving every step."""
    job = ref.run(tmp_path_factory.mktemp(f"{ref.name}_reference"), "--save-interval", "1", supervised=False,
                  FT_PLUGINS="none")
    assert job.returncode == 0, job.output[-3000:]
    assert job.tracker() == str(ITERS)
    return job


@pytest.fixture(scope="module")
def dumped(ref: Ref, tmp_path_factory: pytest.TempPathFactory) -> Job:
    return ref.run(tmp_path_factory.mktemp(f"{ref.name}_dumped"), "--save-interval", "100", FT_PLUGINS="ttp,resume",
                   FT_PLUGINS_INJECT_FAULT=f"rank=1,step={DUMP_STEP},kind=kill")


def test_ttp_dump_is_committed_and_is_the_uninterrupted_runs_save(ref: Ref, dumped: Job, reference: Job) -> None:
    committed_dump(dumped, DUMP_STEP)
    assert dumped.lines("ttp enabled"), dumped.output[-3000:]  # switched on by the launcher prefix alone
    assert not dumped.lines("dump failed"), dumped.output[-3000:]
    shard = "mp_rank_00/model_optim_rng.pt"
    assert ref.differences((dumped.iteration(DUMP_STEP) / shard, reference.iteration(DUMP_STEP) / shard)) == [[]]


def test_a_plain_load_relaunch_from_the_dump_ends_bit_identical(ref: Ref, dumped: Job, reference: Job) -> None:
    assert dumped.tracker() == str(DUMP_STEP), dumped.output[-3000:]
    resumed = ref.run(dumped.save.parent, "--load", str(dumped.save), "--save-interval", "100", save=dumped.save,
                      FT_PLUGINS="ttp,resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"loading checkpoint from {resumed.save} at iteration {DUMP_STEP}"), resumed.output[-3000:]
    assert resumed.lines(f"iteration        {DUMP_STEP + 1}/       {ITERS}")
    assert not resumed.lines(f"iteration        {DUMP_STEP}/       {ITERS}")
    assert ref.differences((resumed.save / FINAL / "model_optim_rng.pt", reference.save / FINAL / "model_optim_rng.pt"),
                           rng=False) == [[]]


@NEWEST_REF_ONLY
def test_resume_skips_a_truncated_newest_save_and_ends_bit_identical(ref: Ref, reference: Job,
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """The uninterrupted run's saves of steps 2 and 4, the tracker at 4, step 4's file cut short (a save killed
    mid-write): resume skips it, Megatron loads step 2 and trains on to a final save bit for bit the reference's."""
    workdir = tmp_path_factory.mktemp(f"{ref.name}_damaged")
    save = workdir / "ckpt"
    for step in (2, 4):
        shutil.copytree(reference.iteration(step), save / f"iter_{step:07d}")
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    damaged = save / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    with open(damaged, "r+b") as handle:
        handle.truncate(damaged.stat().st_size // 2)
    resumed = ref.run(workdir, "--load", str(save), "--save-interval", "100", FT_PLUGINS="resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.lines(f"resume: skipped {save / 'iter_0000004'}: "), resumed.output[-3000:]
    assert resumed.lines(f"loading checkpoint from {save} at iteration 2"), resumed.output[-3000:]
    assert resumed.lines(f"iteration        3/       {ITERS}")
    assert ref.differences((save / FINAL / "model_optim_rng.pt", reference.save / FINAL / "model_optim_rng.pt"),
                           rng=False) == [[]]


@NEWEST_REF_ONLY
def test_recover_replaces_a_killed_rank_in_place_and_ends_bit_identical(
        ref: Ref, reference: Job, tmp_path_factory: pytest.TempPathFactory) -> None:
    recovered = ref.run(tmp_path_factory.mktemp(f"{ref.name}_recovered"), "--save-interval", "100",
                        FT_PLUGINS="ttp,recover", FT_PLUGINS_INJECT_FAULT=f"rank=1,step={RECOVER_STEP},kind=kill")
    assert recovered.returncode == 0, recovered.output[-5000:]
    sent = recovered.lines(f"sent the state of step {RECOVER_STEP} (")
    assert len(sent) == 1 and sent[0].endswith("to rank 1"), recovered.output[-5000:]
    assert recovered.lines("joined generation 1"), recovered.output[-5000:]
    assert ref.differences((recovered.save / FINAL / "model_optim_rng.pt",
                            reference.save / FINAL / "model_optim_rng.pt"), rng=False) == [[]]


# DP=4 with the distributed optimizer; ft_plugins' replicas (auto: 2 instances) against Megatron asked for the same
REPLICATED = ("--micro-batch-size", "1", "--global-batch-size", "4", "--use-distributed-optimizer")


def test_replicas_keep_a_lost_ranks_optimizer_shard_and_end_bit_identical(
        ref: Ref, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 of 4 killed after 2 steps, ft_plugins' 2 instances. Where the release has the reshardable parameter
    state (0.19.x): replaced in place from rank 3 (the same place of the other instance), no checkpoint. Where it
    has not (0.12.1): ``recover`` says it cannot and why, ``ttp``'s dump is then whole from the other instance
    (rank 3 writes the shard rank 1 held), and a plain ``--load`` relaunch goes on from it. Either way the final
    save, ``distrib_optim.pt`` whole, is the uninterrupted run's."""
    if not ref.instances:
        # not a skip: the release itself lacks what replicas set, which this checks and says
        arguments = (ref.archive / "megatron" / "training" / "arguments.py").read_text()
        assert "--num-distributed-optimizer-instances" not in arguments
        print(f"{ref.name}: no replicas: megatron-core {ref.core} has no distributed-optimizer instances "
              "(--num-distributed-optimizer-instances came later), so a lost rank's optimizer shard has no other "
              "holder")
        return
    reference = ref.run(tmp_path_factory.mktemp(f"{ref.name}_replicated_reference"), *REPLICATED,
                        "--num-distributed-optimizer-instances", "2", "--save-interval", "1", nproc=4,
                        supervised=False, FT_PLUGINS="none")
    assert reference.returncode == 0, reference.output[-3000:]
    job = ref.run(tmp_path_factory.mktemp(f"{ref.name}_replicated"), *REPLICATED, "--save-interval", "100", nproc=4,
                  FT_PLUGINS="ttp,recover,resume", FT_PLUGINS_INJECT_FAULT=f"rank=1,step={RECOVER_STEP},kind=kill")
    assert job.lines("with 2 replicas over data-parallel size 4"), job.output[-5000:]
    files = ("model_optim_rng.pt", "distrib_optim.pt")
    if ref.reshardable:
        assert job.returncode == 0, job.output[-5000:]
        sent = job.lines(f"sent the state of step {RECOVER_STEP} (")
        assert len(sent) == 1 and sent[0].endswith("to rank 1") and "rank 3 sent" in sent[0], sent  # the same place
    else:
        refused = (f"recover: a lost rank cannot be replaced in this run: --use-distributed-optimizer on megatron-core "
                   f"{ref.core}: the hand-over moves the optimizer's shards with get_parameter_state_dp_reshardable, "
                   "which this release does not have")
        assert job.lines(refused), job.output[-5000:]
        print(f"{ref.name}: {refused}; ttp's replicated dump instead")
        assert job.returncode != 0 and job.tracker() == str(RECOVER_STEP), job.output[-5000:]
        dump = job.iteration(RECOVER_STEP) / "mp_rank_00"
        # the first rank of the whole instance ([2, 3]; rank 1's [0, 1] is torn) writes it all, shard included
        assert job.lines(f"rank 2 dumped mp_rank_00 of iteration {RECOVER_STEP}"), job.output[-5000:]
        assert ref.differences(*((dump / name, reference.iteration(RECOVER_STEP) / "mp_rank_00" / name)
                                 for name in files)) == [[], []]
        job = ref.run(job.save.parent, *REPLICATED, "--load", str(job.save), "--save-interval", "100", nproc=4,
                      save=job.save, FT_PLUGINS="ttp,resume")
        assert job.returncode == 0, job.output[-5000:]
        assert job.lines(f"loading checkpoint from {job.save} at iteration {RECOVER_STEP}"), job.output[-5000:]
    assert ref.differences(*((job.save / FINAL / name, reference.save / FINAL / name) for name in files),
                           rng=False) == [[], []]
