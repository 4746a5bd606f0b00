"""enable()/disable() on the real megatron modules: idempotent, reversible, every reference, any import order."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import FAKES, PYTHON, REPO, read_records

FIXTURES = REPO / "tests" / "torch_megatron" / "fixtures"
TARGETS = (
    ("megatron.training.training", "train_step"),
    ("megatron.training.checkpointing", "save_checkpoint"),
    ("megatron.training.training", "save_checkpoint"),
    ("megatron.training.initialize", "initialize_megatron"),
    ("megatron.training.training", "initialize_megatron"),
)


@pytest.fixture
def ft_torch(no_ft_env, isolated_vendor_modules, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """ft_plugins.torch with the vendor fakes importable, disabled again afterwards."""
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.setenv("FT_FAKE_RECORD", str(tmp_path / "calls.jsonl"))
    import ft_plugins.torch as ft_torch

    yield ft_torch
    ft_torch.disable()


def _current() -> list[object]:
    return [getattr(sys.modules[module], name) for module, name in TARGETS]


def test_enable_is_idempotent_and_disable_restores_the_exact_originals(ft_torch) -> None:
    import megatron.training.training  # noqa: F401

    ft_torch.disable()
    originals = _current()
    ft_torch.enable("taskd,mstx")
    ft_torch.enable("taskd,mstx")
    patched = _current()
    for before, after in zip(originals, patched):
        assert after is not before
        assert after.__wrapped__ is before  # wrapped exactly once, not stacked
    ft_torch.disable()
    assert all(now is before for now, before in zip(_current(), originals))
    ft_torch.disable()  # a second disable is harmless
    assert all(now is before for now, before in zip(_current(), originals))


def test_a_reconfiguration_makes_one_pass_over_the_modules_globals(ft_torch, monkeypatch: pytest.MonkeyPatch) -> None:
    """enable() again (a warm spare taking over a rank) removes and re-applies every patch set: one pass over
    the modules, not one per patch set and module, and each target wrapped once."""
    from ft_plugins import patching

    import megatron.training.training  # noqa: F401

    ft_torch.disable()
    originals = _current()
    ft_torch.enable("taskd,mstx")
    passes: list[int] = []
    scan = patching._scan
    monkeypatch.setattr(patching, "_scan", lambda replacements, imported=None: (passes.append(len(replacements)),
                                                                                 scan(replacements, imported)))
    ft_torch.enable("taskd,mstx")
    assert len(passes) == 1, passes
    for before, after in zip(originals, _current()):
        assert after.__wrapped__ is before
    ft_torch.disable()
    assert len(passes) == 2 and _current() == originals


def test_a_module_that_copied_train_step_before_enable_is_patched_and_restored(ft_torch) -> None:
    sys.path.insert(0, str(FIXTURES))
    try:
        import mindspeed_llm.training.training as mindspeed
    finally:
        sys.path.remove(str(FIXTURES))
    ft_torch.disable()
    original = mindspeed.train_step
    ft_torch.enable("mstx", mstx={"backend": "noop"})
    assert mindspeed.train_step is sys.modules["megatron.training.training"].train_step
    assert mindspeed.train_step.__wrapped__ is original
    ft_torch.disable()
    assert mindspeed.train_step is original


def test_only_the_selected_features_hook_in(ft_torch, tmp_path) -> None:
    import megatron.training.training  # noqa: F401

    ft_torch.disable()
    originals = _current()
    runtime = ft_torch.enable("taskd")
    assert set(runtime.features) == {"taskd"}
    now = _current()
    assert now[0] is originals[0] and now[1] is originals[1]  # no mstx hooks
    assert now[3] is not originals[3]


def _python(code: str, *paths, **env: str) -> subprocess.CompletedProcess:
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(str(p) for p in paths), **env}
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=environment, timeout=120)


def test_import_before_megatron_patches_when_megatron_arrives(tmp_path) -> None:
    record = tmp_path / "calls.jsonl"
    code = (
        "import ft_plugins.torch, sys\n"
        "assert 'megatron.training.training' not in sys.modules\n"
        "import megatron.training.training as t\n"
        "print(type(t.train_step).__name__, t.train_step.__wrapped__.__module__)\n"
    )
    result = _python(code, FAKES, FT_FAKE_RECORD=str(record))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["FunctionWrapper", "megatron.training.training"]


@pytest.mark.parametrize("first", ["checkpointing", "training"])
def test_a_moved_symbol_disables_that_feature_whole_and_names_the_version(first: str) -> None:
    other = {"checkpointing": "training", "training": "checkpointing"}[first]
    code = (
        "import ft_plugins.torch, ft_plugins.runtime as r\n"
        f"import megatron.training.{first}, megatron.training.{other}\n"
        "import megatron.training.checkpointing as c, megatron.training.training as t\n"
        "print(type(c.save_checkpoint).__name__, t.train(), r.current('pt').report()['mstx']['enabled'])\n"
    )
    result = _python(code, FIXTURES / "moved_megatron", FT_PLUGINS="mstx", FT_PLUGINS_MSTX_BACKEND="noop")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["function", "trained", "False"]
    assert "mstx disabled: megatron.training.training.train_step is missing in megatron 0.3.0" in result.stderr


def test_a_moved_symbol_turns_all_of_ttp_off_and_the_fire_drill_says_so_too() -> None:
    """ttp's hooks (replicas' validate_args, the engine's step and checkpoint wrappers) are one patch set: the
    missing train_step takes validate_args' wrapper away too; the fire drill, not a feature, says so itself."""
    code = (
        "import ft_plugins.torch, ft_plugins.runtime as r\n"
        "import megatron.training.arguments as a\n"
        "print(type(a.validate_args).__name__)\n"
        "import megatron.training.training, megatron.training.checkpointing as c\n"
        "print(type(a.validate_args).__name__, type(c.save_checkpoint).__name__, r.current('pt').report()['ttp'])\n"
    )
    result = _python(code, FIXTURES / "moved_megatron", FT_PLUGINS="ttp", FT_PLUGINS_TTP_ENGINE="builtin",
                     FT_PLUGINS_INJECT_FAULT="rank=0,step=1,kind=exception")
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.splitlines()
    assert before == "FunctionWrapper" and after.startswith("function function {'enabled': False")
    missing = "megatron.training.training.train_step is missing in megatron 0.3.0"
    assert result.stderr.count(f"ttp disabled: {missing}") == 1
    assert result.stderr.count(f"faults off: {missing}") == 1


