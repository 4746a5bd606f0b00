"""MindFormers' own launch path, resuming the way MindFormers documents it (``resume_training: True``,
``load_checkpoint: ./output/checkpoint``), with ft_plugins reached only through its start-up hook.

Real MindFormers 1.8.0 on CPU (1.9.0 and 1.6.0 in the newest lane: test_mindformers_releases.py):
``fixtures/run_mindformer.py`` (run_mindformer.py's train path), a tiny LLaMA (1 layer, hidden 32, vocab 128, seq
16), a MindRecord of synthetic tokens, 4 steps an epoch, a save every 2 steps. One uninterrupted run of 16 steps is
the reference. The crash: a copy of its saves up to step 8, the step-8 file cut in half (MindFormers' meta.json names
it). Resumed to step 12, then resumed again to 16; the same resume without ft_plugins is the negative control. Each
run is a subprocess in its own directory (MindFormers writes ./output) and says which MindFormers it trained on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mindformers_runs import ENTRY, losses, task_yaml, tokens
from support import FAKES, REPO, path_first

HOOK = REPO / "ft_plugins" / "mindspore" / "ft-plugins-mindformers.pth"
STEPS_PER_EPOCH = 4

FAULT_TOLERANCE = """
  - type: FaultTolerance
    features: resume"""


@dataclass
class Run:
    directory: Path
    returncode: int
    output: str
    latest: object = None

    @property
    def losses(self) -> dict[int, str]:
        """Loss printed by MFLossMonitor at each global step (as printed: compared exactly)."""
        return losses(self.output, STEPS_PER_EPOCH)

    @property
    def checkpoints(self) -> Path:
        return self.directory / "output" / "checkpoint"


def _launch(directory: Path, data: Path, epochs: int, resume: bool, ft_plugins: bool = True) -> Run:
    """run_mindformer.py in ``directory``; ft_plugins present only through its start-up hook (a site dir
    holding the installed .pth), as after ``pip install``, with no import in the script."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "task.yaml"
    config.write_text(task_yaml(data, epochs, resume, FAULT_TOLERANCE if ft_plugins else ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE", "MS_ENABLE_TFT"))}
    env["PYTHONPATH"] = path_first(FAKES)  # and the newer releases a child pytest puts on the path
    site = ""
    if ft_plugins:
        site_dir = directory / "site"
        site_dir.mkdir(exist_ok=True)
        shutil.copy(HOOK, site_dir)
        site = f"import site; site.addsitedir({str(site_dir)!r}); "
    script = (f"{site}import mindformers, runpy, sys; print('MindFormers', mindformers.__version__, file=sys.stderr); "
              f"sys.argv = [{str(ENTRY)!r}, {str(config)!r}]; runpy.run_path({str(ENTRY)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], cwd=directory, env=env, capture_output=True, text=True,
                            timeout=900)
    return Run(directory, result.returncode, result.stdout + result.stderr)


def _crashed_copy(reference: Run, directory: Path) -> Path:
    """The reference's saves up to step 8, the step-8 file cut in half before its commit, meta.json naming it."""
    from ft_plugins.checkpoint.layouts.mindspore import recorded_step

    rank_dir = directory / "output" / "checkpoint" / "rank_0"
    shutil.copytree(reference.checkpoints, directory / "output" / "checkpoint")
    for ckpt in list(rank_dir.glob("*.ckpt")):
        if recorded_step(str(ckpt)) > 8:
            ckpt.unlink()
    (rank_dir / "ft_manifest-tiny_rank_0-2_4.json").unlink()
    for manifest in rank_dir.glob("ft_manifest-*.json"):
        if not (rank_dir / f"{manifest.stem[len('ft_manifest-'):]}.ckpt").exists():
            manifest.unlink()
    newest = rank_dir / "tiny_rank_0-2_4.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    (rank_dir / "meta.json").write_text(json.dumps({"last_epoch": 2, "last_step": 4,
                                                    "last_ckpt_file": "tiny_rank_0-2_4.ckpt"}))
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokens(tmp_path_factory.mktemp("tokens"), 8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Run:
    run = _launch(tmp_path_factory.mktemp("reference"), data, epochs=4, resume=False)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, reference: Run, data: Path) -> Run:
    from ft_plugins.checkpoint import find_latest

    run = _launch(_crashed_copy(reference, tmp_path_factory.mktemp("resumed")), data, epochs=3, resume=True)
    assert run.returncode == 0, run.output[-4000:]
    run.latest = find_latest(run.checkpoints, rank=0)  # what the next resume starts from (before it writes more)
    return run


