"""What the documentation says another project does, checked in that project's installed source (read as text,
never imported): a release that changes it turns this red before the page misleads anyone."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from support import REPO


def source(module: str) -> str:
    spec = importlib.util.find_spec(module.split(".")[0])
    assert spec is not None and spec.origin is not None, f"{module} is not installed"
    return (Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")).read_text()


def page(name: str) -> str:
    return (REPO / "docs" / name).read_text()


def test_torchs_launch_agent_takes_a_health_check_server() -> None:
    """launcher.md: torch 2.13 passes ``health_check_server=`` to ``launch_agent``, which TaskD's 3-parameter
    version lacks."""
    assert re.search(r"def launch_agent\([^)]*health_check_server", source("torch.distributed.launcher.api"))
    assert "torch 2.13 adds `health_check_server=`" in page("launcher.md")


def test_torchrun_passes_four_signals_to_its_workers() -> None:
    """launcher.md: the agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into the same signal to each worker."""
    assert '"SIGTERM,SIGINT,SIGHUP,SIGQUIT"' in source("torch.distributed.elastic.multiprocessing.api")
    assert "SIGTERM, SIGINT, SIGHUP and SIGQUIT" in page("launcher.md")


def test_msrun_handles_sigint_only_and_polls_once_a_second() -> None:
    """launcher.md and ttp.md: msrun has no SIGTERM handler, its SIGINT handler is its only one, and it looks
    at its workers once a second."""
    msrun = source("mindspore.parallel.cluster.process_entity._api")
    assert re.findall(r"signal\.signal\((signal\.\w+)", msrun) == ["signal.SIGINT"]
    assert "time.sleep(1)" in msrun
    assert "msrun has no SIGTERM handler" in page("launcher.md") and "it polls once a second" in page("features/ttp.md")


def test_mindspores_fault_tolerance_wrapper_looks_in_the_callback_list_itself() -> None:
    """mindspore.md: MindSpore's UCE/ARF retries find a ``TrainFaultTolerance`` in ``callbacks`` only, so one held
    inside ``FaultTolerance`` is never found."""
    assert "isinstance(item, TrainFaultTolerance)" in source("mindspore.train.model")
    assert "look for a `TrainFaultTolerance` in\nthe `callbacks` list itself" in page("frameworks/mindspore.md")


def test_mindformers_resumes_through_the_guarded_step_and_injects_mindspores_callback() -> None:
    """mindspore.md: the guard sits in ``load_resume_context_from_checkpoint``; MindFormers adds
    ``TrainFaultTolerance`` itself (so FaultTolerance steps aside)."""
    assert "def load_resume_context_from_checkpoint" in source("mindformers.trainer.utils")
    assert '{"type": "TrainFaultTolerance"}' in source("mindformers.trainer.base_trainer")
    assert "`load_resume_context_from_checkpoint`" in page("frameworks/mindspore.md")


def test_c10d_rendezvous_drops_a_node_after_15_s_without_keep_alive() -> None:
    """elastic.md, verified.md: torchrun's c10d rendezvous drops a node that sent no keep-alive for its
    ``keep_alive_interval`` x ``keep_alive_max_attempt`` (5 s x 3 by default), at each sync of its state."""
    text = source("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    assert "keep_alive_interval: int = 5" in text and "keep_alive_max_attempt: int = 3" in text
    assert re.search(r"def _sanitize\(self\).*?keep_alive_interval \* self\._settings\.keep_alive_max_attempt.*?"
                     r"del state\.participants\[dead_node\]", text, re.S)
    assert "no keep-alive for 15 s" in page("features/elastic.md") and "no keep-alive for 15 s" in page("verified.md")
