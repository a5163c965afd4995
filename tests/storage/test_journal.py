"""Session journal: durable JSON records, atomic replacement, corruption handling."""

from __future__ import annotations

import json
import os

import pytest

from phloem.storage import CorruptRecord, SessionJournal, SessionRecord, StorageUnavailable


def record(session_id: str = "s1", **changes) -> SessionRecord:
    data = json.dumps({"token_ids": [1, 2, 3], "turns": [3]})
    fields = dict(session_id=session_id, owner="key-1", model_fingerprint="m", num_tokens=7,
                  last_used=1_700_000_000.125, data=data)
    fields.update(changes)
    return SessionRecord(**fields)


def test_write_read_replace_delete(tmp_path) -> None:
    journal = SessionJournal(tmp_path)
    path = journal.write(record(tier="disk", segment_id="g1"))
    assert path == tmp_path / "sessions" / "s1.json"
    assert journal.read("s1") == record(), "tier and segment are not journaled"
    journal.write(record(num_tokens=9, data='{"turns": [3, 9]}'))
    assert journal.read("s1") == record(num_tokens=9, data='{"turns": [3, 9]}')
    assert sorted(p.name for p in (tmp_path / "sessions").iterdir()) == ["s1.json"]
    assert journal.delete("s1") and not journal.delete("s1")
    assert journal.read("s1") is None


@pytest.mark.parametrize(
    "text",
    ["{", "[]", '{"format_version": 2}', '{"format_version": 1, "session_id": "s1"}'],
    ids=["truncated", "list", "future-version", "missing-fields"],
)
def test_corrupt_record_is_reported_and_skipped_by_scan(tmp_path, text) -> None:
    journal = SessionJournal(tmp_path)
    journal.write(record("good"))
    (tmp_path / "sessions" / "s1.json").write_text(text)
    with pytest.raises(CorruptRecord, match="s1.json"):
        journal.read("s1")
    assert [r.session_id for r in journal.scan()] == ["good"]


def test_renamed_record_is_corrupt(tmp_path) -> None:
    journal = SessionJournal(tmp_path)
    journal.write(record("s1"))
    (tmp_path / "sessions" / "s1.json").rename(tmp_path / "sessions" / "s2.json")
    with pytest.raises(CorruptRecord, match="renamed"):
        journal.read("s2")


def test_scan_ignores_temp_files(tmp_path) -> None:
    journal = SessionJournal(tmp_path)
    for name in ("b", "a"):
        journal.write(record(name))
    (tmp_path / "sessions" / ".c.json.123.tmp").write_text("{")
    (tmp_path / "sessions" / ".c.json").write_text("{")
    assert [r.session_id for r in journal.scan()] == ["a", "b"]


def test_failed_write_keeps_previous_record(tmp_path, monkeypatch) -> None:
    journal = SessionJournal(tmp_path)
    journal.write(record(num_tokens=7))

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(StorageUnavailable, match="cannot write"):
        journal.write(record(num_tokens=9))
    monkeypatch.undo()
    assert journal.read("s1") == record(num_tokens=7)
    assert [p.name for p in (tmp_path / "sessions").iterdir()] == ["s1.json"]
