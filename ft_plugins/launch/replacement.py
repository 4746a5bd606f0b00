"""torchrun's handle of a fresh process replacing a lost worker (imported by :mod:`.recover` in the torchrun
process only, when a worker is lost: it needs torch's ``subprocess_handler`` module, torch 2.3 and later, which
:func:`.recover.install` found before it adapted the agent, else it left ``recover`` off)."""

from __future__ import annotations

from subprocess import Popen
from typing import IO, Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler


class Replacement(SubprocessHandler):
    """torch's handler of a worker, started as torch starts one, but for its output files (``--log-dir`` with
    ``--redirects`` / ``--tee``): opened to append. torch opens them to write, which empties them: the lost
    worker's output there, its traceback first of all, would be gone; and a ``--tee`` reader, which goes on
    from where it stood in the file, would skip what the replacement writes until the file grew past that."""

    def __init__(self, *, stdout: str | None, stderr: str | None, **kwargs: Any) -> None:
        self._appended: tuple[IO[str] | None, ...] = tuple(open(path, "a") if path else None
                                                           for path in (stdout, stderr))
        super().__init__(stdout=None, stderr=None, **kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        self._stdout, self._stderr = self._appended  # torch's close() closes them as its own
        return super()._popen(args, env)
