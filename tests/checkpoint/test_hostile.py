"""Hostile input: every save directory ends in a documented exit code with a one-line reason, in bounded
memory, opening only regular files inside the checkpoint. Each case was a traceback, a hang or a pass before."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ft_plugins.checkpoint import CheckpointError, find_latest, verify, write_manifest
from ft_plugins.checkpoint.manifest import MANIFEST
from ft_plugins.checkpoint.probes import probe
from ft_plugins.cli import main as cli_main
from support import PYTHON

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


def _iteration(root: Path, iteration: int) -> Path:
    rank_dir = root / f"iter_{iteration:07d}" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({"w": torch.ones(4) * iteration}, rank_dir / "model_optim_rng.pt")
    return rank_dir.parent


def _cli(*argv: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """The CLI in its own process, so a hang is a failure (timeout) and not a stuck suite."""
    return subprocess.run([PYTHON, "-m", "ft_plugins.cli", *argv], capture_output=True, text=True, timeout=timeout)


def test_symlink_loops_in_the_save_directory_and_above_a_verified_path(tmp_path: Path) -> None:
    save = tmp_path / "save"
    _iteration(save, 2)
    (save / "loop").symlink_to("loop")
    (save / "iter_0000009").symlink_to("iter_0000009")
    (tmp_path / "parent_loop").symlink_to("parent_loop")
    result = _cli("ckpt", "latest", str(save))
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, str(save / "iter_0000002"), "")
    result = _cli("ckpt", "verify", str(save / "iter_0000002"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    looped = _cli("ckpt", "latest", str(save / "loop"))
    assert looped.returncode == 1 and looped.stderr.count("\n") == 1 and "cannot be read" in looped.stderr


def test_negative_rank_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["ckpt", "latest", str(tmp_path), "--rank", "-1"])
    assert exit_info.value.code == 2
    with pytest.raises(CheckpointError, match="not a rank"):
        find_latest(tmp_path, rank=-1)


@pytest.mark.parametrize("named", ["/dev/zero", "../outside.pt", "../../etc/passwd"])
def test_manifest_naming_a_path_outside_the_checkpoint_is_refused_not_read(named: str, tmp_path: Path) -> None:
    save = tmp_path / "save"
    _iteration(save, 2)
    newest = _iteration(save, 4)
    write_manifest(str(newest))
    (save / "outside.pt").write_bytes(b"x")
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"][named] = {"size": 0, "sample": "0", "sha256": "0"}
    (newest / MANIFEST).write_text(json.dumps(manifest))
    result = _cli("ckpt", "latest", str(save), "--deep", "--json", timeout=30)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["iteration"] == 2 and "outside the checkpoint" in out["skipped"][0]["reason"]


def test_devices_and_fifos_where_files_belong_are_not_opened(tmp_path: Path) -> None:
    save = tmp_path / "save"
    _iteration(save, 2)
    newest = save / "iter_0000004" / "mp_rank_00"
    newest.mkdir(parents=True)
    os.mkfifo(newest / "model_optim_rng.pt")  # opening it for reading would block forever
    os.mkfifo(save / "latest_checkpointed_iteration.txt")
    result = _cli("ckpt", "latest", str(save), "--deep", "--json", timeout=30)
    assert result.returncode == 0, result.stderr
    reasons = {Path(s["path"]).name: s["reason"] for s in json.loads(result.stdout)["skipped"]}
    assert "not a regular file" in reasons["iter_0000004"] and "cannot be read" in reasons[
        "latest_checkpointed_iteration.txt"]
    assert probe("/dev/zero", deep=True) == "not a regular file (a directory, device or FIFO)"


def _protobuf_with_huge_payload(path: Path, payload: int) -> None:
    """One ``Checkpoint.value`` field (1) holding one length-delimited field of ``payload`` sparse zero bytes."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
            value >>= 7
            if not value:
                return bytes(out)

    inner = b"\x0a" + varint(payload)
    with open(path, "wb") as handle:
        handle.write(b"\x0a" + varint(len(inner) + payload) + inner)
        handle.truncate(handle.tell() + payload)


