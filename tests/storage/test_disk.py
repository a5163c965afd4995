"""Disk tier: bit-exact round trips, atomic writes under failure, validation, path safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from phloem.storage import (
    CorruptSegment,
    DiskStore,
    SessionJournal,
    SessionRecord,
    StorageUnavailable,
    hash_token_ids,
)

RECORD = SessionRecord(
    session_id="s1", owner="k", model_fingerprint="m", num_tokens=1, last_used=0.0, data="{}"
)


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_is_bit_exact(
    tmp_path, make_segment, assert_bit_exact, fingerprint, dtype
) -> None:
    store = DiskStore(tmp_path / "data")
    seg = make_segment(dtype=dtype)
    seg.tensors["ssm"][0, 0, 0, :3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    path = store.write(seg)
    assert path == tmp_path / "data" / "sess-A" / "seg-1.safetensors"
    assert all_files(tmp_path / "data") == ["sess-A", "sess-A/seg-1.safetensors"]
    assert_bit_exact(store.read("sess-A", "seg-1", expect_fingerprint=fingerprint), seg)
    assert_bit_exact(store.read_path(path, expect_fingerprint=None), seg)
    assert store.read_meta("sess-A", "seg-1") == seg.meta


def test_header_is_self_describing(tmp_path, make_segment, fingerprint) -> None:
    seg = make_segment()
    path = DiskStore(tmp_path).write(seg)
    with safe_open(path, framework="pt") as f:
        header = f.metadata()
    assert header["phloem.format_version"] == "1"
    meta = json.loads(header["phloem.segment_meta"])
    assert meta["model_fingerprint"] == fingerprint
    assert meta["token_ids_hash"] == hash_token_ids(seg.tensors["token_ids"])
    assert (meta["page_size"], meta["kv_dtype"], meta["num_tokens"]) == (4, "bfloat16", 10)
    assert meta["layout"]["num_kv_heads"] == 2


def test_scan_reads_headers_and_skips_junk(tmp_path, make_segment) -> None:
    store = DiskStore(tmp_path)
    segs = [make_segment("s1", "g1"), make_segment("s1", "g2"), make_segment("s2", "g1")]
    for seg in segs:
        store.write(seg)
    (tmp_path / "s1" / ".g3.safetensors.abc.tmp").write_bytes(b"half")
    (tmp_path / "s2" / "bad.safetensors").write_bytes(b"not safetensors")
    assert sorted(m.segment_id + m.session_id for m in store.scan()) == ["g1s1", "g1s2", "g2s1"]
    by_location = sorted((s.meta for s in segs), key=lambda m: (m.session_id, m.segment_id))
    assert list(store.scan()) == by_location
    assert store.remove_temp_files() == 1
    assert not (tmp_path / "s1" / ".g3.safetensors.abc.tmp").exists()


def test_delete_and_delete_session(tmp_path, make_segment) -> None:
    store = DiskStore(tmp_path)
    store.write(make_segment("s1", "g1"))
    store.write(make_segment("s1", "g2"))
    assert store.delete("s1", "g1") and not store.delete("s1", "g1")
    assert not store.exists("s1", "g1") and store.exists("s1", "g2")
    assert store.delete_session("s1") == 1 and store.delete_session("s1") == 0
    assert all_files(tmp_path) == []


def _partial_then_fail(tensors, filename, metadata=None) -> None:
    Path(filename).write_bytes(b"\x00" * 100)
    raise SafetensorError("I/O error: No space left on device (os error 28)")


def _fail_with(errno_: int):
    def fail(*args, **kwargs):
        raise OSError(errno_, os.strerror(errno_))

    return fail


FAULTS = [
    pytest.param(safetensors.torch, "save_file", _partial_then_fail, id="disk-full-mid-write"),
    pytest.param(os, "fsync", _fail_with(5), id="fsync-fails"),
    pytest.param(os, "replace", _fail_with(5), id="rename-fails"),
]


@pytest.mark.parametrize(("module", "name", "fake"), FAULTS)
def test_failed_write_leaves_nothing(
    tmp_path, make_segment, monkeypatch, module, name, fake
) -> None:
    store = DiskStore(tmp_path)
    monkeypatch.setattr(module, name, fake)
    with pytest.raises(StorageUnavailable, match="cannot (write|create directory)") as info:
        store.write(make_segment())
    assert isinstance(info.value.__cause__, OSError)
    assert all_files(tmp_path) == [], "no final file, no temp file, no new session directory"


@pytest.mark.parametrize(("module", "name", "fake"), FAULTS)
def test_failed_overwrite_keeps_previous_version(
    tmp_path, make_segment, assert_bit_exact, monkeypatch, module, name, fake
) -> None:
    store = DiskStore(tmp_path)
    old = make_segment(seed=1)
    store.write(old)
    monkeypatch.setattr(module, name, fake)
    with pytest.raises(StorageUnavailable):
        store.write(make_segment(seed=2))
    monkeypatch.undo()
    assert all_files(tmp_path) == ["sess-A", "sess-A/seg-1.safetensors"]
    assert_bit_exact(store.read("sess-A", "seg-1", expect_fingerprint=None), old)


@pytest.mark.slow  # a child process writing under a file-size limit
def test_real_disk_full_mid_write(tmp_path) -> None:
    # A real short write: the child's file-size limit (RLIMIT_FSIZE) makes write(2) fail with
    # EFBIG part-way through the 1 MiB payload, like a full disk would with ENOSPC.
    script = textwrap.dedent(
        """
        import resource, signal, sys, torch
        from phloem.storage import DiskStore, Segment, StorageUnavailable
        store = DiskStore(sys.argv[1])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        seg = Segment.from_tensors(session_id="s", segment_id="g", model_fingerprint="m", tensors={
            "kv": torch.zeros(1, 16, 2, 16, 16, 64), "conv": torch.zeros(0, 8, 3),
            "ssm": torch.zeros(0, 2, 4, 4), "token_ids": torch.arange(256)})
        try:
            store.write(seg)
        except StorageUnavailable as e:
            print("unavailable", type(e.__cause__).__name__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unavailable", "OSError"]
    assert all_files(tmp_path) == []


def test_read_only_directories(tmp_path, make_segment, unprivileged) -> None:
    store = DiskStore(tmp_path / "data")
    store.write(make_segment("s1", "g1"))
    journal = SessionJournal(tmp_path / "journal")
    before = all_files(tmp_path)
    (tmp_path / "data").chmod(0o555)
    (tmp_path / "data" / "s1").chmod(0o555)
    (tmp_path / "journal" / "sessions").chmod(0o555)
    try:
        with pytest.raises(StorageUnavailable, match="cannot create directory") as new_dir:
            unprivileged(lambda: store.write(make_segment("s2", "g1")))
        with pytest.raises(StorageUnavailable, match="cannot write") as new_file:
            unprivileged(lambda: store.write(make_segment("s1", "g2")))
        with pytest.raises(StorageUnavailable, match="cannot create directory"):
            unprivileged(lambda: SessionJournal(tmp_path / "data"))
        with pytest.raises(StorageUnavailable, match="cannot write"):
            unprivileged(lambda: journal.write(RECORD))
    finally:
        for path in ("data", "data/s1", "journal/sessions"):
            (tmp_path / path).chmod(0o755)
    assert isinstance(new_dir.value.__cause__, PermissionError)
    assert isinstance(new_file.value.__cause__, PermissionError)
    assert all_files(tmp_path) == before


def _rewrite(path: Path, *, tensors=None, header=None) -> None:
    with safe_open(path, framework="pt") as f:
        old_header = f.metadata()
        old_tensors = {k: f.get_tensor(k) for k in f.keys()}
    new_tensors, new_header = {**old_tensors, **(tensors or {})}, {**old_header, **(header or {})}
    safetensors.torch.save_file(new_tensors, path, new_header)


def _edit_meta(path: Path, **changes) -> None:
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["phloem.segment_meta"])
    meta.update(changes)
    _rewrite(path, header={"phloem.segment_meta": json.dumps(meta)})


