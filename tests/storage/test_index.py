"""The session index: one suite run against SQLite and a real Redis, plus backend specifics."""

from __future__ import annotations

import secrets
import socket
import sqlite3
import threading
from contextlib import closing
from dataclasses import replace

import pytest

from phloem.storage import (
    DiskStore,
    IndexUnavailable,
    RebuildReport,
    RedisIndex,
    SessionJournal,
    SessionRecord,
    SQLiteIndex,
)


UNICODE_DATA = '{"turns": [12, 42], "note": "h\u00e9 \U0001f600"}'


def record(session_id: str = "s1", owner: str = "key-1", **changes) -> SessionRecord:
    fields = dict(session_id=session_id, owner=owner, model_fingerprint="m-1", num_tokens=42,
                  last_used=1_700_000_000.1 + 1e-6, data=UNICODE_DATA)
    fields.update(changes)
    return SessionRecord(**fields)


def test_put_get_round_trip(index) -> None:
    rec = record(tier="disk", segment_id="g-1")
    index.put_session(rec)
    assert index.get_session("s1") == rec
    assert index.get_session("missing") is None
    bare = record("s2", data="", last_used=0.0, num_tokens=0)
    index.put_session(bare)
    assert index.get_session("s2") == bare


def test_put_replaces(index) -> None:
    index.put_session(record(tier="host", segment_id="g-1"))
    index.put_session(record(num_tokens=50))
    assert index.get_session("s1") == record(num_tokens=50)


def test_delete(index) -> None:
    index.put_session(record("s1"))
    index.put_session(record("s2"))
    assert index.delete_session("s1") and not index.delete_session("s1")
    assert [r.session_id for r in index.list_sessions()] == ["s2"]
    assert index.list_sessions(owner="key-1") == [record("s2")]


def test_list_by_owner_in_id_order(index) -> None:
    pairs = [("c", "alice"), ("a", "bob"), ("b", "alice"), ("d", "owner:with:colons")]
    for session_id, owner in pairs:
        index.put_session(record(session_id, owner))
    assert [r.session_id for r in index.list_sessions()] == ["a", "b", "c", "d"]
    assert [r.session_id for r in index.list_sessions(owner="alice")] == ["b", "c"]
    assert [r.session_id for r in index.list_sessions(owner="owner:with:colons")] == ["d"]
    assert index.list_sessions(owner="nobody") == []
    index.put_session(record("b", "bob"))
    assert [r.session_id for r in index.list_sessions(owner="alice")] == ["c"]
    assert [r.session_id for r in index.list_sessions(owner="bob")] == ["a", "b"]


def test_set_tier(index) -> None:
    index.put_session(record())
    assert index.set_tier("s1", "host", segment_id="g-1")
    assert index.get_session("s1") == record(tier="host", segment_id="g-1")
    assert index.set_tier("s1", "disk", segment_id="g-1")
    assert index.set_tier("s1", "gpu")
    assert index.get_session("s1") == record(tier="gpu")
    assert not index.set_tier("missing", "none")
    assert index.get_session("missing") is None, "set_tier must not create sessions"


@pytest.mark.parametrize(
    ("tier", "segment_id", "message"),
    [("tape", None, "tier must be"), ("disk", None, "segment_id"), ("gpu", "g-1", "has no segment"),
     ("host", "../x", "segment_id")],
    ids=["unknown-tier", "disk-without-segment", "gpu-with-segment", "unsafe-segment-id"],
)
def test_set_tier_rejects_bad_arguments(index, tier, segment_id, message) -> None:
    index.put_session(record())
    with pytest.raises(ValueError, match=message):
        index.set_tier("s1", tier, segment_id=segment_id)
    assert index.get_session("s1") == record()


def test_health_and_clear(index) -> None:
    assert index.health()
    for i in range(3):
        index.put_session(record(f"s{i}", owner=f"o{i}"))
    index.clear()
    assert index.list_sessions() == [] and index.list_sessions(owner="o1") == []
    assert index.get_session("s1") is None


