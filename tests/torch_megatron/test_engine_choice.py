"""Which dying-gasp engine runs on PyTorch, and the one log line that says why."""

from __future__ import annotations

import logging
import sys

import pytest

from ft_plugins.runtime import activate
from support import FAKES, old_mindio, statuses

MINDSPEED_LLM_SHAPED = FAKES.parent / "torch_megatron" / "fixtures"  # holds a package named mindspeed_llm


def _ttp(env: dict[str, str]) -> tuple[bool, str, object]:
    runtime = activate("pt", env=env)
    status = runtime.statuses["ttp"]
    feature = runtime.feature("ttp")
    runtime.stop()
    return status.enabled, status.reason, getattr(feature, "engine", None)


@pytest.fixture
def clean(no_ft_env, isolated_vendor_modules, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("HIGH_AVAILABILITY", raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py"])
    return monkeypatch


def test_auto_never_turns_the_builtin_engine_on(clean: pytest.MonkeyPatch) -> None:
    enabled, reason, _ = _ttp({})
    assert not enabled
    assert "built-in engine runs only when ttp is asked for" in reason


@pytest.mark.parametrize("selection", ["ttp", "all", "ttp,resume"])
def test_asked_for_without_mindio_runs_the_builtin_engine(clean: pytest.MonkeyPatch, selection: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ft_plugins"):
        enabled, reason, engine = _ttp({"FT_PLUGINS": selection})
    assert (enabled, engine) == (True, "builtin")
    lines = statuses((r.getMessage() for r in caplog.records), "ttp")
    assert lines == ["ttp enabled (engine builtin (MindIO TTP is not installed): dump on a fatal error or SIGTERM)"]


def test_engine_option_is_checked(clean: pytest.MonkeyPatch) -> None:
    from ft_plugins.config import ConfigError

    with pytest.raises(ConfigError, match="FT_PLUGINS_TTP_ENGINE='gpu' is not valid: expected one of auto, mindio, builtin"):
        activate("pt", env={"FT_PLUGINS": "ttp", "FT_PLUGINS_TTP_ENGINE": "gpu"})
    enabled, reason, engine = _ttp({"FT_PLUGINS": "ttp", "FT_PLUGINS_TTP_ENGINE": "builtin"})
    assert (enabled, engine) == (True, "builtin") and "engine builtin (asked for)" in reason
    enabled, reason, _ = _ttp({"FT_PLUGINS": "ttp", "FT_PLUGINS_TTP_ENGINE": "mindio"})
    assert not enabled and "engine mindio asked for, but MindIO TTP is not installed" in reason


def test_mindio_present_is_chosen_without_importing_it(clean: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import sys

    clean.syspath_prepend(str(FAKES))
    clean.setenv("TTP_ADDR", "10.0.0.1")
    with caplog.at_level(logging.INFO, logger="ft_plugins"):
        enabled, reason, engine = _ttp({"FT_PLUGINS": "ttp"})
    assert "mindio_ttp" not in sys.modules and "torch_npu" not in sys.modules  # never at import ft_plugins.torch
    assert (enabled, engine) == (True, "mindio")
    assert statuses((r.getMessage() for r in caplog.records), "ttp") == [
        "ttp enabled (engine mindio (mindio_ttp is installed): MindIO TTP controller 10.0.0.1:8000, TLS off)"]


def test_mindio_addresses_port_and_tls_from_options(clean: pytest.MonkeyPatch) -> None:
    from ft_plugins.vendors import VendorUnavailable
    from ft_plugins.vendors.mindio import Endpoint, endpoint

    clean.syspath_prepend(str(FAKES))
    env = {"CONTROLLER_ADDR": "10.0.0.1", "PROCESSOR_ADDR": "10.0.0.2", "TTP_ADDR": "10.0.0.3"}
    assert endpoint(env) == Endpoint("10.0.0.1", "10.0.0.2", 8000, "")
    assert endpoint({"TTP_ADDR": "10.0.0.3"}) == Endpoint("10.0.0.3", "10.0.0.3", 8000, "")
    assert endpoint({"TTP_ADDR": "10.0.0.3", "TTP_PORT": "8123"}).port == 8123  # the job template's variable
    assert endpoint({"TTP_ADDR": "10.0.0.3", "TTP_PORT": "8123"}, port=8100).port == 8100  # FT_PLUGINS_TTP_PORT wins
    with pytest.raises(VendorUnavailable, match="TTP_PORT='eighty' is not a port number"):
        endpoint({"TTP_ADDR": "10.0.0.3", "TTP_PORT": "eighty"})
    clean.setenv("TTP_ADDR", "10.0.0.3")
    enabled, reason, _ = _ttp({"FT_PLUGINS": "ttp", "FT_PLUGINS_TTP_ADDR": "10.0.0.9", "FT_PLUGINS_TTP_PORT": "8100",
                               "FT_PLUGINS_TTP_TLS_INFO": "tls.conf"})
    assert enabled and reason.endswith("MindIO TTP controller 10.0.0.9:8100, TLS on")


@pytest.fixture
def mindio_unconfigured(clean: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """MindIO installed, no controller address: a node where nothing set MindIO up for this job."""
    clean.syspath_prepend(str(FAKES))
    for name in ("TTP_ADDR", "CONTROLLER_ADDR", "PROCESSOR_ADDR"):
        clean.delenv(name, raising=False)
    return clean


@pytest.mark.parametrize("selection", ["ttp", "all"])
def test_mindio_installed_but_not_configured_runs_the_builtin_engine_and_says_what_would_switch_mindio_on(
        mindio_unconfigured: pytest.MonkeyPatch, selection: str) -> None:
    enabled, reason, engine = _ttp({"FT_PLUGINS": selection})
    assert (enabled, engine) == (True, "builtin")
    assert reason.startswith("engine builtin (MindIO TTP is installed but not configured: no MindIO controller "
                             "address: set TTP_ADDR")
    assert "FT_PLUGINS_TTP_ENGINE=mindio insists on it" in reason


def test_only_the_mindio_engine_option_insists_on_mindio(mindio_unconfigured: pytest.MonkeyPatch) -> None:
    enabled, reason, _ = _ttp({"FT_PLUGINS": "ttp", "FT_PLUGINS_TTP_ENGINE": "mindio"})
    assert not enabled and reason.startswith("no MindIO controller address: set TTP_ADDR")
    enabled, reason, _ = _ttp({})  # auto never turns the built-in engine on
    assert not enabled and reason.startswith("MindIO TTP is installed but not configured: no MindIO controller")


@pytest.mark.parametrize(("selection", "recover_on"), [("all", True), ("recover,ttp", True), ("recover", False)])
def test_recover_is_decided_with_ttp_in_every_process(mindio_unconfigured: pytest.MonkeyPatch, selection: str,
                                                      recover_on: bool) -> None:
    """One decision for the launcher and the workers: recover is on exactly where ttp runs, in activation
    itself (the launcher activates the same features before it switches torchrun to in-place mode)."""
    runtime = activate("pt", env={"FT_PLUGINS": selection})
    recover = runtime.statuses["recover"]
    runtime.stop()
    assert recover.enabled is recover_on
    if not recover_on:
        assert recover.reason == ("it needs ttp, which is off (switched off (not in the selected features)): "
                                  "FT_PLUGINS=recover,ttp")


@pytest.mark.parametrize(("setting", "named"), [
    ({"HIGH_AVAILABILITY": "dump"}, "MindSpeed-LLM's native high availability (HIGH_AVAILABILITY=dump)"),
    ({"argv": "--enable-high-availability"}, "MindSpeed-LLM's native high availability (--enable-high-availability)"),
    ({"argv": "--ttp-enabled"}, "MindSpeed's own TTP (--ttp-enabled)"),
])
@pytest.mark.parametrize("mindio", [False, True], ids=["no-mindio", "mindio"])
def test_steps_aside_for_native_high_availability(clean: pytest.MonkeyPatch, setting: dict, named: str, mindio: bool,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    if mindio:
        clean.syspath_prepend(str(FAKES))
        clean.setenv("TTP_ADDR", "127.0.0.1")
    if "argv" in setting:
        clean.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2", setting["argv"]])
    else:
        clean.setenv("HIGH_AVAILABILITY", setting["HIGH_AVAILABILITY"])
        clean.syspath_prepend(str(MINDSPEED_LLM_SHAPED))
    with caplog.at_level(logging.INFO, logger="ft_plugins"):
        enabled, reason, _ = _ttp({"FT_PLUGINS": "ttp"})
    assert not enabled
    assert reason == f"{named} is on: its own dying-gasp wiring runs, ttp steps aside"
    assert len(statuses((r.getMessage() for r in caplog.records), "ttp")) == 1


def test_high_availability_without_mindspeed_llm_leaves_ttp_on_and_says_so(clean: pytest.MonkeyPatch) -> None:
    """MindCluster's operator sets HIGH_AVAILABILITY for any PyTorch job with a recover strategy; on plain
    Megatron nothing reads it, so stepping aside would leave the job without a dying gasp."""
    clean.setenv("HIGH_AVAILABILITY", "dump")
    clean.delitem(sys.modules, "mindspeed_llm", raising=False)  # imported in-process by an earlier test
    enabled, reason, engine = _ttp({"FT_PLUGINS": "ttp"})
    assert (enabled, engine) == (True, "builtin")
    assert reason.endswith("; HIGH_AVAILABILITY=dump is set, but without MindSpeed-LLM nothing else wires a dump")


def test_mindio_with_the_old_api_is_named_and_training_goes_on(clean: pytest.MonkeyPatch, tmp_path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A MindIO from before the tft_* rename (ttp_* functions) is not driven: said once, never a crash."""
    from ft_plugins.torch.megatron.ttp import MegatronTtp

    old_mindio(tmp_path)
    clean.syspath_prepend(str(tmp_path))
    clean.setenv("TTP_ADDR", "127.0.0.1")
    runtime = activate("pt", env={"FT_PLUGINS": "ttp"})
    try:
        engine = MegatronTtp(runtime.feature("ttp"), strict=False).mindio
        with caplog.at_level(logging.WARNING, logger="ft_plugins"):
            assert engine.initialize_distributed(lambda: "initialized", None, (), {}) == "initialized"
    finally:
        runtime.stop()
    assert engine.process is None
    assert [r.getMessage() for r in caplog.records if r.name == "ft_plugins.ttp"] == [
        "ttp: the mindio engine is off for this run: VendorUnavailable: the installed mindio_ttp has the old ttp_* "
        "API, which neither MindSpore nor ft_plugins drives; install the mindio_ttp wheel of MindCluster 6.0 or "
        "newer (tft_* API)"]
