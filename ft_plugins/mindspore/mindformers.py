"""MindFormers' own resume, guarded: ft_plugins chooses the checkpoint before MindFormers loads it.

MindFormers resumes (``resume_training: True`` or a file name, ``load_checkpoint`` a folder or a file) inside
``BaseTrainer.training_process``, long before it builds the callbacks: it reads the epoch and step from the
file it chose (``load_resume_context_from_checkpoint``), skips data to that step, then loads the file. Every
version from 1.3 to 1.9 (the supported ones: 1.6 on) calls that function of ``mindformers.trainer.utils``
there, and ``check_runner_config`` right after the resume decision. Wrapping the first, ft_plugins puts the
newest intact checkpoint in its place (each skipped one logged with its reason); MindFormers then reads, skips
and loads as it does itself. The second records what MindFormers decided, so the ``ResumeCallback`` of that
run knows MindFormers owns the resume and only commits saves.

Installed when MindFormers' registry loads (the start-up hook ``ft-plugins-mindformers.pth``, or
``import ft_plugins.mindspore``). It acts only when the YAML ``callbacks:`` hold a ``FaultTolerance``
(with ``resume`` among its features) or a ``ResumeCallback`` entry.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ft_plugins import config as config_module
from ft_plugins import logs
from ft_plugins.checkpoint import verify
from ft_plugins.checkpoint.layouts.mindspore import recorded_step
from ft_plugins.checkpoint.reading import read_json
from ft_plugins.features import declared_options
from ft_plugins.features.resume import Resume
from ft_plugins.mindspore.base import FRAMEWORK, global_rank, save_root
from ft_plugins.patching import MissingSymbol, Patch, PatchSet
from ft_plugins.vendors import versions

log = logging.getLogger("ft_plugins.resume")

UTILS = "mindformers.trainer.utils"


@dataclass(frozen=True)
class TrainerRun:
    """What MindFormers' trainer decided for the run whose callbacks come next."""

    resuming: bool
    checkpoint: str  # what MindFormers loads: load_checkpoint (a file after ft_plugins chose one)
    initial_step: int


_run: TrainerRun | None = None


def trainer_run(consume: bool = False) -> TrainerRun | None:
    """The decision of the MindFormers trainer run now starting (None outside one); ``consume`` at train begin."""
    global _run
    run = _run
    if consume:
        _run = None
    return run


def resume_feature(callbacks: Any) -> Resume | None:
    """The ``resume`` feature as the YAML ``callbacks:`` configure it, None when no entry asks for it."""
    for entry in callbacks or ():
        kind = entry.get("type") if isinstance(entry, Mapping) else None
        if kind == "FaultTolerance":
            select = entry.get("features")
            overrides = {name: dict(value) for name, value in entry.items() if isinstance(value, Mapping)}
        elif kind == "ResumeCallback":
            select = "resume"
            overrides = {"resume": {k: v for k, v in entry.items() if k not in ("type", "directory", "format")}}
        else:
            continue
        settings = config_module.load(declared_options(), select=select, overrides=overrides)
        logs.setup(settings.log_level)
        if settings.requested("resume") is False:
            return None
        feature = Resume(FRAMEWORK, settings.options["resume"])
        feature.start()
        return feature
    return None


def _load_path(config: Any) -> str:
    """What MindFormers loads: ``checkpoint.load_path`` from 1.9 on (the YAML's ``load_checkpoint``, moved into a
    ``checkpoint`` section), ``load_checkpoint`` before."""
    section = _checkpoint_section(config)
    return str((section["load_path"] if section is not None else getattr(config, "load_checkpoint", "")) or "")


def _set_load_path(config: Any, path: str) -> None:
    section = _checkpoint_section(config)
    if section is not None:
        section["load_path"] = path
    config.load_checkpoint = path


def _checkpoint_section(config: Any) -> Any:
    section = getattr(config, "checkpoint", None)
    return section if isinstance(section, Mapping) and "load_path" in section else None


