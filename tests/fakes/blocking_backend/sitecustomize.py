"""Put this folder first on a job's ``PYTHONPATH`` with ``FT_FAKE_BLOCKING=1``: the job's default group runs on the
``blocking`` backend (:mod:`blocking_pg`, NCCL's semantics on CPU) where it asks for gloo, as a CUDA job's default
group is NCCL; groups made with ``backend="gloo"`` by name (Megatron's gloo groups) stay gloo, as they do there. The
copy of state to the host, torch's archive writer (``torch.serialization._save``, under ``torch.save`` and
ft_plugins' own writer alike), waits behind the collectives enqueued before it (:func:`blocking_pg.synchronize`), as
a device-to-host copy on the device's stream does."""

from __future__ import annotations

import importlib.util
import os

import wrapt

HERE = os.path.dirname(os.path.abspath(__file__))


def _on_blocking(wrapped, _instance, args, kwargs):
    import blocking_pg

    blocking_pg.register()
    if kwargs.get("backend", args[0] if args else None) == "gloo":
        args, kwargs = args[1:], {**kwargs, "backend": blocking_pg.NAME}
    return wrapped(*args, **kwargs)


def _install(module) -> None:
    """One wrapper, in the module that defines the function and in the package that re-exports it (an object
    ft_plugins' own patch then finds in both places)."""
    wrapper = wrapt.FunctionWrapper(module.distributed_c10d.init_process_group, _on_blocking)
    module.distributed_c10d.init_process_group = module.init_process_group = wrapper


def _behind_the_stream(wrapped, _instance, args, kwargs):
    import blocking_pg

    blocking_pg.synchronize("a copy of state to the host (torch's archive writer)")
    return wrapped(*args, **kwargs)


def _install_the_stream(torch) -> None:
    torch.serialization._save = wrapt.FunctionWrapper(torch.serialization._save, _behind_the_stream)


def _run_the_shadowed_sitecustomize() -> None:
    """The next ``sitecustomize`` on the path after this folder runs too (``tests/fakes/site_chain.py``)."""
    spec = importlib.util.spec_from_file_location("site_chain", os.path.join(os.path.dirname(HERE), "site_chain.py"))
    chain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chain)
    chain.run_the_shadowed_sitecustomize(HERE)


if os.environ.get("FT_FAKE_BLOCKING") == "1":
    wrapt.register_post_import_hook(_install, "torch.distributed")
    wrapt.register_post_import_hook(_install_the_stream, "torch")
_run_the_shadowed_sitecustomize()