def test_mindspore_probe_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "net-1_1.ckpt"
    _protobuf_with_huge_payload(path, 1 << 30)  # 1 GiB, sparse on disk
    import tracemalloc

    tracemalloc.start()
    try:
        verdicts = probe(str(path), deep=True), probe(str(path), deep=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert verdicts == (None, None)
    assert peak < 1 << 20, f"peak {peak} bytes allocated probing a 1 GiB checkpoint"
    with open(path, "r+b") as handle:  # the same file cut short: the framing says so
        handle.truncate((1 << 30) - 1)
    assert "truncated" in probe(str(path))


def _eocd(data: bytes) -> int:
    return data.rfind(b"PK\x05\x06")


ZIP_LIES = {
    # (field offset in the classic end record, format, value): both records must agree with the file
    "central directory offset past the file": (16, "<L", 1 << 30),
    "entry count that does not match": (8, "<HH", (2, 2)),
}


@pytest.mark.parametrize("case", sorted(ZIP_LIES))
@pytest.mark.parametrize("zip64", [True, False], ids=["with-zip64", "classic-only"])
def test_zip_end_records_that_lie_are_caught(case: str, zip64: bool, tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    data = bytearray(path.read_bytes())
    at = _eocd(data)
    if not zip64:  # drop torch's zip64 record and locator: the classic record is all there is
        record = data[at:]
        start = data.rfind(b"PK\x06\x06")
        data = data[:start] + record
        at = start
    assert probe_bytes(path, bytes(data)) is None  # the untouched archive is sound
    offset, fmt, value = ZIP_LIES[case]
    struct.pack_into(fmt, data, at + offset, *(value if isinstance(value, tuple) else (value,)))
    reason = probe_bytes(path, bytes(data))
    assert reason and reason.startswith("not a readable torch zip archive") or "members" in reason, reason


def probe_bytes(path: Path, data: bytes) -> str | None:
    path.write_bytes(data)
    return probe(str(path))


def _hf_checkpoint(root: Path, step: int) -> Path:
    from safetensors.torch import save_file

    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(directory / "model.safetensors"))
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    return directory


JSON_DAMAGE = {
    "trainer_state.json nested": ("trainer_state.json", DEEP, "not valid JSON (nested too deeply"),
    "index weight_map of lists": ("model.safetensors.index.json", json.dumps({"weight_map": {"w": [1]}}),
                                  "no weight_map table"),
    "index weight_map escaping": ("model.safetensors.index.json",
                                  json.dumps({"weight_map": {"w": "/etc/passwd", "v": "../x"}}), "outside the checkpoint"),
    "index not an object": ("model.safetensors.index.json", "[1, 2]", "no weight_map table"),
    "manifest nested": (MANIFEST, DEEP, "manifest ft_manifest.json is unreadable (nested too deeply)"),
    "manifest files of numbers": (MANIFEST, json.dumps({"files": {"model.safetensors": 3}}), "malformed entry"),
    "manifest size a string": (MANIFEST, json.dumps({"files": {"model.safetensors": {"size": "8", "sample": "x"}}}),
                               "malformed entry"),
}


@pytest.mark.parametrize("case", sorted(JSON_DAMAGE))
def test_wrongly_typed_or_deeply_nested_json_is_a_reason_not_a_traceback(case: str, tmp_path: Path) -> None:
    name, text, reason = JSON_DAMAGE[case]
    _hf_checkpoint(tmp_path, 1)
    newest = _hf_checkpoint(tmp_path, 2)
    (newest / name).write_text(text)
    selection = find_latest(tmp_path)
    assert selection.iteration == 1 and reason in selection.skipped[0].reason, selection.skipped


def test_safetensors_header_nested_or_with_wrong_offsets(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    for header, reason in ((DEEP.encode(), "not valid JSON"),
                           (b'{"w": {"data_offsets": [0.5, true]}}', "no valid data_offsets"),
                           (b'{"w": {"data_offsets": ["0", "8"]}}', "no valid data_offsets")):
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        assert reason in probe(str(path))


def test_mindspore_json_side_files_of_the_wrong_shape(tmp_path: Path) -> None:
    """``health_ckpts.json`` as an object or nested, ``common.json`` with a string step: ignored, no traceback."""
    for text in ('{"ckpt_name": "x"}', DEEP, "7"):
        (tmp_path / "health_ckpts.json").write_text(text)
        rank = tmp_path / "rank_0"
        rank.mkdir(exist_ok=True)
        (rank / "net-1_2.ckpt").write_bytes(b"\x0a\x02\x08\x01")
        assert find_latest(tmp_path, rank=0).step == 2
    iterations = tmp_path / "mf"
    directory = iterations / "iteration_00000004"
    directory.mkdir(parents=True)
    (directory / "common.json").write_text(json.dumps({"epoch_num": "1", "step_num": [4]}))
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(directory / "model-0000000-0000001.safetensors"))
    selection = find_latest(iterations)
    assert (selection.iteration, selection.epoch, selection.step) == (4, None, None)
    (directory / "common.json").write_text(DEEP)
    assert "nested too deeply" in find_latest(iterations).skipped[0].reason
    assert verify(directory).intact is False


def test_distcp_metadata_is_walked_not_unpickled_and_its_shard_paths_kept_inside(tmp_path: Path,
                                                                                 metadata_walk: str) -> None:
    """The extents come from the ``.metadata`` opcodes; a shard file named outside the checkpoint is not stat-ed."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(64)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = tmp_path / ".metadata"
    assert probe(str(metadata)) is None
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert "its shards need" in probe(str(metadata))
    metadata.write_bytes(metadata.read_bytes().replace(b"__0_0.distcp", b"/_0_0.distcp"))
    assert "outside the checkpoint" in probe(str(metadata))


def _memo_put_at(metadata: bytes, protocol: int, index: int | None) -> bytes:
    """``metadata`` pickled again with ``protocol`` (0: text PUT after a PROTO, 2: BINPUT/LONG_BINPUT), its
    last memo put naming ``index`` (None: as the pickler wrote it), so the pass reads the whole file to it."""
    import pickle
    import pickletools

    data = (b"\x80\x02" if protocol == 0 else b"") + pickle.dumps(pickle.loads(metadata), protocol=protocol)
    if index is None:
        return data
    opcode, _, at = [found for found in pickletools.genops(data) if "PUT" in found[0].name][-1]
    end = data.index(b"\n", at) + 1 if opcode.name == "PUT" else at + (2 if opcode.name == "BINPUT" else 5)
    return data[:at] + (b"p%d\n" % index if protocol == 0 else b"r" + struct.pack("<I", index)) + data[end:]


@pytest.mark.parametrize("apart", [1 << 60, 0], ids=["walked here", "walked apart"])
def test_a_metadata_memo_index_beyond_its_size_is_refused_before_unpickling(apart: int, tmp_path: Path) -> None:
    """Four bytes of a LONG_BINPUT (or a PUT's line) would have the C unpickler set aside index x 16 bytes at
    once; such a .metadata is refused by its reason, read in a child whose address space could not grant it,
    while the memo puts of every protocol's honest pickle still pass; the same where the walk runs in a process
    of its own (``apart``: the size from which it does)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(64)}, checkpoint_id=str(tmp_path / "saved"), no_dist=True)
    metadata = (tmp_path / "saved" / ".metadata").read_bytes()
    cases = {f"protocol {protocol}": _memo_put_at(metadata, protocol, None) for protocol in (0, 2, 5)}
    cases["LONG_BINPUT 2**32-1"] = _memo_put_at(metadata, 2, 2**32 - 1)
    cases["PUT 10**11"] = _memo_put_at(metadata, 0, 10**11)
    for name, data in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(data)
        (tmp_path / name / "__0_0.distcp").write_bytes((tmp_path / "saved" / "__0_0.distcp").read_bytes())
    child = ("import json, resource, sys\n"
             "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
             "from ft_plugins.checkpoint import distcp\n"
             "from ft_plugins.checkpoint.probes import probe\n"
             "distcp._APART = int(sys.argv[2])\n"
             "print(json.dumps({name: probe(f'{sys.argv[1]}/{name}/.metadata') for name in sys.argv[3:]}))")
    result = subprocess.run([PYTHON, "-c", child, str(tmp_path), str(apart), *cases], capture_output=True, text=True,
                            timeout=120)
    reasons = json.loads(result.stdout)
    assert {name: reasons[name] for name in cases if name.startswith("protocol")} == dict.fromkeys(
        ["protocol 0", "protocol 2", "protocol 5"]), reasons
    assert "memo index 4294967295 beyond the pickle's" in reasons["LONG_BINPUT 2**32-1"], reasons
    assert "memo index 100000000000 beyond the pickle's" in reasons["PUT 10**11"], reasons


