"""The default group's backend said at its creation where the built-in ``ttp`` engine (and ``recover``) rely on a
collective's error: NCCL and HCCL block instead of failing. NCCL cannot run here, so the real gloo group's backend
name is stood in for (``torch.distributed.get_backend`` as the wrapper reads it) in one of the runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ft_plugins.torch.backend import blocking_note
from support import free_port

JOB = """\
import sys
import torch.distributed as dist
import ft_plugins.torch
if sys.argv[1] == "nccl":
    dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"  # what a job with CUDA devices is given
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
print("initialised", flush=True)
"""


def test_a_blocking_backend_is_named_with_what_ends_its_wait() -> None:
    assert blocking_note("gloo", "ttp") is None
    nccl = blocking_note("cpu:gloo,cuda:nccl", "ttp's built-in engine and recover")
    assert nccl is not None and nccl.startswith("ttp's built-in engine and recover on NCCL") and "10 minutes" in nccl
    hccl = blocking_note("hccl", "ttp's built-in engine")
    assert hccl is not None and "HCCL_EXEC_TIMEOUT" in hccl and "not verified on HCCL" in hccl


def _run(features: str, backend: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FT_PLUGINS")}
    result = subprocess.run([sys.executable, "-c", JOB, backend, str(free_port())], capture_output=True, text=True,
                            timeout=120, env={**env, "FT_PLUGINS": features})
    assert result.returncode == 0 and "initialised" in result.stdout, result.stderr[-3000:]
    return result.stderr


@pytest.mark.parametrize("features, backend, said", [
    ("ttp,recover", "nccl", "ttp's built-in engine and recover on NCCL"),
    ("ttp", "nccl", "ttp's built-in engine on NCCL"),
    ("ttp,recover", "gloo", None),  # fails fast: nothing to say
    ("resume", "nccl", None),  # no built-in engine
])
def test_rank_0_says_it_when_the_default_group_is_made(features: str, backend: str, said: str | None) -> None:
    lines = [line for line in _run(features, backend).splitlines() if " on NCCL: " in line]
    assert lines == [] if said is None else len(lines) == 1 and said in lines[0], lines