@pytest.fixture(scope="module")
def resumed_again(resumed: Run, data: Path) -> Run:
    run = _launch(resumed.directory, data, epochs=4, resume=True)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_reference_run_saves_every_two_steps_with_true_steps_recorded(reference: Run) -> None:
    import mindformers

    from ft_plugins.checkpoint.layouts.mindspore import recorded_step

    assert f"MindFormers {mindformers.__version__}\n" in reference.output  # the runs train on the tests' MindFormers
    rank_dir = reference.checkpoints / "rank_0"
    assert sorted(reference.losses) == list(range(1, 17))
    assert sorted(recorded_step(str(p)) for p in rank_dir.glob("*.ckpt")) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert sorted(p.name for p in rank_dir.glob("ft_manifest-*")) == sorted(
        f"ft_manifest-{p.stem}.json" for p in rank_dir.glob("*.ckpt"))


def test_resume_takes_newest_intact_before_mindformers_loads(resumed: Run) -> None:
    rank_dir = resumed.checkpoints / "rank_0"
    assert re.search(r"resume: skipped \S*tiny_rank_0-2_4\.ckpt: rank_0: .*truncated", resumed.output)
    assert "MindFormers resumes from ./output/checkpoint/rank_0/tiny_rank_0-2_2.ckpt (step 6)" in resumed.output
    assert "Failed to read the checkpoint file" not in resumed.output
    assert sorted(resumed.losses) == list(range(7, 13))  # MindFormers skipped the data of steps 1-6 itself
    assert (rank_dir / "tiny_rank_0-2_4.ckpt").exists()  # left in place for inspection


def test_resumed_losses_equal_the_uninterrupted_run(reference: Run, resumed: Run, resumed_again: Run) -> None:
    assert resumed.losses == {step: reference.losses[step] for step in range(7, 13)}
    assert resumed_again.losses == {step: reference.losses[step] for step in range(13, 17)}


def test_callback_does_not_resume_a_second_time(resumed: Run) -> None:
    """With MindFormers resuming, the YAML's FaultTolerance only commits: no second load, no step rewind."""
    assert "resume: MindFormers resumed from ./output/checkpoint/rank_0/tiny_rank_0-2_2.ckpt at step 6" in resumed.output
    assert "resume: loaded" not in resumed.output and "restarts that epoch" not in resumed.output


def test_new_saves_record_the_true_step_and_match_the_uninterrupted_run(reference: Run, resumed: Run) -> None:
    import numpy as np
    from mindspore import load_checkpoint

    from ft_plugins.checkpoint.layouts.mindspore import recorded_step

    def by_step(directory: Path, prefix: str) -> dict[int, Path]:
        return {recorded_step(str(p)): p for p in directory.glob(f"{prefix}-*.ckpt")}

    new = by_step(resumed.checkpoints / "rank_0", "tiny_rank_0_1")  # ModelCheckpoint's prefix for a second run
    assert sorted(new) == [8, 10, 12]
    for step, path in new.items():
        assert (resumed.checkpoints / "rank_0" / f"ft_manifest-{path.stem}.json").is_file()
    old = by_step(reference.checkpoints / "rank_0", "tiny_rank_0")
    expected, resumed_state = load_checkpoint(str(old[12])), load_checkpoint(str(new[12]))
    assert expected.keys() == resumed_state.keys()
    differing = [name for name in expected
                 if not np.array_equal(expected[name].asnumpy(), resumed_state[name].asnumpy())]
    assert not differing, differing  # weights, optimizer moments, step_num, epoch_num, global_step


