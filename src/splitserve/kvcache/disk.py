"""L2 ``tieredstorage``: one file per KV record in a directory, bounded in bytes, least recently used evicted.

Each record is written to a temporary file and renamed into place, so a reader (in this process or another
worker sharing the directory) sees a whole record or none. The index (key -> size, in recency order) lives in
memory and is rebuilt from the directory on start, oldest modification time first. File names are the
percent-encoded key plus ``.kv``, so the key can be read back from the name.

On a local file system a read maps the record's file (private, copy-on-write, its descriptor closed at once):
the value is a view of the page cache, not a copy in fresh memory. Files are only ever replaced by a rename or
unlinked, never truncated, so a mapping stays whole after another worker evicts or rewrites its record; an
evicted file's blocks are freed once the last view of it (an L1 entry, say) goes. On a network file system
(NFS, SMB, FUSE mounts) a file removed by another host can vanish under a mapping, so records are read into
memory there.

Several workers may share one directory (L2 across workers on one machine or a shared mount): a key missing
from this process's index is looked up on the file system and adopted, and a file that vanished (evicted by
another worker) is a plain miss. Each process enforces the byte budget over the records it knows.

A directory that cannot be created, listed or written (a path under a regular file, a read-only mount) does
not stop the worker: the tier starts *unavailable* (every read a miss, every write dropped and counted as an
error) and tries again on a write at most every ``REOPEN_INTERVAL_S``, so a directory that becomes usable later
(created, mounted, made writable) is picked up, its records indexed, without a restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import quote, unquote

import torch

from splitserve.kvcache.tiers import ErrorBurstLog, EvictionListener, KVValue, TierStats

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
MAX_FILE_NAME_BYTES = 255
STALE_TMP_S = 600.0  # temporaries older than this are leftovers of a crash
REOPEN_INTERVAL_S = 5.0  # an unavailable directory is tried again on a write at most this often


class DiskTier:
    """A directory of KV records with a byte budget.

    Invariant: ``_stored_bytes == sum(_index.values()) <= max_bytes``; ``_index`` is ordered least recently
    used first. I/O failures (a full disk, a vanished or truncated file) are counted as errors and logged once
    per burst; a read failure is a miss and a write failure drops the value. Nothing is raised to the caller,
    not even from the constructor: a directory that cannot be used leaves the tier unavailable (see the
    module docstring and ``is_available``).

    Args:
        path: the directory (created if missing). Temporary files left by a crash are removed.
        max_bytes: the budget for record bytes (file system overhead not counted).
        fsync: flush each record to stable storage before renaming it (slower; survives power loss).
        on_evict: called with each key evicted to make room.
        clock: seconds, monotonic; paces the retries of an unavailable directory.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int,
        *,
        fsync: bool = False,
        on_evict: EvictionListener | None = None,
        name: str = "disk",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.name = name
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._stored_bytes = 0
        self._stats = TierStats()
        self._errors = ErrorBurstLog(logger, f"disk KV tier {self.path}")
        self._clock = clock
        self._open_lock = threading.Lock()
        self._maps = _is_local(self.path)
        self._is_open = False
        self._next_open_s = 0.0
        self._open_error: OSError | None = None
        if (error := self._open()) is not None:
            self._count_error("open", error)

    @property
    def is_available(self) -> bool:
        """Whether the directory is in use; False until it could be created, written and listed."""
        return self._is_open

    # -- the tier contract ------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[KVValue | None]:
        if not self._is_open:
            with self._lock:
                self._stats.num_misses += len(keys)
            return [None] * len(keys)
        return [self._get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not self._is_open:
            return [False] * len(keys)
        with self._lock:
            return [key in self._index or self._adopt(key) is not None for key in keys]

    def put(self, key: str, value: KVValue) -> None:
        if len(value) > self.max_bytes:
            with self._lock:
                self._stats.num_skipped += 1
            return
        if (error := self._open()) is not None:
            self._count_error("write", error)
            return
        try:
            final = self._file_path(key)
            tmp = self._write_tmp(value)
        except (OSError, ValueError) as exc:
            self._count_error("write", exc)
            return
        try:
            with self._lock:
                os.replace(tmp, final)
                self._forget(key)
                evicted = self._evict_for(len(value))
                self._index[key] = len(value)
                self._stored_bytes += len(value)
                self._stats.num_puts += 1
                self._stats.written_bytes += len(value)
        except OSError as exc:
            _unlink_quietly(tmp)
            self._count_error("rename", exc)
            return
        self._errors.success()
        self._notify(evicted)

    def delete(self, key: str) -> None:
        with self._lock:
            if self._forget(key):
                self._unlink(key)

    def stats(self) -> TierStats:
        with self._lock:
            stats = self._stats.snapshot()
            stats.stored_bytes, stats.num_entries = self._stored_bytes, len(self._index)
        return stats

    def close(self) -> None:
        """Nothing to release: every record is already a complete file."""

    # -- reading ----------------------------------------------------------------------------------------

    def _get(self, key: str) -> KVValue | None:
        with self._lock:
            size = self._index.get(key)
            if size is None and (size := self._adopt(key)) is None:
                self._stats.num_misses += 1
                return None
            self._index.move_to_end(key)
        try:
            path = self._file_path(key)
            value = _map(path) if self._maps else path.read_bytes()
        except FileNotFoundError:  # evicted by another worker sharing the directory
            self._drop_bad(key, None)
            return None
        except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: torch could not map the file
            self._drop_bad(key, ("read", exc))
            return None
        if len(value) != size:
            self._drop_bad(key, ("read", OSError(f"{key}: file has {len(value)} bytes, expected {size}")))
            return None
        with self._lock:
            self._stats.num_hits += 1
        self._errors.success()
        return value

    def _drop_bad(self, key: str, error: tuple[str, BaseException] | None) -> None:
        """A file that cannot be served: count a miss (and the error, if any), forget it, remove what is left."""
        with self._lock:
            self._stats.num_misses += 1
            if self._forget(key):
                self._unlink(key)
        if error is not None:
            self._count_error(*error)

    def _adopt(self, key: str) -> int | None:
        """Index a record another process wrote (lock held); returns its size, or None if there is none.

        The budget is enforced at the next ``put``, so a read never deletes files.
        """
        try:
            size = self._file_path(key).stat().st_size
        except (OSError, ValueError):
            return None
        if size > self.max_bytes:
            return None
        self._index[key] = size
        self._stored_bytes += size
        return size

    # -- writing and eviction (callers hold the lock where noted) ---------------------------------------

    def _write_tmp(self, value: KVValue) -> Path:
        tmp = self.path / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError:
            _unlink_quietly(tmp)
            raise
        return tmp

    def _forget(self, key: str) -> bool:
        """Drop a key from the index (lock held); True if it was there."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._stored_bytes -= size
        return True

    def _evict_for(self, num_bytes: int) -> list[str]:
        """Remove least recently used records until ``num_bytes`` more fit (lock held); returns their keys."""
        evicted: list[str] = []
        while self._index and self._stored_bytes + num_bytes > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._stored_bytes -= size
            self._stats.num_evictions += 1
            self._unlink(key)
            evicted.append(key)
        return evicted

    def _unlink(self, key: str) -> None:
        """Remove a record's file (lock held); a file already gone is fine, other failures are counted."""
        try:
            self._file_path(key).unlink(missing_ok=True)
        except OSError as exc:
            self._stats.num_errors += 1
            self._errors.error("unlink", exc)

    def _count_error(self, action: str, exc: BaseException) -> None:
        with self._lock:
            self._stats.num_errors += 1
        self._errors.error(action, exc)

    def _notify(self, evicted: list[str]) -> None:
        if self._on_evict is not None:
            for key in evicted:
                self._on_evict(key)

    # -- names and start-up -----------------------------------------------------------------------------

    def _open(self) -> OSError | None:
        """Make the directory usable: create it, check that it takes a file, index it.

        Returns None once the tier is open, else the error of the last attempt. An attempt is made at most
        every ``REOPEN_INTERVAL_S``; in between, the last error is returned without touching the file system.
        """
        if self._is_open:
            return None
        with self._open_lock:
            if self._is_open or self._clock() < self._next_open_s:
                return self._open_error
            self._next_open_s = self._clock() + REOPEN_INTERVAL_S
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                _unlink_quietly(self._write_tmp(b""))  # a read-only mount fails here, even for root
                self._rebuild_index()
            except OSError as exc:
                self._open_error = exc
                return exc
            self._is_open, self._open_error = True, None
        self._errors.success()
        return None

    def _file_path(self, key: str) -> Path:
        name = quote(key, safe="") + RECORD_SUFFIX
        if len(name.encode()) > MAX_FILE_NAME_BYTES:
            raise ValueError(f"key too long for a file name ({len(name)} bytes encoded): {key[:80]}...")
        return self.path / name

    def _rebuild_index(self) -> None:
        """Index the records already in the directory, oldest modification first; drop temporaries."""
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        with os.scandir(self.path) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:  # renamed or evicted by another worker since the listing
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if st.st_mtime < time.time() - STALE_TMP_S:  # not another worker's live write
                        _unlink_quietly(Path(entry.path))
                elif entry.name.endswith(RECORD_SUFFIX) and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, unquote(entry.name[: -len(RECORD_SUFFIX)]), st.st_size))
        with self._lock:
            self._index.clear()
            self._stored_bytes = 0
            for _, key, size in sorted(found):
                self._index[key] = size
                self._stored_bytes += size
            self._evict_for(0)
        logger.info("disk KV tier %s: %d records, %d bytes", self.path, len(self._index), self._stored_bytes)


NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs")


def _is_local(path: Path) -> bool:
    """Whether ``path`` (or the closest existing directory above it) is on a local file system: not a network
    one, nor a FUSE mount (``/proc/mounts``; True where it cannot be read)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return True
    target = path.resolve()
    best, fs_type = -1, ""
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == Path(point) or Path(point) in target.parents) and len(point) > best:
            best, fs_type = len(point), fields[2]
    return not (fs_type in NETWORK_FILE_SYSTEMS or fs_type.startswith("fuse"))


def _map(path: Path) -> memoryview:
    """The file's bytes as a private, copy-on-write mapping whose descriptor is closed (``torch.from_file``;
    ``mmap.mmap`` would keep one open per mapping). Never written: writable only so that tensors can be made over
    it without a copy. ValueError for an empty file."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path.name} is empty")
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    return memoryview(mapped.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
