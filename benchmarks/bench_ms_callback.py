"""Per-step cost of ``FaultTolerance`` in a real MindSpore ``Model.train``, against no callback, in one run.

A tiny network (Dense 16->16->1, batch 8) trains on CPU in PyNative mode, so the step is short and
any overhead shows. Three variants, interleaved in rounds so machine noise hits all alike:
  bare       Model.train with no callback (run twice per round: the second run, "control", gives
             the noise floor of the comparison)
  ft         Model.train with FaultTolerance: taskd, mstx, resume on (TaskD and mstx are in-memory
             stand-ins with the vendor signatures: the real ones cannot run here; ttp refuses CPU), and
             the job's events for ``ft-plugins report``, recorded beside the resume directory
Step times are the fastest round (as timeit reports) and the median ratio of paired rounds. On a
shared 2-core machine whole-step ratios move by several percent either way from run to run, so the
callback's own cost per step is also timed directly, by calling its step events as Model.train does.

    python benchmarks/bench_ms_callback.py [--rounds 10] [--epochs 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
import types

STEPS_PER_EPOCH = 32


def _install_stand_ins() -> list:
    """An in-memory TaskD worker API and MindSpore mstx (same signatures), before ft_plugins looks for them."""
    calls: list = []
    ids = itertools.count(1)
    worker = types.ModuleType("taskd.api.taskd_worker_api")
    worker.init_taskd_worker = lambda rank_id, upper_limit_of_disk_in_mb=5000, framework="pt": True
    worker.start_taskd_worker = lambda: True
    for name in ("taskd", "taskd.api"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    sys.modules["taskd"].__spec__ = types.SimpleNamespace(name="taskd")
    sys.modules["taskd.api.taskd_worker_api"] = worker

    import mindspore.profiler
    import mindspore.runtime

    mindspore.profiler.mstx = types.SimpleNamespace(
        range_start=lambda message, stream=None, domain="default": calls.append(message) or next(ids),
        range_end=lambda range_id, domain="default": calls.append(range_id),
        mark=lambda message, stream=None, domain="default": calls.append(message),
    )
    mindspore.runtime.current_stream = lambda: "stream"
    return calls


def _dataset():
    import numpy as np
    import mindspore.dataset as ds

    rng = np.random.default_rng(0)
    data = rng.standard_normal((STEPS_PER_EPOCH * 8, 16)).astype(np.float32)
    return ds.NumpySlicesDataset({"data": data, "label": data[:, :1].copy()}, shuffle=False).batch(8)


def _model():
    import mindspore
    from mindspore import nn
    from mindspore.train import Model

    mindspore.set_seed(1)
    network = nn.SequentialCell(nn.Dense(16, 16), nn.ReLU(), nn.Dense(16, 1))
    return Model(network, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(network.trainable_params(), 0.01, 0.9))


def _per_step(epochs: int, callbacks: list) -> float:
    model, dataset = _model(), _dataset()
    start = time.perf_counter()
    model.train(epochs, dataset, callbacks=callbacks)
    return (time.perf_counter() - start) / (epochs * STEPS_PER_EPOCH)


def _callback_cost(callback, steps: int) -> float:
    """The callback's own step events, called as Model.train calls them."""
    from mindspore.train import RunContext
    from mindspore.train.callback import _InternalCallbackParam

    params = _InternalCallbackParam()
    params.cur_step_num = 0
    context = RunContext(params)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        params.cur_step_num = step
        callback.on_train_step_begin(context)
        callback.on_train_step_end(context)
    return (time.perf_counter() - start) / steps


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    ratios = sorted(n / d for n, d in zip(numerators, denominators))
    return ratios[len(ratios) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4)
    options = parser.parse_args()

    os.environ["FT_PLUGINS_LOG"] = "error"
    import mindspore

    mindspore.set_context(mode=mindspore.PYNATIVE_MODE, device_target="CPU")
    mindspore.set_device("CPU")
    calls = _install_stand_ins()
    from ft_plugins.mindspore import FaultTolerance

    save_dir = tempfile.mkdtemp(prefix="bench-ms-")

    def with_ft() -> list:
        return [FaultTolerance(features="taskd,mstx,resume", resume_dir=save_dir, mstx={"backend": "mindspore"})]

    _per_step(1, [])  # warm-up: first-call compilation and caches
    _per_step(1, with_ft())
    bare, control, ft = [], [], []
    runs = [lambda: bare.append(_per_step(options.epochs, [])),
            lambda: control.append(_per_step(options.epochs, [])),
            lambda: ft.append(_per_step(options.epochs, with_ft()))]
    for round_index in range(options.rounds):  # rotate the order: drift hits every variant alike
        for run in runs[round_index % 3:] + runs[:round_index % 3]:
            run()
        calls.clear()
    probe = with_ft()[0]
    own = min(_callback_cost(probe, 2000) for _ in range(5))
    print(f"features on: {', '.join(sorted(probe.runtime.features))}; {options.epochs * STEPS_PER_EPOCH} steps "
          f"per round, {options.rounds} rounds")

    print(f"step, bare: {min(bare) * 1e3:.3f} ms; with FaultTolerance: {min(ft) * 1e3:.3f} ms")
    print(f"ratio FaultTolerance / bare: fastest rounds {min(ft) / min(bare):.4f}, median of paired rounds "
          f"{_median_ratio(ft, bare):.4f}; noise floor, bare / bare again: {min(control) / min(bare):.4f}, "
          f"{_median_ratio(control, bare):.4f}")
    print(f"FaultTolerance's own step events: {own * 1e6:.2f} us per step = "
          f"{own / min(bare) * 100:.3f} % of the bare step")
    from ft_plugins.mindspore.recording import EventsCallback

    recorded = min(_callback_cost(EventsCallback(save_dir), 2000) for _ in range(5))
    print(f"of which the job's events (a clock read and a tuple kept per step, written every 5 s): "
          f"{recorded * 1e6:.2f} us per step = {recorded / min(bare) * 100:.3f} % of the bare step")


if __name__ == "__main__":
    main()
