"""What ``import ft_plugins.torch`` leaves out: it runs in every training process, so the glue a framework needs
is imported with that framework, never before (docs/benchmarks.md: the import cost, measured by
benchmarks/bench_import.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support import PYTHON

# each imported by ``import ft_plugins.torch`` under FT_PLUGINS=auto until they waited for their framework
HF_GLUE = ("ft_plugins.torch.hf.resume",  # the checkpoint choice, a regular expression compiled at import
           "ft_plugins.torch.hf.rotation",
           "ft_plugins.torch.hf.accelerate", "ft_plugins.torch.hf.agree", "ft_plugins.torch.clean_exit",
           "ft_plugins.faults",  # a frozen dataclass; with it ft_plugins.recovery's named tuples
           "ft_plugins.recovery")  # also imported by the recover feature for one number
MEGATRON_GLUE = ("ft_plugins.torch.megatron.resume",)

PROBE = """
import json, sys
import torch
import ft_plugins.torch as ft_torch

def loaded():
    return sorted(name for name in {glue!r} if name in sys.modules)

report = {{"resume": ft_torch.runtime().feature("resume") is not None, "at_import": loaded()}}
import transformers.trainer_utils as utils
report["with_transformers"] = loaded()
report["hf_hooked"] = hasattr(utils.get_last_checkpoint, "__wrapped__")
import megatron.training.checkpointing as checkpointing
report["with_megatron"] = loaded()
report["megatron_hooked"] = hasattr(checkpointing.load_checkpoint, "__wrapped__")
print(json.dumps(report))
"""


def test_framework_glue_is_imported_with_its_framework_not_with_ft_plugins(tmp_path: Path) -> None:
    """With torch imported first and ``resume`` on (as ``auto`` finds it on any node), none of the glue is
    imported; transformers, then megatron, bring theirs and get hooked (the control: the probe sees them)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}, "PYTHONPATH": "",
           "FT_PLUGINS": "auto", "FT_PLUGINS_LOG": "error"}
    code = PROBE.format(glue=HF_GLUE + MEGATRON_GLUE)
    result = subprocess.run([PYTHON, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["resume"], "resume is off: the probe would not see its glue imported"
    assert report["at_import"] == [], f"import ft_plugins.torch imported framework glue: {report['at_import']}"
    assert report["with_transformers"] == sorted(HF_GLUE) and report["hf_hooked"]
    assert report["with_megatron"] == sorted(HF_GLUE + MEGATRON_GLUE) and report["megatron_hooked"]


# What ``import ft_plugins.torch`` may load after ``import torch`` on a node without vendor runtimes (FT_PLUGINS=auto,
# as benchmarks/bench_import.py times it): its start-up path and wrapt. Each module costs every training process
# about 0.2 ms: one joining this list is a choice made with the benchmark's figure, not a side effect.
AT_IMPORT = frozenset({
    "ft_plugins.config", "ft_plugins.events", "ft_plugins.logs", "ft_plugins.patching", "ft_plugins.rank",
    "ft_plugins.runtime", "ft_plugins.features", "ft_plugins.features.base", "ft_plugins.features.elastic",
    "ft_plugins.features.hangs",
    "ft_plugins.features.mstx", "ft_plugins.features.recover", "ft_plugins.features.resume",
    "ft_plugins.features.taskd", "ft_plugins.features.ttp", "ft_plugins.vendors", "ft_plugins.vendors.mindio",
    "ft_plugins.vendors.ranges", "ft_plugins.vendors.taskd", "ft_plugins.vendors.versions", "ft_plugins.torch",
    "ft_plugins.torch.hf", "ft_plugins.torch.hf.events", "ft_plugins.torch.hf.targets", "ft_plugins.torch.megatron",
    "ft_plugins.torch.megatron.state", "ft_plugins.torch.forks",
})
LOADED = """
import json, sys
import torch
before = set(sys.modules)
import ft_plugins.torch
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_import_after_torch_loads_its_start_up_modules_and_wrapt_only(tmp_path: Path) -> None:
    """Nothing torch did not load already comes in but wrapt and the listed modules of ft_plugins: a module of the
    start-up path that pulls in the standard library's heavier parts (faulthandler, mmap), the checkpoint package or
    a framework fails here, named, before the benchmark's figure moves."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FT_PLUGINS")}, "PYTHONPATH": "",
           "FT_PLUGINS": "auto", "FT_PLUGINS_LOG": "error"}
    result = subprocess.run([PYTHON, "-c", LOADED], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    ours = {name for name in loaded if name.split(".")[0] == "ft_plugins"}
    foreign = sorted(name for name in loaded - ours if name.split(".")[0] != "wrapt")
    assert not foreign, f"import ft_plugins.torch loaded {foreign}: import it where it is used, not at start-up"
    assert ours <= AT_IMPORT, (f"import ft_plugins.torch loaded {sorted(ours - AT_IMPORT)}: import it where it is "
                               "used, or add it to AT_IMPORT with the import benchmark's figure")
    assert "ft_plugins.torch" in ours and "wrapt" in loaded  # the control: the probe saw the import happen


def test_the_deferred_hf_glue_patches_only_the_modules_its_sets_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred set is hooked on :data:`targets.MODULES`; glue aimed elsewhere would be hooked only once made,
    and glue listening to Trainer events would never hear them."""
    from ft_plugins.config import INJECT_VAR
    from ft_plugins.runtime import activate
    from ft_plugins.torch.hf import HFIntegration, targets

    monkeypatch.setenv(INJECT_VAR, "rank=0,step=1,kind=exit")
    runtime = activate("pt", features="resume", announce=False)
    try:
        integration = HFIntegration(runtime)
        deferred = {patch_set.name: patch_set for patch_set in integration.patch_sets
                    if patch_set.modules == targets.MODULES}
        assert sorted(deferred) == ["exit", "faults", "resume"]
        for patch_set in deferred.values():
            assert patch_set.patches and patch_set.modules == targets.MODULES, patch_set.name
            wrappers = [getattr(patch.wrapper, "__self__", None) for patch in patch_set.patches]
            assert not any(hasattr(part, "on_event") for part in wrappers), patch_set.name
    finally:
        runtime.stop()


def test_the_import_time_records_document_exactly_their_fields() -> None:
    """They are collections' named tuples (typing's compiles each annotation when the class is made), each field
    named in the call and again, typed, in the class: the two lists must not drift apart."""
    from ft_plugins.config import Config, Option
    from ft_plugins.patching import Patch
    from ft_plugins.progress import Record
    from ft_plugins.runtime import FeatureStatus
    from ft_plugins.vendors.mindio import Endpoint

    for record in (Option, Config, Patch, FeatureStatus, Endpoint, Record):
        assert record._fields == tuple(record.__annotations__), record.__name__
        assert record.__slots__ == (), record.__name__  # no instance dictionary, as a typing.NamedTuple has none
