"""The ft_plugins demo: a real 2-rank Megatron GPT pretrain() on CPU, with ft_plugins on by one import.

Run 1 is what this machine really has: no Ascend runtime, so every feature says it is off and why,
and training is untouched. Run 2 puts the recording stand-ins of TaskD and torch_npu from
``tests/fakes`` on the path (clearly simulated: they record calls instead of profiling) to show
what ft_plugins does on an Ascend node: which TaskD calls each rank made, and which ranges.

    python examples/megatron_gpt/demo.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKES = REPO / "tests" / "fakes"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(workdir: Path, simulate_ascend: bool) -> dict[int, dict]:
    """One 2-rank run; returns each rank's ft_plugins report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_PLUGINS", "FT_FAKE"))}
    if simulate_ascend:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKES), env.get("PYTHONPATH")]))
        env["FT_FAKE_RECORD"] = str(workdir / "vendor_calls.jsonl")
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(HERE / "pretrain_gpt.py"),
               "--train-iters", "6", "--save", str(workdir / "checkpoints"), "--save-interval", "3",
               "--ft-report-dir", str(workdir / "reports")]
    log = workdir / "train.log"
    with log.open("w") as handle:
        result = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=workdir)
    if result.returncode != 0:
        sys.exit(f"training failed (exit {result.returncode}); see {log}")
    lines = log.read_text().splitlines()
    print("\n".join(f"    {line}" for line in lines if line.startswith("[ft_plugins")))
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in sorted((workdir / "reports").glob("*.json"))}


def show(reports: dict[int, dict]) -> None:
    for rank, report in reports.items():
        for name, entry in report.items():
            state = "on " if entry["enabled"] else "off"
            detail = entry["activity"] if entry["enabled"] else entry["reason"]
            print(f"  rank {rank}  {name:6} {state}  {detail}")


def show_vendor_calls(record: Path) -> None:
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    for rank in sorted({c["rank"] for c in calls}):
        mine = [c for c in calls if c["rank"] == rank]
        taskd = [f"{c['api']}({', '.join(map(repr, c['args']))})" for c in mine if "taskd" in c["api"]]
        ranges = Counter(c["args"][0].split()[0] for c in mine if c["api"] == "mstx.range_start")
        steps = [c["args"][0] for c in mine if c["api"] == "mstx.range_start" and c["args"][0].startswith("step")]
        print(f"  rank {rank}: {'; '.join(taskd)}")
        print(f"          mstx ranges: {dict(ranges)}  ({', '.join(steps)} on the current stream)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    workdir = parser.parse_args().workdir or Path(tempfile.mkdtemp(prefix="ft_plugins_demo_"))
    real, simulated = workdir / "this_machine", workdir / "simulated_ascend"
    real.mkdir(parents=True, exist_ok=True)
    simulated.mkdir(parents=True, exist_ok=True)

    print("== Run 1: this machine (no Ascend runtime), `import ft_plugins.torch` in the entry script")
    show(train(real, simulate_ascend=False))
    print("\n== Run 2: simulated Ascend node (recording stand-ins of TaskD and torch_npu from tests/fakes)")
    show(train(simulated, simulate_ascend=True))
    print("\n  vendor calls recorded:")
    show_vendor_calls(simulated / "vendor_calls.jsonl")
    print(f"\nlogs, checkpoints and reports: {workdir}")


if __name__ == "__main__":
    main()
