"""FT_PLUGINS_INJECT_FAULT: the fire-drill spec, parsed into faults that fire once per job."""

from __future__ import annotations

import pytest

from ft_plugins.config import ConfigError, load
from ft_plugins.faults import Fault, InjectedFault, fire, parse_faults, planned
from ft_plugins.features import declared_options


def test_spec_with_defaults_and_several_faults() -> None:
    assert parse_faults("rank=1,step=3,kind=kill") == (Fault(1, 3, "kill", "forward", 0),)
    assert parse_faults(" rank=0, step=5, kind=TERM, at=update ; rank=2,step=1,kind=hang,at=save,attempt=1 ") == (
        Fault(0, 5, "term", "update", 0), Fault(2, 1, "hang", "save", 1))
    assert parse_faults("") == ()


@pytest.mark.parametrize(("raw", "message"), [
    ("rank=1,step=3", "lacks kind"),
    ("rank=1,step=3,kind=explode", "kind='explode' is not one of kill, term, exception, exit, hang"),
    ("rank=1,step=3,kind=kill,at=backward", "at='backward' is not one of forward, update, save"),
    ("rank=-1,step=3,kind=kill", "rank='-1'"),
    ("rank=1,step=3,kind=kill,rank=2", "each once"),
    ("rank=1,step=3,kind=kill,when=now", "'when=now'"),
])
def test_bad_specs_name_the_variable_and_the_fix(raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_faults(raw)
    assert "FT_PLUGINS_INJECT_FAULT" in str(error.value) and message in str(error.value)


def test_a_fault_fires_on_its_rank_and_launcher_attempt_only() -> None:
    env = {"FT_PLUGINS_INJECT_FAULT": "rank=1,step=3,kind=kill;rank=1,step=4,kind=term,attempt=1"}
    assert planned(1, env) == (Fault(1, 3, "kill"),)
    assert planned(0, env) == ()
    assert planned(1, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == (Fault(1, 4, "term", attempt=1),)
    assert planned(1, {**env, "TORCHELASTIC_RESTART_COUNT": "2"}) == ()


def test_the_variable_is_not_an_unknown_option() -> None:
    assert load(declared_options(), env={"FT_PLUGINS_INJECT_FAULT": "rank=0,step=1,kind=kill"}).selection == "auto"


def test_exception_kind_raises() -> None:
    with pytest.raises(InjectedFault, match="rank=0,step=2,kind=exception"):
        fire(Fault(0, 2, "exception"))


def test_a_device_fault_sets_its_point_up_before_it_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    """``at=device`` (a kernel stuck on the CUDA stream first, then the fault): ``before`` runs, then the fault."""
    from ft_plugins.faults import Drill

    assert parse_faults("rank=0,step=3,kind=term,at=device,seconds=120") == (
        Fault(0, 3, "term", "device", seconds=120),)
    monkeypatch.setenv("FT_PLUGINS_INJECT_FAULT", "rank=0,step=3,kind=exception,at=device,seconds=7")
    order: list[str] = []
    drill = Drill()
    drill.reached("device", 2, before=lambda fault: order.append(f"kernel {fault.seconds} s"))
    assert order == [], "not its step"
    with pytest.raises(InjectedFault):
        drill.reached("device", 3, before=lambda fault: order.append(f"kernel {fault.seconds} s"))
    assert order == ["kernel 7 s"]
    drill.reached("device", 3, before=lambda fault: order.append("again"))
    assert order == ["kernel 7 s"], "a fault fires once"

