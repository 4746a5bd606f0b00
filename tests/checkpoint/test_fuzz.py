"""Property-based fuzzing of every probe and every JSON a layout reads: whatever the bytes, the answer is
None or a reason, never an exception. Fixed budget (derandomized, a set number of examples) so CI is stable."""

from __future__ import annotations

import io
import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_plugins.checkpoint import find_latest, verify
from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.checkpoint.probes import BY_SUFFIX, probe
from ft_plugins.checkpoint.errors import NoIntactCheckpoint
from ft_plugins.features.resume import Resume

FUZZ = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _torch_zip() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(16.0), "step": 3}, buffer)
    return buffer.getvalue()


def _safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 8


def _distcp_metadata() -> tuple[bytes, bytes]:
    """A real torch.distributed.checkpoint save: its ``.metadata`` and its one ``.distcp`` file."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as directory:
        dcp.save({"w": torch.ones(4), "v": torch.zeros(3)}, checkpoint_id=directory, no_dist=True)
        return Path(directory, ".metadata").read_bytes(), Path(directory, "__0_0.distcp").read_bytes()


METADATA, DISTCP = _distcp_metadata()
SEEDS = {".pt": _torch_zip(), ".safetensors": _safetensors(), ".ckpt": b"\x0a\x08\x0a\x02ab\x12\x02\x08\x01",
         ".json": b'{"files": {"a": {"size": 1, "sample": "x"}}}', ".metadata": METADATA}


@st.composite
def _mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """A seed file cut, overwritten or extended at drawn places: near-valid input reaches deep code."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["cut", "overwrite", "insert"]))
        at = draw(st.integers(0, len(data)))
        if action == "cut":
            data = data[:at]
        elif action == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at:at + len(chunk)] = chunk
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def _fuzz_probe(suffix: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, suffix if suffix == ".metadata" else f"file{suffix}")
        path.write_bytes(data)
        Path(directory, "__0_0.distcp").write_bytes(DISTCP)
        for deep in (False, True):
            reason = probe(str(path), deep)
            assert reason is None or (isinstance(reason, str) and reason)


@FUZZ
@given(suffix=st.sampled_from(sorted(BY_SUFFIX)), data=st.binary(max_size=512))
def test_every_probe_on_arbitrary_bytes(suffix: str, data: bytes) -> None:
    _fuzz_probe(suffix, data)


@FUZZ
@given(data=st.data())
def test_every_probe_on_mutated_real_files(data: st.DataObject) -> None:
    suffix = data.draw(st.sampled_from(sorted(SEEDS)))
    _fuzz_probe(suffix, data.draw(_mutated(SEEDS[suffix])))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
# the names layouts give meaning to, so drawn objects often have the shape a reader expects
KEYED = st.dictionaries(st.sampled_from(["files", "weight_map", "size", "sample", "sha256", "epoch_num", "step_num",
                                         "ckpt_name", "is_health", "common_backend", "data_offsets"]),
                        JSON_VALUES, max_size=4)
DOCUMENTS = (st.builds(json.dumps, JSON_VALUES | KEYED | st.lists(KEYED, max_size=3)
                       | st.builds(lambda files: {"files": files}, st.dictionaries(
                           st.sampled_from(["model.safetensors", "/dev/zero", "../x", "a/../../b"]), KEYED | JSON_VALUES,
                           max_size=3)))
             | st.integers(1, 5000).map(lambda depth: "[" * depth + "]" * depth)
             | st.binary(max_size=64).map(lambda raw: raw.decode("latin-1")))


