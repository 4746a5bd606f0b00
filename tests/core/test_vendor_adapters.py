"""The TaskD and range adapters against recording stand-ins with the vendors' exact signatures."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from ft_plugins.vendors import VendorUnavailable
from ft_plugins.vendors.ranges import MstxRanges, NoopRanges, select_backend
from ft_plugins.vendors.taskd import TaskdWorker, load_worker_api
from support import FAKES


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []


def _new_mstx(recorder: Recorder) -> types.SimpleNamespace:
    def range_start(message, stream=None, domain="default"):
        recorder.calls.append(("start", message, stream, domain))
        return len(recorder.calls)

    def range_end(range_id, domain="default"):
        recorder.calls.append(("end", range_id, domain))

    def mark(message, stream=None, domain="default"):
        recorder.calls.append(("mark", message, stream, domain))

    return types.SimpleNamespace(range_start=range_start, range_end=range_end, mark=mark)


def _old_mstx(recorder: Recorder) -> types.SimpleNamespace:
    def range_start(message, stream):
        recorder.calls.append(("start", message, stream))
        return 7

    def range_end(range_id):
        recorder.calls.append(("end", range_id))

    def mark(message, stream):
        recorder.calls.append(("mark", message, stream))

    return types.SimpleNamespace(range_start=range_start, range_end=range_end, mark=mark)


def test_mstx_with_domain_puts_only_device_ranges_on_the_stream() -> None:
    recorder = Recorder()
    ranges = MstxRanges("torch_npu", _new_mstx(recorder), lambda: "S")
    step = ranges.range_start("step 3", True)
    host = ranges.range_start("dataloader")
    ranges.range_end(host)
    ranges.range_end(step)
    assert recorder.calls == [("start", "step 3", "S", "default"), ("start", "dataloader", None, "default"),
                              ("end", 2, "default"), ("end", 1, "default")]


def test_older_mstx_always_gets_the_stream_and_no_domain() -> None:
    recorder = Recorder()
    ranges = MstxRanges("torch_npu", _old_mstx(recorder), lambda: "S")
    ranges.range_end(ranges.range_start("dataloader"))
    assert recorder.calls == [("start", "dataloader", "S"), ("end", 7)]


def test_a_failed_range_start_returns_no_handle_and_skips_the_end() -> None:
    recorder = Recorder()
    mstx = _new_mstx(recorder)
    mstx.range_start = lambda message, stream=None, domain="default": 0  # mstx's "failed" id
    ranges = MstxRanges("torch_npu", mstx, lambda: "S")
    ranges.range_end(ranges.range_start("step 1", True))
    assert recorder.calls == []


def test_a_raising_vendor_is_logged_once_and_ranges_go_quiet(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("device lost")

    ranges = MstxRanges("torch_npu", types.SimpleNamespace(range_start=broken, range_end=broken, mark=broken),
                        lambda: "S")
    for _ in range(3):
        ranges.range_end(ranges.range_start("step", True))
    assert len(calls) == 1
    assert caplog.text.count("ranges are off for this process") == 1


def test_noop_backend_and_explicit_choice() -> None:
    backend = select_backend("pt", "noop")
    assert isinstance(backend, NoopRanges)
    assert backend.range_start("x", True) is None


def test_auto_never_picks_noop_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(VendorUnavailable, match="no profiler runtime .*torch_npu.*nvtx"):
        select_backend("pt")


@pytest.mark.usefixtures("isolated_vendor_modules")
def test_taskd_absent_and_placeholder_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(VendorUnavailable, match="TaskD is not installed"):
        load_worker_api()
    monkeypatch.syspath_prepend(str(FAKES / "placeholder_taskd"))
    with pytest.raises(VendorUnavailable, match="it is the PyPI placeholder, not Ascend's TaskD"):
        load_worker_api()


def test_worker_starts_once_and_checks_its_framework_tag() -> None:
    calls = []
    api = types.SimpleNamespace(
        init_taskd_worker=lambda rank, limit, framework: calls.append((rank, limit, framework)) or True,
        start_taskd_worker=lambda: calls.append("start") or True,
    )
    worker = TaskdWorker(api, 300)
    assert worker.start(5, "ms") and worker.start(5, "ms")
    assert calls == [(5, 300, "ms"), "start"]
    with pytest.raises(ValueError, match="framework must be one of"):
        TaskdWorker(api, 300).start(0, "tf")


def test_a_raising_nvtx_is_logged_once_and_goes_quiet(caplog: pytest.LogCaptureFixture) -> None:
    from ft_plugins.vendors.ranges import NvtxRanges

    calls = []

    class Nvtx:
        def range_start(self, message):
            calls.append(message)
            raise RuntimeError("no CUDA driver")

        def range_end(self, handle):
            calls.append(handle)

    ranges = NvtxRanges(Nvtx())
    with caplog.at_level(logging.WARNING, logger="ft_plugins"):
        assert ranges.range_start("step 1") is None and ranges.range_start("step 2") is None
    assert calls == ["step 1"] and caplog.text.count("ranges are off for this process") == 1


def test_doctor_and_the_features_read_one_table_of_minimum_versions() -> None:
    from ft_plugins.launch import doctor
    from ft_plugins.vendors import versions

    assert doctor.FRAMEWORKS is versions.SUPPORTED
    assert versions.BY_NAME["torch_npu"].oldest == versions.TORCH_NPU_MSTX
    assert versions.BY_NAME["megatron-core"].oldest == versions.MEGATRON_CORE


def test_a_version_stands_inside_or_outside_its_range() -> None:
    """The newest bound is a release line: 0.19 covers 0.19.2, not 0.20; the oldest is a release."""
    from ft_plugins.vendors import versions

    megatron = versions.BY_NAME["megatron-core"]
    assert [megatron.standing(found) for found in ("0.7.0", "0.8", "0.17.1", "0.19.2", "0.20.0", "dev")] == [
        versions.OLDER, versions.INSIDE, versions.INSIDE, versions.INSIDE, versions.NEWER, versions.UNKNOWN]
    assert versions.BY_NAME["accelerate"].standing("1.99.0") == versions.INSIDE
    assert versions.BY_NAME["torch_npu"].standing("9.0") == versions.INSIDE  # no newest: never "newer"


def test_the_suite_runs_the_releases_the_table_names_as_tested() -> None:
    """Each release the table calls tested is one set-up pins (scripts/requirements*.txt, scripts/setup.sh), and
    the one installed here is one of them (the others are installed beside it)."""
    import importlib.metadata

    from support import REPO

    from ft_plugins.vendors import versions

    scripts = REPO / "scripts"
    pinned = "".join(path.read_text() for path in [*scripts.glob("requirements*.txt"), scripts / "setup.sh"])
    for framework in versions.SUPPORTED:
        for release in framework.tested:
            assert f"{framework.distribution}=={release}" in pinned, (framework, release)
            assert framework.standing(release) == versions.INSIDE, (framework, release)
        if framework.tested:
            installed = importlib.metadata.version(framework.distribution).split("+")[0]  # torch's +cpu
            assert installed in framework.tested, framework


def test_the_extras_ask_for_the_oldest_release_the_table_supports() -> None:
    """``pip install 'ft-plugins[mindspore]'`` must not accept a release the features turn themselves off on."""
    import tomllib

    from packaging.requirements import Requirement

    from support import REPO

    from ft_plugins.vendors import versions

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = {}
    for requirement in (Requirement(line) for lines in extras.values() for line in lines):
        framework = versions.BY_NAME.get(requirement.name)
        if framework is not None and requirement.specifier:
            bounds[requirement.name] = {spec.version for spec in requirement.specifier if spec.operator == ">="}
            assert bounds[requirement.name] == {framework.oldest}, (requirement, framework.oldest)
    assert {"torch", "mindspore", "mindformers"} <= set(bounds)
