"""Where each framework puts its checkpoints (one module per layout), and which layout a directory has."""

from __future__ import annotations

import os

from ft_plugins.checkpoint.layouts.base import Candidate, Layout, Scan
from ft_plugins.checkpoint.layouts.hf import HuggingFace, TorchFiles
from ft_plugins.checkpoint.layouts.megatron import Megatron
from ft_plugins.checkpoint.layouts.mindspore import MindFormersIterations, MindSporeFiles

__all__ = ["FORMATS", "Candidate", "HuggingFace", "Layout", "Megatron", "MindFormersIterations", "MindSporeFiles",
           "Scan", "TorchFiles", "detect"]

FORMATS = ("auto", "megatron", "mindspore", "mindformers", "hf", "torch")


def detect(entries: list[os.DirEntry], format: str) -> Layout | None:
    """The layout of a save directory from its entries' names, or for an explicit ``format``."""
    names = {entry.name for entry in entries}
    has_iterations = any(MindFormersIterations.ITER.match(name) for name in names)
    ranks = MindSporeFiles.rank_dirs(entries)
    # MindFormers' CheckpointMonitor keeps a meta.json in each rank's folder: the folders, or one rank's folder
    has_meta = "meta.json" in names or any(os.path.exists(os.path.join(path, "meta.json")) for path in ranks.values())
    if format == "megatron" or (format == "auto" and Megatron.matches(names)):
        return Megatron()
    if format == "mindformers" or (format == "auto" and (has_iterations or has_meta)):
        return MindFormersIterations() if has_iterations else MindSporeFiles("mindformers")
    if format == "hf" or (format == "auto" and any(HuggingFace.CHECKPOINT.match(name) for name in names)):
        return HuggingFace()
    if format == "mindspore" or (format == "auto" and (ranks or any(n.endswith(".ckpt") for n in names))):
        return MindSporeFiles()
    if format == "torch" or (format == "auto" and any(n.endswith(TorchFiles.SUFFIXES) for n in names)):
        return TorchFiles()
    return None