def choose(config: Any, feature: Resume) -> None:
    """Point MindFormers' resume at the newest intact checkpoint: what it loads becomes that file (in the field
    where its release keeps it, :func:`_load_path`).

    A file the user named (in ``resume_training``, or as the load path) is kept when intact. The one MindFormers'
    ``meta.json`` names is only its last regular save: a newer intact checkpoint, such as ``ttp``'s dump of the
    last completed step (which ``meta.json`` never records), comes first. Under msrun every rank checks only its
    own files and the ranks agree (:mod:`ft_plugins.checkpoint.agreed`): a named file is kept when intact on every
    rank, else every rank takes the newest checkpoint intact on all."""
    from ft_plugins.mindspore.agree import all_gather
    from ft_plugins.mindspore.recording import begin

    load, rank, gather = _load_path(config), global_rank() or 0, all_gather()
    root: str | None = None
    named: str | None = None
    from_meta = False
    if os.path.isdir(load):
        root = load
        named = os.path.join(load, f"rank_{rank}", config.resume_training) \
            if isinstance(config.resume_training, str) else None
        from_meta = named is not None and _meta_names(named)  # its folder's pick: meta.json's, or the user's name
    elif os.path.isfile(load):
        root, named = save_root(os.path.dirname(load)), load
    elif gather is None:
        return  # MindFormers reports a missing path itself
    if root is not None:
        begin(root)  # before the choice, which the record holds
    kept = named is not None and os.path.isfile(named) and not from_meta and _intact_pick(named, feature)
    if gather is not None:  # every rank takes part, whatever it holds: the others wait for its word
        kept = all(standing[0] for standing in gather((int(kept), 0, 0, 0)))
    if kept:
        log.info("resume: MindFormers resumes from %s (step %s), its own pick, intact%s", named, recorded_step(named),
                 " on every rank" if gather is not None else "")
        return
    selection = feature.choose(root if root is not None else load, rank=rank, gather=gather)
    if root is None:
        return  # this rank's path is missing (it took part in the agreement): MindFormers reports it
    if selection.path is None:
        log.warning("resume: nothing intact to resume from in %s; MindFormers starts from scratch", root)
        config.resume_training = False
        _set_load_path(config, "")
        return
    if from_meta and os.path.abspath(selection.path) == os.path.abspath(named):
        log.info("resume: MindFormers resumes from %s (step %s), its own pick, intact", named, selection.iteration)
        return
    log.info("resume: MindFormers resumes from %s (step %s)%s", selection.path, selection.iteration,
             f", not {os.path.basename(named)}, which its meta.json names" if from_meta else "")
    config.resume_training = True
    _set_load_path(config, selection.path)


def _intact_pick(named: str, feature: Resume) -> bool:
    verdict = verify(named, deep=feature.settings["deep"])
    if not verdict.intact:
        log.warning("resume: %s, MindFormers' pick, is not intact: %s", named, "; ".join(verdict.reasons))
    return verdict.intact


def _meta_names(path: str) -> bool:
    """Whether the ``meta.json`` beside ``path`` (MindFormers' record of its last save) names it."""
    try:
        meta = read_json(os.path.join(os.path.dirname(path), "meta.json"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("last_ckpt_file") == os.path.basename(path)


def _guard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``load_resume_context_from_checkpoint(config, dataset)``: choose first, then MindFormers reads it."""
    config = kwargs.get("config", args[0] if args else None)
    feature = resume_feature(getattr(config, "callbacks", None))
    if feature is not None:
        choose(config, feature)
        if not _load_path(config):  # none intact and allow_scratch on: MindFormers' fresh start
            config.runner_config.initial_epoch = config.runner_config.initial_step = 0
            return None
    return wrapped(*args, **kwargs)


def _record(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``check_runner_config(config, dataset)``, called once the resume decision is made: remember it."""
    global _run
    config = kwargs.get("config", args[0] if args else None)
    runner = getattr(config, "runner_config", None)
    resume, load = getattr(config, "resume_training", False), _load_path(config)
    if isinstance(resume, str) and os.path.isdir(load):  # MindFormers loads rank_<r>/<name> of that folder
        load = os.path.join(load, f"rank_{global_rank() or 0}", resume)
    _run = TrainerRun(bool(resume), load, int(getattr(runner, "initial_step", 0) or 0))
    return wrapped(*args, **kwargs)


def _missing(patches: PatchSet, error: MissingSymbol) -> None:
    log.warning("resume: MindFormers' resume is not guarded: %s (MindFormers %s have it)", error,
                versions.BY_NAME["mindformers"].describe())


_patches = PatchSet("mindformers-resume", (Patch(UTILS, "load_resume_context_from_checkpoint", _guard),
                                           Patch(UTILS, "check_runner_config", _record)), _missing)


def guard_resume() -> None:
    """Wrap MindFormers' resume choice now if its trainer utilities are loaded, else when they are (idempotent)."""
    _patches.apply()
