"""Let megatron.training run on a CPU-only machine (gloo), for the demo and the tests.

Megatron assumes CUDA everywhere: it asserts ``torch.cuda.is_available()``, allocates on
``device="cuda"``, calls ``.cuda()``, and saves/restores CUDA RNG state. This shim answers those
calls on the CPU, in the main thread and in every thread started after it. It is not part of
ft_plugins and is never needed on a real cluster.

Megatron's optimizers sort parameters by their CUDA type names (``param.type()``): both the
float16 optimizer (``--bf16`` / ``--fp16``) and the distributed optimizer construct with
``Tensor.type()`` answering the CUDA name (:func:`_with_cuda_type_names`). The distributed optimizer
(``--use-distributed-optimizer``) needs three more patches here (see
:func:`_patch_distributed_optimizer`): megatron-core 0.17.1 bugs on the path of fp32 parameters with
torch's own Adam (no Apex / Transformer Engine), which is the path a CPU run takes.

Two imports a tiny CPU run never uses are kept out, which halves each rank's start-up: torch's
compiler (``torch.compile`` compiles nothing here, so Megatron's fused kernels run as written, as
they did with dynamo switched off) and transformers (megatron-core builds even the NullTokenizer
through a module that imports it; the run falls back to Megatron's own tokenizers).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: object) -> object:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CudaTypeNames(TorchFunctionMode):
    """``tensor.type()`` answers with the ``torch.cuda.*`` name, as megatron's type checks expect."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(result, result)
        return result


class _NoneForMissing(dict):
    def __missing__(self, key):
        return None


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func in (torch.Tensor.to,):
            args = tuple(_cpu(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _every_thread_on_cpu() -> None:
    """Torch function modes hold per thread: threads started later (MindIO's handlers run in threads of
    their own) enter the device mapping too."""
    run = threading.Thread.run

    @functools.wraps(run)
    def run_on_cpu(self):
        with _CudaToCpu():
            run(self)

    threading.Thread.run = run_on_cpu


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args):
        return _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def wait(self, *args):
        pass

    def elapsed_time(self, other):
        return 0.0

    def query(self):
        return True


def _eager(model=None, **_options):
    """``torch.compile`` that compiles nothing, used as a function or as a decorator factory."""
    return model if model is not None else (lambda fn: fn)


def install() -> None:
    """Idempotent: patch torch.cuda and enter the device-mapping mode for this process. Where CUDA is there, nothing
    is mapped: only Megatron's dataset index helpers are not built (the example's samples do not use them)."""
    if getattr(torch.cuda, "_cpu_shim", False):
        return
    if torch.cuda.is_available():
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = lambda: None
        return
    cuda = torch.cuda
    cuda._cpu_shim = True
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: _Stream()
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (8, 0)
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=8, minor=0, name="cpu", total_memory=24 << 30, multi_processor_count=2)
    cuda.get_device_name = lambda *a, **k: "cpu"
    torch.compile = _eager
    if "megatron" in sys.modules:  # imported before the shim (a warm spare preloads it): its fusions hold the real one
        importlib.import_module("torch._dynamo").config.disable = True
    sys.modules.setdefault("transformers", None)  # megatron-core: "HAVE_TRANSFORMERS = False"
    _CudaToCpu().__enter__()
    _every_thread_on_cpu()

    cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    import megatron.core.datasets.utils as dataset_utils
    import megatron.core.tensor_parallel.random as megatron_random

    dataset_utils.compile_helpers = lambda: None
    # Megatron's model-parallel RNG tracker swaps "CUDA" generator states; on CPU that is the CPU one.
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _patch_optimizers()


def _patch_optimizers() -> None:
    """Megatron's optimizers construct, train, save and resume on CPU."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _with_cuda_type_names(Float16OptimizerWithFloat16Params)  # --bf16 / --fp16
    _with_cuda_type_names(DistributedOptimizer)
    _patch_distributed_optimizer()


def _with_cuda_type_names(optimizer_class: type) -> None:
    """(CPU only) ``__init__`` sorts parameters by ``param.type()`` against ``'torch.cuda.FloatTensor'``,
    ``'torch.cuda.HalfTensor'`` and ``'torch.cuda.BFloat16Tensor'`` and raises "Wrapped parameters must
    be one of ..." for CPU tensors: it runs with ``Tensor.type()`` reporting the CUDA name."""
    init = optimizer_class.__init__

    @functools.wraps(init)
    def init_with_cuda_type_names(self, *args, **kwargs):
        with _CudaTypeNames():
            init(self, *args, **kwargs)

    optimizer_class.__init__ = init_with_cuda_type_names


def _patch_distributed_optimizer() -> None:
    """Make megatron-core 0.17.1's DistributedOptimizer train, save and resume bit-identically on CPU."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    load_state_dict = DistributedOptimizer.load_state_dict

    # 1 (megatron bug): on --load it copies in place into a view of an fp32 parameter that requires
    # grad ("a view of a leaf Variable that requires grad is being used in an in-place operation").
    # 2 (megatron bug): it expects every optimizer state key in the loaded shard, but torch's Adam has
    # a per-parameter "step" that distrib_optim.pt does not hold (KeyError: 'step'): skip such keys.
    @functools.wraps(set_states)
    def set_states_without_grad(self, model_param, tensors):
        with torch.no_grad():
            set_states(self, model_param, _NoneForMissing(tensors))

    # 3 (megatron bug): with torch's Adam, load_state_dict gives every parameter the SAME "step"
    # tensor, so each iteration advances it once per parameter (wrong bias correction after resume).
    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_grad
    DistributedOptimizer.load_state_dict = load_state_dict_with_own_steps
