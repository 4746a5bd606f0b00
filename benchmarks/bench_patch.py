"""Cost of ``ft-plugins patch`` on whole repositories (detection + every file), target: under 2 s each.

Per layout, on fresh copies, timed in this one run (median of --runs):
  baseline   libcst parse + code generation of the same files: the least any CST rewrite costs
  patch      make_plan + apply (detection, recipes, anchors, rewrite, compile check, backup, write)
  cli        ``ft-plugins patch DIR`` as a fresh process (interpreter start-up included)

    python benchmarks/bench_patch.py [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import libcst

from ft_plugins.patch import apply, detect, make_plan

SITE = Path(sysconfig.get_paths()["purelib"])
LAYOUTS = {
    "megatron-core 0.17.1": {"megatron/training": SITE / "megatron" / "training",
                             "megatron/core/package_info.py": SITE / "megatron" / "core" / "package_info.py"},
    "mindformers (installed)": {"mindformers/__init__.py": SITE / "mindformers" / "__init__.py",
                                "mindformers/trainer": SITE / "mindformers" / "trainer"},
}


def _copy(layout: dict[str, Path], destination: Path) -> Path:
    for relpath, source in layout.items():
        target = destination / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    return destination


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    cli = [str(Path(sys.executable).with_name("ft-plugins")), "patch"]
    for name, layout in LAYOUTS.items():
        baseline, patch, process = [], [], []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                root = _copy(layout, Path(tmp) / "a")
                plan = make_plan(detect(root))
                files = [file.path.read_bytes() for file in plan.files]
                baseline.append(_timed(lambda: [libcst.parse_module(data).bytes for data in files]))
                copy = _copy(layout, Path(tmp) / "b")
                patch.append(_timed(lambda: apply(make_plan(detect(copy)))))
                fresh = _copy(layout, Path(tmp) / "c")
                process.append(_timed(lambda: subprocess.run([*cli, str(fresh)], check=True,
                                                             capture_output=True)))
        base, ours, whole = (statistics.median(v) for v in (baseline, patch, process))
        verdict = "under" if whole < 2.0 else "OVER"
        print(f"{name:24} baseline {base * 1e3:6.0f} ms | patch {ours * 1e3:6.0f} ms "
              f"(ratio {ours / base:.2f}) | cli process {whole * 1e3:6.0f} ms (ratio {whole / base:.2f}; "
              f"{verdict} the 2 s target)")


if __name__ == "__main__":
    main()