def test_a_metadata_walk_apart_is_bounded_in_memory_by_the_system(tmp_path: Path) -> None:
    """In a process of its own the walk's memory is bounded by the system, not by a pass over the opcodes: a
    pickle that builds far more for its size than an honest .metadata (an empty dict for each of its 12 MB, 90
    bytes of memory each: a gigabyte) is refused by that bound instead of granted."""
    (tmp_path / "__0_0.distcp").write_bytes(b"\0")
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"}" * (12 << 20) + b".")
    assert probe(str(tmp_path / ".metadata")) == ("pickle opcodes broken: ValueError: reading it takes more memory "
                                                 "than 48 bytes for each of its bytes")


def _records(*states: bytes) -> bytes:
    """A protocol 2 pickle of a list of DCP shard records (``_StorageInfo``), each built with the given state."""
    record = b"cdcp.filesystem\n_StorageInfo\n)\x81%sb"
    return b"\x80\x02](" + b"".join(record % state for state in states) + b"e."


def _state(path: object = "__0_0.distcp", offset: object = 0, length: object = 4, drop: str = "") -> bytes:
    """A record's state: a dict of its file, offset and length (``drop``: that key left out); ints as BININT,
    True as NEWTRUE, strings as BINUNICODE."""
    encode = lambda value: (b"\x88" if value is True else struct.pack("<ci", b"J", value) if type(value) is int  # noqa
                            else b"X" + struct.pack("<I", len(value.encode())) + value.encode())
    fields = {"relative_path": path, "offset": offset, "length": length}
    return b"}(" + b"".join(encode(key) + encode(value) for key, value in fields.items() if key != drop) + b"u"