def _edit_layout(path: Path, **changes) -> None:
    with safe_open(path, framework="pt") as f:
        layout = json.loads(f.metadata()["phloem.segment_meta"])["layout"]
    _edit_meta(path, layout={**layout, **changes})


def _tamper_token_id(path: Path) -> None:
    with safe_open(path, framework="pt") as f:
        ids = f.get_tensor("token_ids")
    ids[3] += 1
    _rewrite(path, tensors={"token_ids": ids})


FUTURE_VERSION = {"phloem.format_version": "99"}
EMPTY_SAFETENSORS = (8).to_bytes(8, "little") + b"{}      "


def _replace_tensor(name: str, tensor: torch.Tensor):
    return lambda path: _rewrite(path, tensors={name: tensor})


CORRUPTIONS = [
    pytest.param(lambda p: _edit_meta(p, token_ids_hash="0" * 64), "do not hash", id="bad-hash"),
    pytest.param(_tamper_token_id, "do not hash", id="tampered-token-ids"),
    pytest.param(lambda p: _edit_layout(p, num_kv_heads=3), "kv has shape", id="layout-disagrees"),
    pytest.param(lambda p: _edit_layout(p, conv_kernel_size=5), "conv has shape", id="conv-kernel"),
    pytest.param(_replace_tensor("ssm", torch.zeros(3, 2, 8, 5)), "ssm has shape", id="shape"),
    pytest.param(_replace_tensor("extra", torch.zeros(1)), "exactly", id="extra-tensor"),
    pytest.param(lambda p: _edit_meta(p, num_tokens=12), "token_ids has shape", id="num-tokens"),
    pytest.param(lambda p: _rewrite(p, header=FUTURE_VERSION), "format version", id="version"),
    pytest.param(lambda p: _edit_meta(p, page_size="4"), "invalid segment header", id="bad-header"),
    pytest.param(lambda p: _edit_meta(p, session_id="other"), "moved or renamed", id="moved"),
    pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-7]), "not a valid", id="truncated"),
    pytest.param(lambda p: p.write_bytes(EMPTY_SAFETENSORS), "format version", id="no-header"),
]


