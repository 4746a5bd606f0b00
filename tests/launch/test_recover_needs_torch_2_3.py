"""``recover`` starts and holds a replacement worker with torch's ``subprocess_handler`` module, which torch 2.3
brought; the supported range starts at 2.1. Its import inside torchrun's monitoring loop, at the first failure, ended
the agent there with an ImportError. Now the launcher looks for the module when it installs ``recover`` and, without
it, leaves ``recover`` off in one line: torchrun's own handling (here its restart of the whole job) follows.

A real ``ft-plugins run -- torchrun`` of two plain Python workers, whose torchrun process cannot import the module
(its ``sys.modules`` entry set to None once torch's own process context imported it, as it does from torch 2.3 on:
ft_plugins' imports fail as on torch 2.1 and 2.2, torch's own workers start as usual)."""

from __future__ import annotations

from pathlib import Path

from launch_support import Vendors, ft_run, launch_env
from support import TORCHRUN, free_port

HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler"
# chain-loaded by ft_plugins' bootstrap before it installs the launcher's side (torchrun's process only)
OLD_TORCH = f"""import os, sys
if os.path.basename(sys.orig_argv[1] if len(sys.orig_argv) > 1 else "") == "torchrun":
    import torch.distributed.elastic.multiprocessing.api  # torch's own use of the module: imported and kept
    sys.modules["{HANDLER}"] = None  # any later import of it fails
"""
# rank 0 fails in its first life only, once rank 1 started; rank 1 is still running then
WORKER = """import os, sys, time
rank, path = os.environ["RANK"], os.environ["STARTS"]
with open(path, "a+") as starts:
    starts.write(rank + "\\n")
    starts.seek(0)
    first = starts.read().split().count(rank) == 1
if rank == "0" and first:
    while "1" not in open(path).read().split():
        time.sleep(0.05)
    sys.exit(3)
time.sleep(2)
"""


def test_recover_is_refused_at_install_without_the_module_and_torchrun_restarts_the_job(vendors: Vendors,
                                                                                         tmp_path: Path) -> None:
    (tmp_path / "old_torch").mkdir()
    (tmp_path / "old_torch" / "sitecustomize.py").write_text(OLD_TORCH)
    (tmp_path / "worker.py").write_text(WORKER)
    env = launch_env(vendors, tmp_path, STARTS=str(tmp_path / "starts"))
    env["PYTHONPATH"] = f"{tmp_path / 'old_torch'}:{env['PYTHONPATH']}"  # the first sitecustomize: the one chained
    result = ft_run(["--features", "recover,ttp", "--", TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1",
                     "--master-port", str(free_port()), str(tmp_path / "worker.py")], env, tmp_path, timeout=180)
    refused = [line for line in result.stderr.splitlines() if "recover: off in this torchrun" in line]
    assert len(refused) == 1, result.stderr[-4000:]
    assert (f"has no {HANDLER} (torch 2.3 and later have it), which starts and holds a replacement worker; upgrade "
            "torch to 2.3 or later, or run without recover (ttp's dump and torchrun's restart still work)"
            ) in refused[0]
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "0", "1", "1"], "a whole-job restart"
    assert "ImportError" not in result.stderr and "replacement pid" not in result.stderr
