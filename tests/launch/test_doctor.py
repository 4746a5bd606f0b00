"""``ft-plugins doctor`` on crafted environments: each check goes OK, WARN or FAIL for the right reason."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launch_support import Vendors
from support import FAKES, PYTHON

from ft_plugins.launch import doctor, installation
from ft_plugins.vendors import taskd


@pytest.fixture(scope="module")
def swept() -> installation.Imports:
    """One real import of every module of the package, in a fresh interpreter (each framework imported: some 20 s
    of CPU), shared by this module's checks; ``test_install_check.py`` tests the sweep itself."""
    return installation.import_every_module()


@pytest.fixture(autouse=True)
def _one_sweep(swept: installation.Imports, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installation, "import_every_module", lambda: swept)


def _by_name(env: dict[str, str]) -> dict[str, doctor.Check]:
    return {check.name: check for check in doctor.run_checks(env)}


@pytest.fixture
def with_taskd(vendors: Vendors, monkeypatch: pytest.MonkeyPatch, isolated_vendor_modules, tmp_path: Path) -> Vendors:
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.syspath_prepend(str(vendors.site))
    monkeypatch.setattr(taskd, "PROFILING_DIR", str(tmp_path / "profiling"))
    return vendors


def test_clean_node_with_taskd_and_cann(with_taskd: Vendors, tmp_path: Path) -> None:
    (tmp_path / "profiling").mkdir()
    env = {"ASCEND_HOME_PATH": str(with_taskd.cann), "LD_PRELOAD": f"{with_taskd.libmspti}:{with_taskd.libtaskd}",
           "MS_ENABLE_TFT": "{TTP:1,TSP:1}", "PATH": "/nonexistent", "RANK": "0", "MINDX_TASK_ID": "j",
           "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MINDX_SERVER_IP": "10.0.0.9", "POD_IP": "10.0.0.1",
           "TTP_PORT": "8000"}
    checks = _by_name(env)
    for name in ("libtaskd.so", "libmspti.so", "MS_ENABLE_TFT", "TaskD manager", "profiling directory", "CANN version"):
        assert checks[name].status == doctor.OK, checks[name]
    assert "8.2.RC1" in checks["CANN version"].detail
    assert "'node_nums': 2" in checks["TaskD manager"].detail
    # TaskD's 3-parameter launch_agent against torch 2.13: adapted by ft-plugins run, so a warning
    assert checks["TaskD launch_agent"].status == doctor.WARN and "health_check_server" in checks["TaskD launch_agent"].detail
    import torch.distributed.launcher.api as api

    assert api.launch_agent.__module__ == "torch.distributed.launcher.api"  # the probe put torch's own back


def test_the_guides_sed_into_run_py_fails(with_taskd: Vendors, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "TASKD_SED_LINE", "def main(")  # as if run.py held the vendor's import line
    check = _by_name({"PATH": "/nonexistent"})["TaskD launch_agent"]
    assert check.status == doctor.FAIL and "TypeError" in check.detail and "ft-plugins run" in check.fix


def test_preload_problems(with_taskd: Vendors, tmp_path: Path) -> None:
    link = tmp_path / "libtaskd.so"
    link.symlink_to(with_taskd.libtaskd)
    env = {"ASCEND_HOME_PATH": str(with_taskd.cann), "LD_PRELOAD": f"{link} /gone/libold.so", "PATH": "/nonexistent"}
    checks = doctor.run_checks(env)
    statuses = {(c.name, c.status) for c in checks}
    assert ("libtaskd.so", doctor.FAIL) in statuses and ("libmspti.so", doctor.WARN) in statuses
    assert any(c.name == "LD_PRELOAD entry" and "/gone/libold.so" in c.detail for c in checks)
    assert next(c for c in checks if c.name == "libtaskd.so").fix == f"use the real path {with_taskd.libtaskd}"


def test_manager_environment_and_tft_mistakes(with_taskd: Vendors) -> None:
    env = {"PATH": "/nonexistent", "MS_ENABLE_TFT": "{TTP: 1}", "MS_SCHED_HOST": "10.0.0.1", "POD_IP": "10.0.0.1",
           "MINDX_TASK_ID": "j", "MS_WORKER_NUM": "16", "MS_LOCAL_WORKER": "8"}
    checks = _by_name(env)
    assert checks["MS_ENABLE_TFT"].status == doctor.FAIL and "'TTP: 1'" in checks["MS_ENABLE_TFT"].detail
    manager = checks["TaskD manager"]
    assert manager.status == doctor.WARN and "MINDX_SERVER_IP" in manager.detail and "TTP_PORT" in manager.detail
    assert checks["profiling directory"].status == doctor.WARN  # not mounted here