@pytest.mark.parametrize(("corrupt", "message"), CORRUPTIONS)
def test_read_rejects_corrupt_files(tmp_path, make_segment, fingerprint, corrupt, message) -> None:
    store = DiskStore(tmp_path)
    path = store.write(make_segment())
    corrupt(path)
    with pytest.raises(CorruptSegment, match=message):
        store.read("sess-A", "seg-1", expect_fingerprint=fingerprint)


def test_read_rejects_other_model(tmp_path, make_segment) -> None:
    store = DiskStore(tmp_path)
    store.write(make_segment(fingerprint="model-A"))
    with pytest.raises(CorruptSegment, match="model 'model-A', expected model 'model-B'"):
        store.read("sess-A", "seg-1", expect_fingerprint="model-B")


def test_read_missing_is_unavailable(tmp_path) -> None:
    with pytest.raises(StorageUnavailable, match="cannot read segment") as info:
        DiskStore(tmp_path).read("nope", "nope", expect_fingerprint=None)
    assert isinstance(info.value.__cause__, FileNotFoundError)


BAD_IDS = ["../x", "..", ".", "/etc", "/etc/passwd", "a/b", "a\\b", "a\x00b", "", "x" * 129, "a b",
           "s\u00e9", "~root", 7, None]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_ids_are_checked_before_touching_paths(tmp_path, bad) -> None:
    store, journal = DiskStore(tmp_path / "segments"), SessionJournal(tmp_path)
    calls = [
        lambda: store.path_for(bad, "g"),
        lambda: store.path_for("s", bad),
        lambda: store.read(bad, "g", expect_fingerprint=None),
        lambda: store.delete("s", bad),
        lambda: store.delete_session(bad),
        lambda: journal.path_for(bad),
        lambda: journal.delete(bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="must be 1-128 characters"):
            call()
    assert all_files(tmp_path) == ["segments", "sessions"]


def test_longest_id_is_accepted_and_read_path_stays_under_root(tmp_path, make_segment) -> None:
    store = DiskStore(tmp_path / "data")
    store.write(make_segment("s" * 128, "g" * 128))
    assert store.exists("s" * 128, "g" * 128)
    outside = tmp_path / "elsewhere" / "x.safetensors"
    escape = tmp_path / "data" / "s" / ".." / ".." / "x.safetensors"
    for path in (outside, escape, tmp_path / "data"):
        with pytest.raises(ValueError, match="not a segment file path"):
            store.read_path(path, expect_fingerprint=None)
