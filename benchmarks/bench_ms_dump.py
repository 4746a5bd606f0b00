"""Per-step cost of ``ttp``'s built-in engine on MindSpore (the host copy of every parameter and optimizer
state at each step end, the watcher thread), against the same ``Model.train`` without it, in one run.

A network of ``--width`` x ``--width`` Dense layers with Momentum trains on CPU in PyNative mode. Two
variants, interleaved in rounds so machine noise hits both alike: ``bare`` (no callback; run twice per
round, the second run giving the noise floor) and ``ttp`` (``FaultTolerance(features="ttp")``).
Reported: the fastest round's step of each and their ratio, the median ratio of paired rounds, and
the host copy's own time per step (timed inside the engine), with the bytes it copies.

    python benchmarks/bench_ms_dump.py [--rounds 6] [--steps 64] [--width 512]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

BATCH = 16


def _train(steps: int, width: int, callbacks: list) -> float:
    """Seconds per step of one ``Model.train`` of ``steps`` steps."""
    import numpy as np

    import mindspore
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Model

    mindspore.set_seed(1)
    network = nn.SequentialCell(nn.Dense(width, width), nn.ReLU(), nn.Dense(width, width), nn.ReLU(),
                                nn.Dense(width, 1))
    model = Model(network, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(network.trainable_params(), 0.01, 0.9))
    data = np.random.default_rng(0).standard_normal((steps * BATCH, width)).astype(np.float32)
    dataset = ds.NumpySlicesDataset({"data": data, "label": data[:, :1].copy()}, shuffle=False).batch(BATCH)
    start = time.perf_counter()
    model.train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    options = parser.parse_args()

    os.environ["FT_PLUGINS_LOG"] = "error"
    import mindspore

    mindspore.set_context(mode=mindspore.PYNATIVE_MODE, device_target="CPU")
    from ft_plugins.mindspore import FaultTolerance
    from ft_plugins.mindspore.ttp import TtpCallback

    save_dir = tempfile.mkdtemp(prefix="bench-ms-dump-")
    engines = []

    def with_ttp() -> list:
        callback = FaultTolerance(features="ttp", ttp={"save_dir": save_dir})
        engines.append(next(part for part in callback.parts if isinstance(part, TtpCallback)).engine)
        return [callback]

    _train(8, options.width, [])  # warm-up: first-call compilation and caches
    _train(8, options.width, with_ttp())
    bare, control, ttp = [], [], []
    runs = [lambda: bare.append(_train(options.steps, options.width, [])),
            lambda: control.append(_train(options.steps, options.width, [])),
            lambda: ttp.append(_train(options.steps, options.width, with_ttp()))]
    for round_index in range(options.rounds):  # rotate the order: drift hits every variant alike
        for run in runs[round_index % 3:] + runs[:round_index % 3]:
            run()
    copies = [engine.copy_seconds / options.steps for engine in engines[1:]]
    snapshot = engines[-1].snapshot
    copied = sum(array.nbytes for _, array in snapshot.parameters)

    def median_ratio(numerators: list[float], denominators: list[float]) -> float:
        return sorted(n / d for n, d in zip(numerators, denominators))[len(numerators) // 2]

    print(f"{len(snapshot.parameters)} parameters and optimizer states, {copied / 2**20:.2f} MiB copied per step; "
          f"{options.steps} steps per round, {options.rounds} rounds")
    print(f"step, bare: {min(bare) * 1e3:.3f} ms; with ttp (built-in engine): {min(ttp) * 1e3:.3f} ms")
    print(f"ratio ttp / bare: fastest rounds {min(ttp) / min(bare):.4f}, median of paired rounds "
          f"{median_ratio(ttp, bare):.4f}; noise floor, bare / bare again: {min(control) / min(bare):.4f}, "
          f"{median_ratio(control, bare):.4f}")
    print(f"host copy per step: {min(copies) * 1e3:.3f} ms (fastest round) = {min(copies) / min(bare) * 100:.2f} % "
          f"of the bare step; {copied / min(copies) / 2**30:.2f} GiB/s")


if __name__ == "__main__":
    main()