def test_second_resume_takes_the_truly_newest_though_its_name_counts_less(resumed: Run,
                                                                           resumed_again: Run) -> None:
    """After a mid-epoch resume MindFormers' names stop counting steps (step 12 is ``-3_2``, step 10 ``-3_4``):
    the step recorded in the file ranks, so the next resume (and ``ckpt latest``) takes the newest."""
    latest = resumed.latest
    assert latest.iteration == 12 and Path(latest.path).name.startswith("tiny_rank_0_1-")
    names = [tuple(map(int, re.search(r"-(\d+)_(\d+)\.ckpt$", p.name).groups()))
             for p in (resumed.checkpoints / "rank_0").glob("tiny_rank_0_1-*.ckpt")]
    assert (latest.epoch, latest.step) < max(names), "by its name alone an older save would rank first"
    assert f"MindFormers resumes from ./output/checkpoint/rank_0/{Path(latest.path).name} (step 12)" \
        in resumed_again.output
    assert sorted(resumed_again.losses) == list(range(13, 17))


def test_the_same_resume_without_ft_plugins_fails(tmp_path_factory: pytest.TempPathFactory, reference: Run,
                                                  data: Path) -> None:
    run = _launch(_crashed_copy(reference, tmp_path_factory.mktemp("unguarded")), data, epochs=3, resume=True,
                  ft_plugins=False)
    assert run.returncode != 0
    assert "Failed to read the checkpoint file" in run.output and "tiny_rank_0-2_4.ckpt" in run.output
    assert not run.losses


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, reference: Run) -> Path:
    return _crashed_copy(reference, tmp_path_factory.mktemp("crashed")) / "output" / "checkpoint"


LAYOUTS = ("load_checkpoint", "checkpoint.load_path")  # where MindFormers keeps what it loads: to 1.8, from 1.9


def _config(load_checkpoint: Path, resume_training: bool | str = True, layout: str = LAYOUTS[0]) -> object:
    """MindFormers' config as its resume step sees it (only the fields the guard reads or writes); from 1.9 the
    YAML's ``load_checkpoint`` is read from a ``checkpoint`` section's ``load_path``."""
    from types import SimpleNamespace

    config = SimpleNamespace(load_checkpoint=str(load_checkpoint), resume_training=resume_training)
    if layout == "checkpoint.load_path":
        config.load_checkpoint = "left as the YAML had it: MindFormers 1.9 does not read it"
        config.checkpoint = {"load_path": str(load_checkpoint), "no_load_optim": False}
    return config


def _loaded(config: object) -> str:
    """What MindFormers loads, where its release reads it."""
    section = getattr(config, "checkpoint", None)
    return section["load_path"] if section is not None else config.load_checkpoint


