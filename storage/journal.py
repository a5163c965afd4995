"""The session journal: each session's durable record as one JSON file, replaced atomically.

Layout: ``<root>/sessions/<session_id>.json`` (``root`` is the data directory; segments go to
``<root>/segments``, see ``disk.py``). The sessions layer writes a session's record at
every turn end (and on create, fork and delete), before it acknowledges the turn; the write is
fsynced (``_fs.atomic_write``), so an acknowledged turn survives a crash or power loss.

Why a journal beside the index: the index may be Redis (not durable by default, possibly shared
or wiped) and the index's tier columns describe state that a restart loses anyway. The journal
holds only durable facts (owner, model, token count, last use and the sessions layer's opaque
``data``); together with the self-describing segment files it is enough to rebuild any index
(`SessionIndex.rebuild_from`). One file per session keeps each write small and independent.
Records read back from the journal have ``tier='none'``: where state lives is the index's job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from ._fs import atomic_write, check_id, ensure_dir, fsync_dir
from .errors import CorruptRecord, StorageUnavailable
from .record import SessionRecord

__all__ = ["JOURNAL_FORMAT_VERSION", "SessionJournal"]

JOURNAL_FORMAT_VERSION = 1
_FIELDS = ("session_id", "owner", "model_fingerprint", "num_tokens", "last_used", "data")
logger = logging.getLogger(__name__)


class SessionJournal:
    """Session records as atomically replaced JSON files under ``root/sessions``.

    Args:
        root: Data directory (shared with `DiskStore`); ``sessions/`` is created if missing.

    Raises:
        StorageUnavailable: the directory cannot be created.
    """

    def __init__(self, root: Path | str) -> None:
        self.dir = Path(root) / "sessions"
        ensure_dir(self.dir)

    def path_for(self, session_id: str) -> Path:
        """The journal file of a session.

        Raises:
            ValueError: ``session_id`` is not 1-128 characters of ``[A-Za-z0-9_-]``.
        """
        return self.dir / f"{check_id(session_id, 'session_id')}.json"

    def write(self, record: SessionRecord) -> Path:
        """Durably create or replace the session's journal file and return its path.

        Raises:
            StorageUnavailable: the file could not be written; the previous version is intact.
        """
        body = {"format_version": JOURNAL_FORMAT_VERSION}
        body.update({name: getattr(record, name) for name in _FIELDS})
        payload = json.dumps(body, sort_keys=True).encode()
        path = self.path_for(record.session_id)

        def write_tmp(tmp: Path) -> None:
            with open(tmp, "xb") as f:
                f.write(payload)

        atomic_write(path, write_tmp)
        return path

    def read(self, session_id: str) -> SessionRecord | None:
        """The journaled record (with ``tier='none'``); ``None`` if the session has none.

        Raises:
            CorruptRecord: the file is not a valid journal record.
            StorageUnavailable: the file cannot be read.
        """
        path = self.path_for(session_id)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageUnavailable(f"cannot read {path}: {e}") from e
        return self._parse(path, text)

    def delete(self, session_id: str) -> bool:
        """Delete the session's journal file; return whether it existed.

        Raises:
            StorageUnavailable: the file exists but cannot be removed.
        """
        path = self.path_for(session_id)
        try:
            path.unlink()
            fsync_dir(self.dir)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StorageUnavailable(f"cannot delete {path}: {e}") from e
        return True

    def scan(self) -> Iterator[SessionRecord]:
        """Yield every journaled record, in id order; invalid files are logged and skipped."""
        for path in sorted(self.dir.glob("*.json")):
            if path.name.startswith("."):
                continue
            try:
                yield self._parse(path, path.read_text())
            except (CorruptRecord, OSError) as e:
                logger.warning("skipping unreadable session record during scan: %s", e)

    @staticmethod
    def _parse(path: Path, text: str) -> SessionRecord:
        try:
            raw = json.loads(text)
            version = raw.pop("format_version")
            if version != JOURNAL_FORMAT_VERSION:
                raise ValueError(f"format version {version!r}, expected {JOURNAL_FORMAT_VERSION}")
            if sorted(raw) != sorted(_FIELDS):
                raise ValueError(f"fields {sorted(raw)}, expected {sorted(_FIELDS)}")
            record = SessionRecord(**raw)
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
            raise CorruptRecord(f"{path} is not a valid session record: {e}") from e
        if path.stem != record.session_id:
            raise CorruptRecord(f"{path} holds session {record.session_id!r}; it was renamed")
        return record
