"""Hugging Face Trainer's ``checkpoint-N`` directories, and single ``torch.save`` files."""

from __future__ import annotations

import os
import re

from ft_plugins.checkpoint.layouts.base import Candidate, Layout, Scan, dirs, is_kind, listdir, manifest_inside, mtime
from ft_plugins.checkpoint.manifest import MANIFEST, beside
from ft_plugins.checkpoint.reading import is_inside, read_json


class HuggingFace(Layout):
    """Hugging Face Trainer: ``checkpoint-N/`` with ``trainer_state.json``, the weights (safetensors,
    ``pytorch_model.bin`` or sharded with an index), and optimizer/scheduler/RNG state; Accelerate's
    ``save_state``: ``checkpoint_N/`` (weights, optimizer, scheduler, ``random_states_*``). transformers
    v5 leaves ``checkpoint-is-incomplete.txt`` in a just-in-time save until it is complete."""

    name = "hf"
    CHECKPOINT = re.compile(r"^(tmp-)?checkpoint([-_])(\d+)$")
    INCOMPLETE = "checkpoint-is-incomplete.txt"
    WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        scan = Scan([])
        for entry in dirs(entries):
            match = self.CHECKPOINT.match(entry.name)
            if match:
                step, temporary = int(match.group(3)), bool(match.group(1))
                candidate = Candidate(entry.path, (step, 0 if temporary else 1), step,
                                      manifests=manifest_inside(entry.path))
                if temporary:
                    candidate.rejected = "save still in progress (tmp-checkpoint-N never renamed)"
                    candidate.unfinished = True
                scan.candidates.append(candidate)
        scan.candidates.sort(key=lambda c: c.key, reverse=True)
        return scan

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        names = {entry.name for entry in listdir(candidate.path) if is_kind(entry, "is_file")} - {MANIFEST}
        files = {name: os.path.join(candidate.path, name) for name in names - {self.INCOMPLETE}}
        if os.path.basename(candidate.path).startswith(("checkpoint-", "tmp-checkpoint-")):
            files["trainer_state.json"] = os.path.join(candidate.path, "trainer_state.json")
        problems = [] if names & set(self.WEIGHTS) else ["no model weights (model.safetensors, pytorch_model.bin, ...)"]
        if self.INCOMPLETE in names:
            problems.append(f"{self.INCOMPLETE} present: the save did not complete")
        for index in names & {"model.safetensors.index.json", "pytorch_model.bin.index.json"}:
            try:
                table = read_json(files[index])
            except (OSError, ValueError):
                continue  # the probe of the index file reports it
            weight_map = table.get("weight_map") if isinstance(table, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(shard, str) for shard in weight_map.values())):
                problems.append(f"{index}: no weight_map table of tensor names to shard files")
                continue
            shards = set(weight_map.values())
            outside = sorted(repr(shard)[:80] for shard in shards if not is_inside(shard))
            if outside:
                problems.append(f"{index} names shard files outside the checkpoint: {', '.join(outside[:3])}")
            for shard in sorted(shard for shard in shards if is_inside(shard)):
                files[shard] = os.path.join(candidate.path, shard)
        return files, problems


class TorchFiles(Layout):
    """Single ``torch.save`` files in one directory (``checkpoint.pth.tar``, ``epoch_3.pt``, as ResNet-style
    scripts write them): newest by modification time, each probed as a torch zip archive."""

    name = "torch"
    SUFFIXES = (".pt", ".pth", ".pth.tar")

    def scan(self, root: str, entries: list[os.DirEntry], rank: int | None) -> Scan:
        files = [entry for entry in entries if entry.name.endswith(self.SUFFIXES) and is_kind(entry, "is_file")]
        candidates = [Candidate(entry.path, (mtime(entry),),
                                manifests=[(beside(entry.path), root)]) for entry in files]
        return Scan(sorted(candidates, key=lambda c: c.key, reverse=True))

    def contents(self, candidate: Candidate) -> tuple[dict[str, str], list[str]]:
        return {"file": candidate.path}, []