def _resume(**options: object) -> object:
    from ft_plugins.mindspore.mindformers import resume_feature

    return resume_feature([{"type": "MFLossMonitor"}, {"type": "FaultTolerance", "features": "taskd,resume",
                                                       "resume": options}])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("load, pick, expected", [
    ("folder", "tiny_rank_0-2_4.ckpt", "tiny_rank_0-2_2.ckpt"),  # MindFormers' meta.json pick, cut in half
    ("folder", "tiny_rank_0-1_4.ckpt", "tiny_rank_0-1_4.ckpt"),  # a named intact file is kept
    ("file", "tiny_rank_0-2_4.ckpt", "tiny_rank_0-2_2.ckpt"),
    ("file", "tiny_rank_0-1_2.ckpt", "tiny_rank_0-1_2.ckpt"),
])
def test_guard_replaces_only_a_broken_pick(crashed: Path, load: str, pick: str, expected: str, layout: str) -> None:
    from ft_plugins.mindspore.mindformers import choose

    rank_dir = crashed / "rank_0"
    config = _config(crashed, pick, layout) if load == "folder" else _config(rank_dir / pick, layout=layout)
    choose(config, _resume())
    if expected == pick:
        assert (_loaded(config), config.resume_training) == ((str(crashed), pick) if load == "folder"
                                                             else (str(rank_dir / pick), True))
    else:
        assert (_loaded(config), config.resume_training) == (str(rank_dir / expected), True)
        assert config.load_checkpoint == _loaded(config)  # both kept in step where both are


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("load, expected", [("folder", "tiny_rank_0-2_2.ckpt"), ("file", "tiny_rank_0-1_4.ckpt")])
def test_meta_json_s_pick_yields_to_a_newer_intact_save_a_file_given_as_the_load_path_does_not(
        crashed: Path, tmp_path: Path, load: str, expected: str, layout: str) -> None:
    """MindFormers' meta.json names its last regular save (here step 4), never ttp's dump of a later step: with
    the folder to load from, its pick yields to the newest intact save (step 6); the same file given as the load
    path is the user's and is kept."""
    from ft_plugins.mindspore.mindformers import choose

    root = shutil.copytree(crashed, tmp_path / "checkpoint")
    pick = "tiny_rank_0-1_4.ckpt"
    (root / "rank_0" / "meta.json").write_text(json.dumps({"last_epoch": 1, "last_step": 4, "last_ckpt_file": pick}))
    config = _config(root, pick, layout) if load == "folder" else _config(root / "rank_0" / pick, layout=layout)
    choose(config, _resume())
    assert (_loaded(config), config.resume_training) == (str(root / "rank_0" / expected), True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_guard_stops_before_training_when_nothing_is_intact(crashed: Path, tmp_path: Path, layout: str) -> None:
    from ft_plugins.checkpoint.errors import NoIntactCheckpoint
    from ft_plugins.mindspore.mindformers import choose

    broken = tmp_path / "checkpoint"
    shutil.copytree(crashed, broken)
    for ckpt in (broken / "rank_0").glob("*.ckpt"):
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(NoIntactCheckpoint, match="none is intact"):
        choose(_config(broken, layout=layout), _resume())
    config = _config(broken, layout=layout)
    choose(config, _resume(allow_scratch=True))
    assert (_loaded(config), config.load_checkpoint, config.resume_training) == ("", "", False)


def test_guard_acts_only_for_a_yaml_entry_with_resume() -> None:
    from ft_plugins.mindspore.mindformers import resume_feature

    assert resume_feature([{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor"}]) is None
    assert resume_feature([{"type": "FaultTolerance", "features": "taskd,mstx"}]) is None
    assert resume_feature([{"type": "ResumeCallback", "deep": True}]).settings["deep"] is True


def test_without_resume_training_the_callback_says_how_instead_of_retraining(
        tmp_path_factory: pytest.TempPathFactory, reference: Run, data: Path) -> None:
    """MindFormers starts at step 0 without ``resume_training``; the callback does not load behind its back."""
    run = _launch(_crashed_copy(reference, tmp_path_factory.mktemp("no_resume_training")), data, epochs=1,
                  resume=False)
    assert run.returncode == 0, run.output[-4000:]
    assert "set resume_training: True and load_checkpoint: " in run.output
    assert re.search(r"holds checkpoints \(checked in \d+\.\d s\), but MindFormers starts", run.output)
    assert run.losses == {step: reference.losses[step] for step in range(1, 5)}  # nothing was loaded


@pytest.mark.parametrize("version", ["1.6.0", "1.7.0", "installed"])
def test_every_supported_mindformers_calls_the_guarded_steps_in_order(version: str) -> None:
    """The two functions the guard wraps exist in ``mindformers.trainer.utils``, ``base_trainer`` imports them
    by name (the patcher rebinds that copy), and ``training_process`` reads the resume context, then
    checks the runner config, both before it builds the callbacks (wheels from PyPI; 1.5 was never published)."""
    import ast
    import importlib.util
    import zipfile

    from support import mindformers_wheel

    def source(path: str) -> str:
        if version == "installed":
            return (Path(importlib.util.find_spec("mindformers").origin).parent.parent / path).read_text()
        with zipfile.ZipFile(mindformers_wheel(version)) as wheel:
            return wheel.read(path).decode()

    utils = ast.parse(source("mindformers/trainer/utils.py"))
    defined = {node.name for node in utils.body if isinstance(node, ast.FunctionDef)}
    assert {"load_resume_context_from_checkpoint", "check_runner_config"} <= defined
    trainer = ast.parse(source("mindformers/trainer/base_trainer.py"))
    imported = {alias.name for node in trainer.body if isinstance(node, ast.ImportFrom)
                and node.module in ("utils", "mindformers.trainer.utils") for alias in node.names}
    assert {"load_resume_context_from_checkpoint", "check_runner_config"} <= imported
    process = next(node for node in ast.walk(trainer) if isinstance(node, ast.FunctionDef)
                   and node.name == "training_process")
    calls = [(node.lineno, node.func.id) for node in ast.walk(process)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    first = {name: min(line for line, called in calls if called == name)
             for name in ("load_resume_context_from_checkpoint", "check_runner_config", "build_callback")}
    assert first["load_resume_context_from_checkpoint"] < first["check_runner_config"] < first["build_callback"]
