"""Disk tier: one safetensors file per segment, self-describing and written atomically.

Layout: ``<root>/<session_id>/<segment_id>.safetensors``. Both ids pass `check_id` before they
touch a path, so client strings are never joined into paths raw. Give the store a directory of
its own (the intended data directory is ``<data>/segments`` beside the journal's
``<data>/sessions``): every sub-directory of ``root`` is taken to be a session.

Why one file per segment: a spill or a resume is one sequential write or read, deleting a
session is one directory, a torn write can only lose the segment being written, and each file
carries its own header (the `SegmentMeta` as JSON in the safetensors ``__metadata__``, plus a
format version), so `scan` can rebuild the index from the directory alone. safetensors gives a
zero-copy, pickle-free container that other tools can open. Files are written with the atomic
protocol of ``_fs.atomic_write`` (temp file in the same directory, fsync, rename, fsync dir).

Reads validate before returning (`CorruptSegment` otherwise): format version, header schema, the
expected model fingerprint, that the file sits where its header says, tensor names, shapes and
dtypes against the header's layout, and the token ids against the header's sha256. OS failures
(unwritable directory, disk full, missing file) surface as `StorageUnavailable`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import safetensors.torch
from safetensors import SafetensorError, safe_open

from ._fs import atomic_write, check_id, ensure_dir, fsync_dir, remove_temp_files
from .errors import CorruptSegment, StorageUnavailable
from .segment import Segment, SegmentMeta

__all__ = ["FORMAT_VERSION", "DiskStore"]

FORMAT_VERSION = "1"
_FORMAT_KEY = "phloem.format_version"
_META_KEY = "phloem.segment_meta"
_SUFFIX = ".safetensors"
logger = logging.getLogger(__name__)


def _as_os_error(error: SafetensorError, path: Path) -> OSError:
    # The Rust writer reports I/O failures as SafetensorError("... (os error N) ..."); recover
    # N so callers see the usual OSError subclass (PermissionError, ...), EIO when absent.
    found = re.search(r"\(os error (\d+)\)", str(error))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, f"{os.strerror(code)} (safetensors: {error})", str(path))


class DiskStore:
    """Segments as safetensors files under ``root``.

    Args:
        root: Data directory; created if missing.

    Raises:
        StorageUnavailable: ``root`` cannot be created.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        ensure_dir(self.root)

    def path_for(self, session_id: str, segment_id: str) -> Path:
        """The file of a segment.

        Raises:
            ValueError: an id is not 1-128 characters of ``[A-Za-z0-9_-]``.
        """
        session_dir = self.root / check_id(session_id, "session_id")
        return session_dir / f"{check_id(segment_id, 'segment_id')}{_SUFFIX}"

    def exists(self, session_id: str, segment_id: str) -> bool:
        """Whether the segment's file exists."""
        return self.path_for(session_id, segment_id).is_file()

    def write(self, segment: Segment) -> Path:
        """Write (or atomically replace) the segment's file and return its path.

        Raises:
            ValueError: the segment's tensors disagree with its header.
            StorageUnavailable: the file could not be written; no partial file is left and a
                previous version of the file, if any, is untouched.
        """
        problems = segment.problems()
        if problems:
            raise ValueError("refusing to write an inconsistent segment: " + "; ".join(problems))
        meta = segment.meta
        path = self.path_for(meta.session_id, meta.segment_id)
        created_dir = ensure_dir(path.parent)
        header = {_FORMAT_KEY: FORMAT_VERSION, _META_KEY: meta.to_json()}
        tensors = {name: t.contiguous() for name, t in segment.tensors.items()}

        def write_tmp(tmp: Path) -> None:
            try:
                safetensors.torch.save_file(tensors, tmp, metadata=header)
            except SafetensorError as e:
                raise _as_os_error(e, tmp) from e

        try:
            atomic_write(path, write_tmp)
        except StorageUnavailable:
            if created_dir:
                with suppress(OSError):
                    path.parent.rmdir()
            raise
        return path

    def read(self, session_id: str, segment_id: str, *, expect_fingerprint: str | None) -> Segment:
        """Load and validate a segment.

        Args:
            session_id: Owning session.
            segment_id: The segment.
            expect_fingerprint: The running model's fingerprint; ``None`` skips that check only.

        Raises:
            ValueError: an id is not filesystem-safe.
            CorruptSegment: the file fails validation (the message says how).
            StorageUnavailable: the file is missing or cannot be read.
        """
        path = self.path_for(session_id, segment_id)
        return self.read_path(path, expect_fingerprint=expect_fingerprint)

    def read_path(self, path: Path | str, *, expect_fingerprint: str | None) -> Segment:
        """Load and validate the segment file at ``path`` (which must lie under ``root``).

        Raises:
            ValueError: ``path`` is not a segment path under ``root``.
            CorruptSegment: the file fails validation (the message says how).
            StorageUnavailable: the file is missing or cannot be read.
        """
        path = self._check_path(path)
        try:
            with safe_open(path, framework="pt") as f:
                meta = self._parse_header(path, f.metadata())
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except OSError as e:
            raise StorageUnavailable(f"cannot read segment {path}: {e}") from e
        except SafetensorError as e:
            raise CorruptSegment(f"{path} is not a valid safetensors file: {e}") from e
        if expect_fingerprint is not None and meta.model_fingerprint != expect_fingerprint:
            raise CorruptSegment(
                f"{path} holds state of model {meta.model_fingerprint!r}, "
                f"expected model {expect_fingerprint!r}"
            )
        segment = Segment(meta, tensors)
        problems = segment.problems()
        if problems:
            raise CorruptSegment(f"{path} disagrees with its header: " + "; ".join(problems))
        return segment

    def read_meta(self, session_id: str, segment_id: str) -> SegmentMeta:
        """Read only the header of a segment (no tensor data).

        Raises:
            CorruptSegment: the header is missing or invalid.
            StorageUnavailable: the file is missing or cannot be read.
        """
        return self._read_header(self.path_for(session_id, segment_id))

    def scan(self) -> Iterator[SegmentMeta]:
        """Yield the header of every segment file, reading headers only (for index rebuilds).

        Files that fail header validation are logged and skipped; temp files are ignored.
        """
        for session_dir in sorted(self._session_dirs()):
            for path in sorted(session_dir.glob(f"*{_SUFFIX}")):
                if path.name.startswith("."):
                    continue
                try:
                    yield self._read_header(path)
                except (CorruptSegment, StorageUnavailable) as e:
                    logger.warning("skipping unreadable segment during scan: %s", e)

    def delete(self, session_id: str, segment_id: str) -> bool:
        """Delete a segment file; return whether it existed. The session directory stays.

        Raises:
            StorageUnavailable: the file exists but cannot be removed.
        """
        path = self.path_for(session_id, segment_id)
        try:
            path.unlink()
            fsync_dir(path.parent)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StorageUnavailable(f"cannot delete {path}: {e}") from e
        return True

    def delete_session(self, session_id: str) -> int:
        """Delete every segment (and stray temp file) of a session; return how many segments.

        Raises:
            StorageUnavailable: a file cannot be removed.
        """
        session_dir = self.root / check_id(session_id, "session_id")
        if not session_dir.is_dir():
            return 0
        try:
            remove_temp_files(session_dir)
            paths = list(session_dir.glob(f"*{_SUFFIX}"))
            for path in paths:
                path.unlink()
            session_dir.rmdir()
            fsync_dir(self.root)
        except OSError as e:
            raise StorageUnavailable(f"cannot delete segments of {session_dir}: {e}") from e
        return len(paths)

    def remove_temp_files(self) -> int:
        """Delete temp files left by writers that crashed; return how many were removed."""
        return sum(remove_temp_files(d) for d in self._session_dirs())

    def _session_dirs(self) -> Iterator[Path]:
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                yield entry

    def _check_path(self, path: Path | str) -> Path:
        path = Path(path)
        root = self.root.resolve()
        resolved = path.resolve()
        if resolved.parent.parent != root or resolved.suffix != _SUFFIX:
            raise ValueError(f"{path} is not a segment file path under {self.root}")
        return self.path_for(resolved.parent.name, resolved.stem)

    def _read_header(self, path: Path) -> SegmentMeta:
        try:
            with safe_open(path, framework="pt") as f:
                return self._parse_header(path, f.metadata())
        except OSError as e:
            raise StorageUnavailable(f"cannot read segment {path}: {e}") from e
        except SafetensorError as e:
            raise CorruptSegment(f"{path} is not a valid safetensors file: {e}") from e

    def _parse_header(self, path: Path, header: dict[str, str] | None) -> SegmentMeta:
        header = header or {}
        version = header.get(_FORMAT_KEY)
        if version != FORMAT_VERSION:
            raise CorruptSegment(
                f"{path} has format version {version!r}, expected {FORMAT_VERSION!r}"
            )
        try:
            meta = SegmentMeta.from_json(header.get(_META_KEY, ""))
        except ValueError as e:
            raise CorruptSegment(f"{path} has an invalid segment header: {e}") from e
        if self.path_for(meta.session_id, meta.segment_id) != path:
            raise CorruptSegment(
                f"{path} has a header for session {meta.session_id!r} segment "
                f"{meta.segment_id!r}; the file was moved or renamed"
            )
        return meta
