"""Detection, recipes, feature selection and the refusals of ``ft-plugins patch``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patch_cases import CASES, refused, run_cli, snapshot
from ft_plugins.patch import apply, detect, make_plan
from ft_plugins.patch.codemod import marker
from ft_plugins.patch.engine import STATE_DIR
from ft_plugins.patch.errors import RecipeError
from ft_plugins.patch.recipes import load_recipes, recipe_dir
from ft_plugins.patch.targets import TARGETS


def test_detects_each_layout_with_its_version(tmp_path: Path) -> None:
    found = {}
    for name in ("megatron-core", "mindformers-1.3.2", "torchrun", "megatron-legacy", "resnet-pytorch"):
        directory = CASES[name].build(tmp_path / name)
        detection = detect(directory)
        found[name] = (detection.target.name, detection.version)
    assert found == {
        "megatron-core": ("megatron-core", "0.17.1"),
        "mindformers-1.3.2": ("mindformers", "1.3.2"),
        "torchrun": ("torchrun", found["torchrun"][1]),
        "megatron-legacy": ("megatron-legacy", None),
        "resnet-pytorch": ("resnet-pytorch", None),
    }
    assert found["torchrun"][1].startswith("2.")


def test_a_mindspeed_llm_checkout_is_found_before_the_megatron_it_holds(tmp_path: Path) -> None:
    CASES["megatron-core"].build(tmp_path)
    CASES["mindspeed-llm"].build(tmp_path)
    detection = detect(tmp_path)
    assert detection.target.name == "mindspeed-llm" and detection.others == ("megatron-core",)
    assert "choose with --target" in detection.describe()
    assert detect(tmp_path, "megatron-core").root == tmp_path.resolve() / "megatron"


def test_unknown_layout_target_and_feature(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "main.py").write_text("print('no main_worker here')\n")
    code, out = run_cli(capsys, tmp_path)
    assert code == 3 and "does not look like a known layout" in out and "megatron-legacy" in out
    code, out = run_cli(capsys, tmp_path, "--target", "deepspeed")
    assert code == 2 and "unknown target 'deepspeed'" in out
    megatron = CASES["megatron-core"].build(tmp_path / "m")
    before = snapshot(megatron)
    code, out = run_cli(capsys, megatron, "--features", "taskd,mxtx")
    assert code == 2 and "unknown feature(s) mxtx" in out and "mstx" in out
    assert snapshot(megatron) == before


def test_features_select_edits_and_a_later_run_adds_the_rest(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    directory = CASES["megatron-legacy"].build(tmp_path)
    path = directory / "megatron" / "training.py"
    original = path.read_bytes()
    assert run_cli(capsys, directory, "--features", "taskd")[0] == 0
    text = path.read_text()
    assert marker("taskd-worker") in text and marker("step-range") not in text
    assert run_cli(capsys, directory, "--check", "--features", "taskd")[0] == 0
    code, out = run_cli(capsys, directory, "--check")
    assert code == 3 and "missing step-range, save-checkpoint-range, newest-intact-load" in out
    assert run_cli(capsys, directory)[0] == 0
    assert run_cli(capsys, directory, "--check")[0] == 0
    assert run_cli(capsys, directory, "--revert")[0] == 0
    assert path.read_bytes() == original


def test_edits_whose_hook_is_missing_are_skipped_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import ft_plugins.hooks

    monkeypatch.delattr(ft_plugins.hooks, "prepare_launcher")  # an older ft_plugins
    directory = CASES["torchrun"].build(tmp_path)
    before = snapshot(directory)
    code, out = run_cli(capsys, directory)
    assert code == 3
    assert "launcher (taskd) skipped: it calls ft_plugins.hooks.prepare_launcher" in out
    assert snapshot(directory) == before


def test_code_needing_a_name_the_file_lacks_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = CASES["mindformers-1.8.0"].build(tmp_path)
    path = directory / "trainer" / "base_trainer.py"
    path.write_text(path.read_text().replace("get_real_rank,", "").replace(", get_real_rank", ""))
    assert "needs get_real_rank in BaseTrainer.training_process()" in refused(capsys, directory)


def test_a_patched_file_missing_its_marked_import_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    directory = CASES["mindspeed-llm"].build(tmp_path)
    assert run_cli(capsys, directory, "--features", "taskd")[0] == 0
    path = directory / "mindspeed_llm" / "training" / "training.py"
    path.write_text(path.read_text().replace(f"{marker('import')}\nimport ft_plugins.hooks\n", ""))
    before = snapshot(directory)
    code, out = run_cli(capsys, directory)
    assert code == 3 and "cannot follow" in out and str(path.resolve()) in out
    assert snapshot(directory) == before


def test_mindformers_worker_starts_with_the_real_rank_on_mindspore_just_before_model_train(tmp_path: Path) -> None:
    for version in ("1.3.2", "1.8.0", "2.0.0"):
        directory = CASES[f"mindformers-{version}"].build(tmp_path / version)
        apply(make_plan(detect(directory)))
        tree = ast.parse((directory / "trainer" / "base_trainer.py").read_text())
        trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BaseTrainer")
        method = next(n for n in trainer.body if getattr(n, "name", "") == "training_process")
        calls = [ast.unparse(node.value) for node in method.body if isinstance(node, ast.Expr)]
        start = 'ft_plugins.hooks.start_taskd_worker(get_real_rank(), framework=\'ms\')'
        assert start in calls, version
        following = calls[calls.index(start) + 1]
        assert following.startswith("model.train(config.runner_config.epochs, dataset"), version


def _import_patched(path: Path, module_name: str, expression: str, cwd: Path | None = None) -> str:
    """Import a patched file as ``module_name`` in a fresh interpreter; its output of ``print(expression)``."""
    code = (
        "import importlib.util, inspect, sys\n"
        f"spec = importlib.util.spec_from_file_location({module_name!r}, sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        f"print({expression})\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], cwd=cwd, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_patched_mindformers_imports_with_the_installed_framework(tmp_path: Path) -> None:
    directory = CASES["mindformers-1.8.0"].build(tmp_path / "copy")
    apply(make_plan(detect(directory)))
    (tmp_path / "cwd").mkdir()  # mindformers logs to ./output; the copy must not shadow the installed package
    out = _import_patched(directory / "trainer" / "base_trainer.py", "mindformers.trainer.patched_base_trainer",
                          "'start_taskd_worker' in inspect.getsource(module.BaseTrainer.training_process)",
                          cwd=tmp_path / "cwd")
    assert out.strip().splitlines()[-1] == "True"


def test_patched_torchrun_imports(tmp_path: Path) -> None:
    directory = CASES["torchrun"].build(tmp_path)
    apply(make_plan(detect(directory)))
    body = _import_patched(directory / "distributed" / "run.py", "patched_run", "inspect.getsource(module.main)")
    assert body.index('ft_plugins.hooks.prepare_launcher("torchrun")') < body.index("    run(args)")


def test_every_target_has_a_recipe_and_recipes_are_found_in_the_installed_package() -> None:
    import ft_plugins

    checkout = Path(__file__).resolve().parents[2] / "patches"
    assert recipe_dir() == Path(ft_plugins.__file__).resolve().parent / "patches"
    assert {path.relative_to(recipe_dir()): path.read_bytes() for path in recipe_dir().glob("*/*.toml")} == {
        path.relative_to(checkout): path.read_bytes() for path in checkout.glob("*/*.toml")}
    for target in TARGETS:
        recipes = load_recipes(target.name)
        assert recipes, target.name
        assert all(edit.code.startswith(("ft_plugins.hooks.", "args.resume = ft_plugins.hooks."))
                   for recipe in recipes for edit in recipe.edits)


def test_malformed_recipe_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "megatron-core").mkdir()
    bad = tmp_path / "megatron-core" / "bad.toml"
    bad.write_text('target = "megatron-core"\n[[edit]]\nid = "x"\naction = "replace"\n')
    with pytest.raises(RecipeError, match="bad.toml.*lacks"):
        load_recipes("megatron-core", tmp_path)


def test_without_libcst_the_message_names_the_extra(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['libcst'] = None\n"
    result = subprocess.run([sys.executable, "-c", blocked + "import ft_plugins.patch"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "pip install ft-plugins[patch]" in result.stderr
    command = blocked + f"from ft_plugins.cli import main; sys.exit(main(['patch', {str(tmp_path)!r}]))"
    result = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True)
    assert result.returncode == 1 and "pip install ft-plugins[patch]" in result.stderr


def test_adding_edits_to_a_patched_file_whose_backup_is_gone_is_refused(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    directory = CASES["megatron-legacy"].build(tmp_path)
    assert run_cli(capsys, directory, "--features", "taskd")[0] == 0
    shutil.rmtree(directory / "megatron" / STATE_DIR)
    before = snapshot(directory)
    code, out = run_cli(capsys, directory)
    assert code == 3 and "already has ft-plugins edits but no backup" in out
    assert snapshot(directory) == before
    assert run_cli(capsys, directory, "--features", "taskd")[0] == 0  # what is there already: nothing to do