def test_strict_mode_stops_before_training_when_a_requested_feature_is_missing() -> None:
    result = _python("import ft_plugins.torch", FT_PLUGINS="taskd", FT_PLUGINS_STRICT="1")
    assert result.returncode != 0
    assert "FeatureUnavailable: taskd was requested but is unavailable: TaskD is not installed" in result.stderr


def test_bad_configuration_is_one_clear_error_and_the_import_still_succeeds() -> None:
    result = _python("import ft_plugins.torch as t; print(t.runtime())", FT_PLUGINS="bogus")
    assert result.returncode == 0
    assert result.stdout.strip() == "None"
    assert "FT_PLUGINS='bogus': unknown feature 'bogus'; use auto, all, none or a comma list of:" in result.stderr


def test_import_loads_neither_torch_npu_nor_mindspore() -> None:
    """Nor MindIO (its wheel imports torch_npu) with ttp's MindIO engine on, nor, with the features ``auto``
    finds here, what is imported on first use only (checkpoint logic, replica layout, the dump engine). The
    fakes make torch_npu and mindio_ttp importable, so a stray import shows (the control proves the probe sees
    one). mstx is left out: on an Ascend node its backend is torch_npu's own mstx, found at start."""
    probe = "import sys, ft_plugins.torch; print(sorted(m for m in {!r} if m in sys.modules))"
    vendors = probe.format(('torch_npu', 'mindio_ttp', 'mindspore', 'megatron'))
    features = {"FT_PLUGINS": "taskd,ttp,resume", "TTP_ADDR": "127.0.0.1"}  # ttp's engine: mindio, found
    result = _python(vendors, FAKES, **features)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
    control = _python("import mindio_ttp; " + vendors, FAKES, **features)
    assert control.stdout.strip() == "['mindio_ttp']", control.stderr
    lazy = probe.format(('mindspore', 'megatron', 'ft_plugins.checkpoint.select', 'ft_plugins.checkpoint.layouts',
                         'ft_plugins.replicas', 'ft_plugins.torch.megatron.ttp', 'ft_plugins.steps',
                         'ft_plugins.triggers'))
    result = _python(lazy, FT_PLUGINS="auto")
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_hooks_without_a_rank_warn_once_and_start_nothing(tmp_path) -> None:
    record = tmp_path / "calls.jsonl"
    code = "import ft_plugins.hooks as h; print(h.start_taskd_worker(), h.start_taskd_worker())"
    result = _python(code, FAKES, FT_FAKE_RECORD=str(record), FT_PLUGINS="taskd", WORLD_SIZE="2")
    assert result.stdout.split() == ["False", "False"]
    assert result.stderr.count("cannot determine the global rank") == 1
    assert read_records(record) == []


