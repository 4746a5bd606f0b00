"""Cost of ``import ft_plugins.torch``, and a check of what it must not import.

Fresh interpreters, timed in this one run (median of --runs):
  bare interpreter        python -c pass, wall time of the whole process
  ft_plugins.torch alone  the import itself, timed inside a fresh interpreter (FT_PLUGINS=none:
                          the package's own cost, nothing probed)
  after import torch      the import timed inside an interpreter that imported torch first
                          (FT_PLUGINS=auto: the real start-up path, every runtime probed)
Each import is also timed in CPU seconds of its process (``time.process_time``): on a loaded machine the
wall time counts the waits for a core, the CPU time much less so.
The target compares the last figure with the cost of importing torch itself. The package's
bytecode is compiled first, as ``pip install`` does (an editable checkout run with
PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module on every import).

    python benchmarks/bench_import.py [--runs 9]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import statistics
import subprocess
import sys
import time

TIMED = ("import time, sys\n{pre}\nt, cpu = time.perf_counter(), time.process_time()\nimport ft_plugins.torch\n"
         "print(time.perf_counter() - t, t - START, time.process_time() - cpu)\n")
CHECK = ("import sys, ft_plugins.torch; "
         "print(','.join(m for m in ('torch_npu', 'mindspore', 'megatron') if m in sys.modules) or 'none')")


def _python(code: str, features: str) -> str:
    env = {"FT_PLUGINS": features, "FT_PLUGINS_LOG": "error"}
    if "PYTHONPATH" in os.environ:  # a checkout put first, as the tests do
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def _timed_import(pre: str, features: str) -> tuple[float, float, float]:
    """Wall seconds of ``import ft_plugins.torch``, wall seconds of ``pre`` before it, CPU seconds of the import."""
    code = "import time\nSTART = time.perf_counter()\n" + TIMED.format(pre=pre)
    ft, pre_cost, cpu = _python(code, features).split()
    return float(ft), float(pre_cost), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    runs = parser.parse_args().runs
    package = importlib.util.find_spec("ft_plugins").submodule_search_locations[0]
    compileall.compile_dir(package, quiet=1)
    bare, alone, after_torch, torch_cost, alone_cpu, after_cpu = [], [], [], [], [], []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
        ft, _, cpu = _timed_import("", "none")
        alone.append(ft)
        alone_cpu.append(cpu)
        ft, torch_seconds, cpu = _timed_import("import torch", "auto")
        after_torch.append(ft)
        torch_cost.append(torch_seconds)
        after_cpu.append(cpu)
    ms = {name: statistics.median(values) * 1e3 for name, values in
          (("bare", bare), ("alone", alone), ("after", after_torch), ("torch", torch_cost),
           ("alone_cpu", alone_cpu), ("after_cpu", after_cpu))}
    print(f"bare interpreter start-up:              {ms['bare']:7.1f} ms")
    print(f"import ft_plugins.torch (FT_PLUGINS=none): {ms['alone']:5.1f} ms "
          f"(ratio to bare start-up {ms['alone'] / ms['bare']:.3f}; CPU {ms['alone_cpu']:.1f} ms)")
    print(f"import torch:                           {ms['torch']:7.1f} ms")
    print(f"import ft_plugins.torch after torch (auto): {ms['after']:4.1f} ms beyond torch "
          f"(ratio to import torch {ms['after'] / ms['torch']:.4f}; CPU {ms['after_cpu']:.1f} ms)")
    print(f"framework modules it imported: {_python(CHECK, 'auto')}")


if __name__ == "__main__":
    main()
