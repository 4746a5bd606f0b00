"""Real MindSpore 2.7.2 on CPU with the vendor fakes: TaskD and MindIO TTP (absent here), and
``mindspore.profiler.mstx``, which records nothing off Ascend. Nothing else is replaced, except
where a test says so in its own docstring."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from support import FAKES, vendor_modules_isolated

sys.path.insert(0, str(Path(__file__).resolve().parent))  # msrun_jobs

STEPS_PER_EPOCH = 4


class Recorder:
    """The vendor fakes' call log for one module's runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def calls(self, prefix: str = "") -> list[dict[str, Any]]:
        from support import read_records

        return [r for r in read_records(self.path) if r["api"].startswith(prefix)]

    def clear(self) -> None:
        self.path.write_text("")


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorder]:
    """Fakes importable and recording; mstx and the (CPU-less) device stream replaced; FT_PLUGINS* cleared."""
    import mindspore
    import mindspore.profiler
    import mindspore.runtime

    from ft_plugins.mindspore import taskd as taskd_callbacks

    record = tmp_path_factory.mktemp("records") / "calls.jsonl"
    record.write_text("")
    with vendor_modules_isolated(), pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(("FT_PLUGINS", "FT_FAKE", "MS_ENABLE_TFT", "MS_TFT_")):
                patch.delenv(name)
        patch.setenv("FT_FAKE_RECORD", str(record))
        patch.setattr(taskd_callbacks, "_worker_owner", None)  # a fresh process as far as TaskD is concerned
        patch.syspath_prepend(str(FAKES))
        fake_mstx = importlib.import_module("mindspore_mstx")
        patch.setattr(mindspore.profiler, "mstx", fake_mstx)
        patch.setattr(mindspore.runtime, "current_stream", lambda: "device stream")  # CPU has none
        mindspore.set_context(mode=mindspore.PYNATIVE_MODE, device_target="CPU")
        yield Recorder(record)


def dataset(samples: int = 2 * STEPS_PER_EPOCH) -> Any:
    import mindspore.dataset as ds

    rng = np.random.default_rng(0)
    data = rng.standard_normal((samples, 4)).astype(np.float32)
    labels = (data @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype=np.float32)).astype(np.float32)
    return ds.NumpySlicesDataset({"data": data, "label": labels}, shuffle=False).batch(2)


def model(optimizer_class: Any = None, **options: Any) -> Any:
    """A fresh tiny regression model; ``optimizer_class`` defaults to Momentum; ``options`` go to ``Model``."""
    import mindspore
    from mindspore import nn
    from mindspore.train import Model

    mindspore.set_seed(1)
    network = nn.Dense(4, 1)
    optimizer = (optimizer_class or nn.Momentum)(network.trainable_params(), learning_rate=0.01, momentum=0.9)
    return Model(network, loss_fn=nn.MSELoss(), optimizer=optimizer, **options)


def checkpointing(directory: Path, prefix: str = "tiny") -> Any:
    from mindspore.train import CheckpointConfig, ModelCheckpoint

    config = CheckpointConfig(save_checkpoint_steps=STEPS_PER_EPOCH, keep_checkpoint_max=10)
    return ModelCheckpoint(prefix=prefix, directory=str(directory), config=config)


@pytest.fixture(scope="session")
def tiny() -> Any:
    """The helpers above, for test modules (conftest is not importable by name)."""
    import types

    return types.SimpleNamespace(STEPS_PER_EPOCH=STEPS_PER_EPOCH, dataset=dataset, model=model,
                                 checkpointing=checkpointing)