@pytest.mark.parametrize("state", [
    _state(drop="length"), _state(offset=-1), _state(length=-4), _state(length=True), _state(offset="0"),
    _state(path=7), b"](e", b"(\x88" + _state() + b"t",  # a list; a tuple whose first item is no dict
], ids=["no length", "negative offset", "negative length", "length True", "offset a string", "path a number",
        "a list", "a tuple without a dict"])
def test_a_shard_record_of_the_wrong_shape_is_refused(state: bytes, tmp_path: Path, metadata_walk: str) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 16)
    (tmp_path / ".metadata").write_bytes(_records(_state(), state))
    assert probe(str(tmp_path / ".metadata")) == ("pickle opcodes broken: ValueError: a shard record without a file, "
                                                 "offset and length")


def test_torch_size_named_by_a_metadata_is_built_from_one_tuple_or_refused(tmp_path: Path, metadata_walk: str) -> None:
    """``torch.Size``, every offset and size of a DCP ``.metadata``, stands in at C speed: built from its one tuple,
    a real save's records read as before; a file that builds it from one string 65,536 times (what a copy of its
    argument would make half a gigabyte of) is read within its bounds, and one that gives it no tuple or two arguments
    is refused."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 16)
    metadata = tmp_path / ".metadata"
    real = {MetadataIndex("w", torch.Size([0, 4]), 0): _StorageInfo("__0_0.distcp", 8, 8)}
    metadata.write_bytes(pickle.dumps(real, protocol=4))
    assert probe(str(metadata)) is None
    metadata.write_bytes(pickle.dumps({**real, MetadataIndex("v", torch.Size([4]), 0): _StorageInfo(
        "__0_0.distcp", 12, 8)}, protocol=4))
    assert probe(str(metadata)) == "__0_0.distcp holds 16 bytes, its shards need 20 (truncated)"
    size = b"\x8c\x05torch\x8c\x04Size\x93"
    string = b"X" + struct.pack("<I", 1 << 10) + b"s" * (1 << 10)
    copies = b"h\x00h\x01\x85R\x940" * (1 << 16)  # each kept in the memo: half a gigabyte as 1,024-tuples
    metadata.write_bytes(b"\x80\x04" + size + b"\x940" + string + b"\x940" + copies + _records(_state(offset=8))[2:])
    assert probe(str(metadata)) is None
    for arguments in (b"N\x85", b"K\x01K\x02\x86"):  # no tuple; two arguments
        metadata.write_bytes(b"\x80\x04" + size + arguments + b"R0" + _records(_state())[2:])
        assert probe(str(metadata)).startswith("pickle opcodes broken: TypeError"), arguments


def test_a_metadata_walk_that_cannot_run_apart_runs_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No interpreter to start, or one that ends without its answer: the check walks the file itself, with the
    same answers."""
    from ft_plugins.checkpoint import distcp

    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 12)
    metadata = tmp_path / ".metadata"
    metadata.write_bytes(_records(_state(offset=8)))
    monkeypatch.setattr(distcp, "_APART", 0)
    for interpreter in (str(tmp_path / "no-python"), "/bin/false"):
        monkeypatch.setattr(sys, "executable", interpreter)
        assert probe(str(metadata)) is None, interpreter
        metadata.write_bytes(_records(_state(offset=9)))
        assert probe(str(metadata)) == "__0_0.distcp holds 12 bytes, its shards need 13 (truncated)", interpreter
        metadata.write_bytes(_records(_state(offset=8)))