def test_placeholders_fail(monkeypatch: pytest.MonkeyPatch, isolated_vendor_modules) -> None:
    monkeypatch.syspath_prepend(str(FAKES / "placeholder_taskd"))
    check = _by_name({"PATH": "/nonexistent"})["taskd package"]
    assert check.status == doctor.FAIL and "pip uninstall taskd" in check.fix


def test_msruns_python_must_have_ft_plugins(tmp_path: Path) -> None:
    system_python = Path("/usr/bin/python3")
    if not system_python.exists():
        pytest.skip("needs a second interpreter without ft_plugins")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "msrun").write_text("#!/bin/sh\n")
    (bin_dir / "msrun").chmod(0o755)
    (bin_dir / "python").symlink_to(system_python)
    bad = _by_name({"PATH": str(bin_dir), "PYTHONPATH": ""})["msrun's python"]
    assert bad.status == doctor.FAIL and "cannot import ft_plugins" in bad.detail
    (bin_dir / "python").unlink()
    # the environment's own interpreter (a symlink elsewhere is not the venv: Python looks for pyvenv.cfg
    # beside the path it was started as)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {PYTHON} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    good = _by_name({"PATH": str(bin_dir), "PYTHONPATH": ""})["msrun's python"]
    assert good.status == doctor.OK


def test_existing_sitecustomize_is_reported(vendors: Vendors, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(vendors.chained))
    check = _by_name({"PATH": "/nonexistent"})["sitecustomize"]
    assert check.status == doctor.OK and str(vendors.chained / "sitecustomize.py") in check.detail


def test_old_cann_warns(tmp_path: Path) -> None:
    (tmp_path / "lib64").mkdir()
    (tmp_path / "ascend_toolkit_install.info").write_text("version=8.1.RC1\n")
    check = _by_name({"PATH": "/nonexistent", "ASCEND_HOME_PATH": str(tmp_path)})["CANN version"]
    assert check.status == doctor.WARN and "8.1.RC1" in check.detail


def test_doctor_command_exit_code_and_json(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(FAKES / "placeholder_taskd")}
    result = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "doctor", "--json"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    import json

    checks = json.loads(result.stdout)
    assert {"name": "taskd package", "status": "FAIL"}.items() <= next(c for c in checks if c["name"] == "taskd package").items()
    table = subprocess.run([PYTHON, "-m", "ft_plugins.cli", "doctor"], env={**env, "PYTHONPATH": ""},
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "FAIL" not in table.stdout and "torch version" in table.stdout


def test_each_installed_framework_is_shown_against_its_supported_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the range: OK naming it; newer than the newest tested or older than the oldest: WARN with the fix."""
    found = {"transformers": "5.24.0", "megatron-core": "0.20.0", "mindspore": "2.6.0"}
    monkeypatch.setattr(doctor, "_version", found.get)
    checks = _by_name({"PATH": "/nonexistent"})
    assert checks["transformers version"].status == doctor.OK
    assert "supported: 4.40 to 5.x" in checks["transformers version"].detail
    assert checks["megatron-core version"].status == doctor.WARN and "newer" in checks["megatron-core version"].detail
    assert "0.19.x" in checks["megatron-core version"].fix
    mindspore = checks["mindspore version"]
    assert mindspore.status == doctor.WARN and "older than 2.7.0" in mindspore.detail
    assert checks["torch version"].detail.startswith("not installed")


@pytest.mark.parametrize("transformers, torch, env, warned", [
    ("4.40.2", "2.13.0", {}, True), ("4.47.1", "2.6.0", {}, True), ("4.48.0", "2.13.0", {}, False),
    ("4.40.2", "2.5.1", {}, False), ("4.40.2", "2.13.0", {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, False)])
def test_an_old_trainer_on_a_torch_that_loads_weights_only_is_warned(
        monkeypatch: pytest.MonkeyPatch, transformers: str, torch: str, env: dict, warned: bool) -> None:
    monkeypatch.setattr(doctor, "_version", {"transformers": transformers, "torch": torch}.get)
    check = _by_name({"PATH": "/nonexistent", **env}).get("transformers with torch")
    assert (check is not None) == warned
    if warned:
        assert check.status == doctor.WARN and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in check.fix
