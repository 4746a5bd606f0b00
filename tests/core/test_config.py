"""FT_PLUGINS parsing: selections, per-feature options, and errors that name the variable."""

from __future__ import annotations

import pytest

from ft_plugins.config import ConfigError, load
from ft_plugins.features import declared_options


def _load(**env: str):
    return load(declared_options(), env=env)


@pytest.mark.parametrize(("value", "selection", "taskd"), [
    ("", "auto", None), ("auto", "auto", None), ("ALL", "all", True), ("none", "none", False),
    ("mstx", "list", False), (" taskd , mstx ", "list", True),
])
def test_selection(value: str, selection: str, taskd: bool | None) -> None:
    config = _load(FT_PLUGINS=value)
    assert config.selection == selection
    assert config.requested("taskd") is taskd


def test_options_from_env_and_code_are_typed() -> None:
    config = _load(FT_PLUGINS_TASKD_DISK_LIMIT_MB="200", FT_PLUGINS_MSTX_DATALOADER="off")
    assert config.option("taskd", "disk_limit_mb") == 200
    assert config.option("mstx", "dataloader") is False
    assert config.option("mstx", "backend") == "auto"
    override = load(declared_options(), env={}, overrides={"mstx": {"backend": "NOOP", "dataloader": True}})
    assert override.option("mstx", "backend") == "noop"
    assert override.option("mstx", "dataloader") is True


@pytest.mark.parametrize(("env", "message"), [
    ({"FT_PLUGINS": "bogus"}, "FT_PLUGINS='bogus': unknown feature 'bogus'; use auto, all, none or a comma list of: taskd, mstx"),
    ({"FT_PLUGINS": ","}, "FT_PLUGINS=',': unknown feature (empty list)"),
    ({"FT_PLUGINS_TASKD_DISK_LIMIT_MB": "lots"}, "FT_PLUGINS_TASKD_DISK_LIMIT_MB='lots' is not valid: expected a whole number"),
    ({"FT_PLUGINS_TASKD_DISK_LIMIT_MB": "0"}, "expected a number greater than 0"),
    ({"FT_PLUGINS_MSTX_BACKEND": "cuda"}, "FT_PLUGINS_MSTX_BACKEND='cuda' is not valid: expected one of auto, torch_npu, mindspore, nvtx, noop"),
    ({"FT_PLUGINS_MSTX_DATALOADER": "maybe"}, "FT_PLUGINS_MSTX_DATALOADER='maybe' is not valid: expected one of 1, true, yes, on, 0"),
    ({"FT_PLUGINS_TASKD_DISKLIMIT": "1"}, "FT_PLUGINS_TASKD_DISKLIMIT is not a known ft_plugins variable; accepted: FT_PLUGINS_STRICT"),
    ({"FT_PLUGINS_STRICT": "2"}, "FT_PLUGINS_STRICT='2' is not valid"),
    ({"FT_PLUGINS_LOG": "loud"}, "FT_PLUGINS_LOG='loud' is not valid: expected one of debug, info, warning, error"),
])
def test_bad_values_name_the_variable_and_what_it_accepts(env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        _load(**env)
    assert message in str(error.value)


def test_bad_code_overrides_name_the_feature_and_option() -> None:
    with pytest.raises(ConfigError, match="unknown option 'colour' for feature 'mstx'; known: backend"):
        load(declared_options(), env={}, overrides={"mstx": {"colour": "red"}})
    with pytest.raises(ConfigError, match="options given for unknown feature 'gpu'"):
        load(declared_options(), env={}, overrides={"gpu": {}})