def test_ranges_stay_balanced_when_a_step_raises(ft_torch, tmp_path) -> None:
    import megatron.training.training as training

    ft_torch.enable("mstx")
    assert ft_torch.runtime().feature("mstx").ranges.name == "torch_npu"
    with pytest.raises(AssertionError, match="args is not initialized"):
        training.train_step(None, iter([]), [], None, None, None, None, iteration=5)  # no megatron args yet
    calls = [(c["api"], c["args"][0]) for c in read_records(tmp_path / "calls.jsonl")]
    assert calls == [("mstx.range_start", "step 5"), ("mstx.range_end", 1)]


def test_features_command_reports_and_rejects_bad_configuration() -> None:
    ok = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "features", "--json"], capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin", "FT_PLUGINS": "none"}, timeout=60)
    assert ok.returncode == 0
    assert '"reason": "switched off (FT_PLUGINS=none)"' in ok.stdout
    bad = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "features"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "FT_PLUGINS_MSTX_BACKEND": "gpu"}, timeout=60)
    assert bad.returncode == 2
    assert "FT_PLUGINS_MSTX_BACKEND='gpu' is not valid" in bad.stderr


def test_prepare_launcher_applies_taskds_agent_patch_in_the_launcher_process(tmp_path) -> None:
    record = tmp_path / "calls.jsonl"
    code = "import ft_plugins.hooks as h; print(h.prepare_launcher('torchrun'), h.prepare_launcher('msrun'))"
    result = _python(code, FAKES, FT_FAKE_RECORD=str(record), FT_PLUGINS="taskd")
    assert result.stdout.split() == ["True", "False"], result.stderr
    assert [c["api"] for c in read_records(record)] == ["taskd.python.adaptor.patch imported"]
    missing = _python(code, FAKES / "placeholder_taskd", FT_PLUGINS="taskd")
    assert missing.returncode == 0 and missing.stdout.split() == ["False", "False"]


def test_source_hooks_follow_the_mstx_options(tmp_path) -> None:
    record = tmp_path / "calls.jsonl"
    code = (
        "import ft_plugins.hooks as h\n"
        "with h.named_range('save_checkpoint'): pass\n"
        "with h.named_range('forward'): pass\n"
        "with h.step_range(3): pass\n"
    )
    result = _python(code, FAKES, FT_FAKE_RECORD=str(record), FT_PLUGINS="mstx", FT_PLUGINS_MSTX_SAVE_CHECKPOINT="off")
    assert result.returncode == 0, result.stderr
    starts = [c["args"][0] for c in read_records(record) if c["api"] == "mstx.range_start"]
    assert starts == ["forward", "step 3"]