def test_each_shard_file_must_hold_its_furthest_record() -> None:
    """Records in any order, a state as (dict, slots) too: each file's extent is the end of its furthest one."""
    from ft_plugins.checkpoint.distcp import storage_extents

    data = _records(_state(offset=8), _state(offset=0), b"(" + _state("__1_0.distcp", 2, 3) + b"Nt")
    assert storage_extents(data) == {"__0_0.distcp": 12, "__1_0.distcp": 5}


def test_a_framed_metadata_is_unpickled_a_frame_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A .metadata of protocol 4 or later (DCP's) is handed to the unpickler one frame per call of a Python
    method, each a point where the check's other threads take their turn at the interpreter lock; an unframed
    one is read whole, which would otherwise cost a call per opcode. The extents are the same."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ft_plugins.checkpoint import distcp

    records = [_StorageInfo(f"__{rank}_0.distcp", 0, 64) for rank in range(5000)]
    calls: list[int] = []
    read = distcp._Turns.read
    monkeypatch.setattr(distcp._Turns, "read", lambda self, size=-1: (calls.append(size), read(self, size))[1])
    for protocol in (2, 4, 5):
        calls.clear()
        extents = distcp.storage_extents(pickle.dumps(records, protocol=protocol))
        assert extents == {f"__{rank}_0.distcp": 64 for rank in range(5000)}
        assert (len(calls) > 3) == (protocol >= 4), (protocol, len(calls))