def _write(directory: Path, files: dict[str, bytes | str]) -> None:
    for name, content in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def _layouts(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """One small save directory per layout, two checkpoints each; the newest one and the JSON files it reads."""
    tensors = SEEDS[".safetensors"]
    saves = {
        "hf": ("checkpoint-{}", (1, 2), {"model.safetensors": tensors, "trainer_state.json": "{}",
                                         "model.safetensors.index.json": '{"weight_map": {"w": "model.safetensors"}}'},
               ["trainer_state.json", "model.safetensors.index.json", MANIFEST]),
        "mf": ("iteration_{:08d}", (2, 4), {"model-0000000-0000001.safetensors": tensors, "metadata.json": "{}",
                                            "common.json": '{"epoch_num": 1, "step_num": 2}'},
               ["common.json", "metadata.json", MANIFEST]),
        "megatron": ("iter_{:07d}", (2, 4), {".metadata": METADATA, "__0_0.distcp": DISTCP,
                                             "metadata.json": '{"sharded_backend": "torch_dist"}'},
                     ["metadata.json", MANIFEST, ".metadata"]),
        "megatron_torch": ("iter_{:07d}", (2, 4), {"mp_rank_00/model_optim_rng.pt": SEEDS[".pt"]}, [MANIFEST]),
    }
    made = {}
    for layout, (pattern, keys, files, json_names) in saves.items():
        for key in keys:
            _write(root / layout / pattern.format(key), files)
        made[layout] = (root / layout / pattern.format(keys[-1]), json_names)
    (root / "megatron_torch" / "latest_checkpointed_iteration.txt").write_text("4")
    _write(root / "ms", {"rank_0/net-1_2.ckpt": SEEDS[".ckpt"], "rank_0/net-1_4.ckpt": SEEDS[".ckpt"],
                         "health_ckpts.json": "[]"})
    made["ms"] = (root / "ms", ["health_ckpts.json", "rank_0/ft_manifest-1_4.json"])
    _write(root / "torch", {"epoch_1.pt": SEEDS[".pt"], "epoch_2.pt": SEEDS[".pt"]})
    made["torch"] = (root / "torch" / "epoch_2.pt", [])
    return made


@FUZZ
@given(layout=st.sampled_from(["hf", "mf", "ms", "megatron", "megatron_torch"]), which=st.integers(0, 2), text=DOCUMENTS,
       deep=st.booleans())
def test_every_json_a_layout_reads_never_raises(layout: str, which: int, text: str, deep: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        made = _layouts(Path(directory))
        target, names = made[layout]
        name = names[which % len(names)]
        (target / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        save = target if layout == "ms" else target.parent
        selection = find_latest(save, deep=deep, rank=0)
        assert selection.path is not None or selection.skipped  # an answer, with reasons when none is intact
        assert selection.epoch is None or type(selection.epoch) is int
        assert selection.step is None or type(selection.step) is int
        if layout != "ms":
            verdict = verify(target, deep=deep)
            assert verdict.intact or verdict.reasons
        resume = Resume("pt", {"deep": deep, "allow_scratch": True})  # the choice path training runs
        resume.start()
        assert resume.choose(str(save), rank=0) is not None
        resume.settings["allow_scratch"] = False
        try:
            resume.choose(str(save), rank=0)
        except NoIntactCheckpoint:
            pass


def test_no_layout_is_unpickled_or_loaded_while_probed(tmp_path: Path, monkeypatch) -> None:
    """Every way to unpickle (pickle.load/loads/Unpickler, torch.load) raises while each layout is searched
    and verified, fast and deep, committed and not: the probes read structure only."""
    import pickle

    from ft_plugins.checkpoint import write_manifest

    made = _layouts(tmp_path)
    for layout, (target, _) in made.items():
        if layout not in ("ms", "torch"):
            write_manifest(str(target), full=True)
    calls = []

    def trap(name: str):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while probing")
        return refuse

    class Unpickler:
        def __init__(self, *args, **kwargs):
            trap("pickle.Unpickler")()

    with monkeypatch.context() as patched:
        patched.setattr(pickle, "load", trap("pickle.load"))
        patched.setattr(pickle, "loads", trap("pickle.loads"))
        patched.setattr(pickle, "Unpickler", Unpickler)
        patched.setattr(torch, "load", trap("torch.load"))
        for layout, (target, _) in made.items():
            save = target if layout == "ms" else target.parent
            for deep in (False, True):
                assert find_latest(save, deep=deep, rank=0).path is not None, layout
                if layout != "ms":
                    assert verify(target, deep=deep).intact, layout
        with pytest.raises(AssertionError):  # the traps are live
            pickle.loads(pickle.dumps(1))
    assert calls == ["pickle.loads"]