def test_concurrent_threads(index) -> None:
    def work(worker: int) -> None:
        for i in range(25):
            session_id = f"w{worker}-{i}"
            index.put_session(record(session_id, owner=f"o{worker}"))
            assert index.get_session(session_id) is not None
            index.set_tier(session_id, "host", segment_id="g")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = index.list_sessions()
    assert len(records) == 150 and {r.tier for r in records} == {"host"}
    assert len(index.list_sessions(owner="o3")) == 25


def test_rebuild_from_disk_and_journal(index, tmp_path, make_segment) -> None:
    disk, journal = DiskStore(tmp_path / "segments"), SessionJournal(tmp_path)
    fp = make_segment().meta.model_fingerprint
    sessions = {
        "on-disk": record("on-disk", model_fingerprint=fp),
        "recompute": record("recompute", model_fingerprint=fp, owner="key-2"),
        "old-model": record("old-model", model_fingerprint=fp),
    }
    for rec in sessions.values():
        journal.write(rec)
    disk.write(make_segment("on-disk", "old", created_at=100.0))
    disk.write(make_segment("on-disk", "new", created_at=200.0, seed=1))
    disk.write(make_segment("old-model", "g", fingerprint="previous-model"))
    disk.write(make_segment("orphan", "g"))
    index.put_session(replace(sessions["on-disk"], tier="host", segment_id="stale"))
    index.put_session(replace(sessions["recompute"], tier="gpu"))
    index.put_session(record("not-journaled"))

    index.clear()
    report = index.rebuild_from(disk, journal)

    assert report == RebuildReport(num_sessions=3, num_on_disk=1, num_orphan_segments=1)
    assert index.list_sessions() == [
        sessions["old-model"],
        replace(sessions["on-disk"], tier="disk", segment_id="new"),
        sessions["recompute"],
    ]
    assert index.list_sessions(owner="key-2") == [sessions["recompute"]]
    assert index.rebuild_from(disk, journal) == report, "rebuilding twice gives the same index"


def test_sqlite_persists_and_uses_wal(tmp_path) -> None:
    path = tmp_path / "index.sqlite"
    first = SQLiteIndex(path)
    first.put_session(record())
    first.close()
    assert not first.health(), "a closed index is unhealthy"
    second = SQLiteIndex(path)
    assert second.get_session("s1") == record()
    second.close()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_sqlite_unopenable_path(tmp_path) -> None:
    with pytest.raises(IndexUnavailable, match="cannot open SQLite index"):
        SQLiteIndex(tmp_path / "missing-dir" / "index.sqlite")


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_unreachable() -> None:
    url = f"redis://127.0.0.1:{_unused_port()}/0"
    index = RedisIndex(url, prefix="phloem-test:down:", timeout_s=0.5)
    assert index.health() is False
    calls = [
        lambda: index.put_session(record()),
        lambda: index.get_session("s1"),
        lambda: index.delete_session("s1"),
        lambda: index.list_sessions(),
        lambda: index.set_tier("s1", "none"),
        lambda: index.clear(),
    ]
    for call in calls:
        with pytest.raises(IndexUnavailable, match="Redis index at 127.0.0.1") as info:
            call()
        assert info.value.__cause__ is not None
    index.close()


def test_redis_clear_escapes_glob_characters_in_its_prefix(redis_server_url) -> None:
    base = f"phloem-test:{secrets.token_hex(8)}"
    index = RedisIndex(redis_server_url, prefix=f"{base}*")
    # Unescaped, the pattern "<base>**" would also match this neighbour's keys.
    neighbour = RedisIndex(redis_server_url, prefix=f"{base}Y:")
    try:
        neighbour.put_session(record("kept"))
        index.put_session(record("gone"))
        index.clear()
        assert index.list_sessions() == [] and index.get_session("gone") is None
        assert neighbour.list_sessions() == [record("kept")]
    finally:
        neighbour.clear()
        index.clear()
        neighbour.close()
        index.close()
