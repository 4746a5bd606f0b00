"""A slow file system and a launcher with a short fixed grace, for the dump-against-the-grace tests: put this
folder on a job's ``PYTHONPATH``.

- ``FT_FAKE_SLOW_WRITE=S``: every archive written to a ``.pt`` file, by ``torch.save`` or by the dump's own writer
  (``ft_plugins.torch.saving.save``, a staged ``.ft_partial-N/x.pt``), takes S seconds more once written (a stalled
  file system: the file is there, its write not finished), in the job's first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` 0), so that the relaunch trains at full speed.
- ``FT_FAKE_SLOW_SYNC=S``: the dump's wait for its file system after its commit
  (``ft_plugins.checkpoint.atomic.sync_file_system``) takes S seconds more (a file system slow to put it on
  disk), in the first attempt only.
- ``FT_FAKE_TORCHRUN_GRACE=G``: torch's elastic agent stops its workers with G seconds instead of its fixed 30 s
  (the default timeout of ``PContext.close`` and ``LocalElasticAgent._shutdown``; explicit timeouts are kept),
  and ft_plugins knows torchrun's grace as G: the same launcher as torchrun's, with a suite-sized clock.
"""

from __future__ import annotations

import importlib.util
import os
import time

import wrapt


def _slow_save(wrapped, _instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    target = kwargs.get("f", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, os.PathLike)) and ".pt" in os.path.basename(target):
        time.sleep(float(os.environ["FT_FAKE_SLOW_WRITE"]))
    return result


def _slow_writer(module) -> None:
    module.save = wrapt.FunctionWrapper(module.save, _slow_save)


def _stalled(wrapped, _instance, args, kwargs):
    time.sleep(float(os.environ["FT_FAKE_SLOW_SYNC"]))
    return wrapped(*args, **kwargs)


def _slow_sync(module) -> None:
    module.sync_file_system = wrapt.FunctionWrapper(module.sync_file_system, _stalled)


def _grace(seconds: float):
    def processes(module) -> None:
        close = vars(module.PContext)["close"]
        close = getattr(close, "__wrapped__", close)
        close.__defaults__ = (close.__defaults__[0], seconds)

    def agent(module) -> None:
        shutdown = vars(module.LocalElasticAgent)["_shutdown"]
        shutdown = getattr(shutdown, "__wrapped__", shutdown)
        shutdown.__defaults__ = (shutdown.__defaults__[0], seconds)

    def knows(module) -> None:
        module.TORCHRUN_GRACE = seconds

    return processes, agent, knows


_FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if "FT_FAKE_SLOW_WRITE" in os.environ and _FIRST_ATTEMPT:
    for _writer in ("torch", "ft_plugins.torch.saving"):
        wrapt.register_post_import_hook(_slow_writer, _writer)
if "FT_FAKE_SLOW_SYNC" in os.environ and _FIRST_ATTEMPT:
    wrapt.register_post_import_hook(_slow_sync, "ft_plugins.checkpoint.atomic")
if "FT_FAKE_TORCHRUN_GRACE" in os.environ:
    _processes, _agent, _knows = _grace(float(os.environ["FT_FAKE_TORCHRUN_GRACE"]))
    wrapt.register_post_import_hook(_processes, "torch.distributed.elastic.multiprocessing.api")
    wrapt.register_post_import_hook(_agent, "torch.distributed.elastic.agent.server.local_elastic_agent")
    wrapt.register_post_import_hook(_knows, "ft_plugins.grace")


def _run_the_shadowed_sitecustomize() -> None:
    """The next ``sitecustomize`` on the path after this folder runs too (``tests/fakes/site_chain.py``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("site_chain", os.path.join(os.path.dirname(here), "site_chain.py"))
    chain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chain)
    chain.run_the_shadowed_sitecustomize(here)


_run_the_shadowed_sitecustomize()
