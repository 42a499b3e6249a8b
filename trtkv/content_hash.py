"""Content hashes of weight files, computed once per machine.

``sha256_file(path)`` is the sha256 hex digest of the file's bytes (exactly ``hashlib.sha256``), remembered under
``<cache>/hashes/<sha256 of the key>.json`` where the cache is ``$TRTKV_CACHE`` (default ``~/.cache/trtkv``) and the
key is the resolved path, the size and ``st_mtime_ns``. A file whose size or mtime changed is hashed again; an entry
that does not parse or does not match its key is ignored and rewritten. Entries are written to a temporary file and
``os.replace``d, so concurrent processes never see half an entry. Deleting ``<cache>/hashes`` clears the cache.

Hashing a file larger than ``PROGRESS_BYTES`` prints progress on stderr (name, GiB done / total, MB/s) about every
``PROGRESS_SECONDS``; small files and cache hits print nothing.

``file_memo(path, kind, compute)`` remembers any JSON value computed from a file the same way, under ``<cache>/<kind>``
(a GGUF's parsed header: gguf's reader takes seconds per process).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

PROGRESS_BYTES = 256 << 20
PROGRESS_SECONDS = 2.0
_CHUNK = 1 << 22
_ENTRY_VERSION = 1


def hash_cache_dir() -> Path:
    """Where the hash entries live: ``<$TRTKV_CACHE or ~/.cache/trtkv>/hashes``."""
    from trtkv.cache_dir import cache_root

    return cache_root() / "hashes"


def _key(path: Path, size: int, mtime_ns: int) -> dict:
    return {"v": _ENTRY_VERSION, "path": str(path), "size": size, "mtime_ns": mtime_ns}


def _entry_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json"


def _read_entry(entry: Path, key: dict) -> dict | None:
    """The entry's JSON when it parses and carries ``key``; else None (it is then recomputed and rewritten)."""
    try:
        data = json.loads(entry.read_text())
        return data if isinstance(data, dict) and {k: data.get(k) for k in key} == key else None
    except (OSError, ValueError):
        return None


def _valid_digest(data: dict | None) -> str | None:
    digest = (data or {}).get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    try:
        int(digest, 16)
    except ValueError:
        return None
    return digest


def _write_entry(entry: Path, key: dict, payload: dict) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**key, **payload}, f)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:  # a read-only cache costs a re-hash next time, not the command
        pass


def _hash(path: Path, size: int) -> str:
    h = hashlib.sha256()
    show = size > PROGRESS_BYTES
    start = last = time.monotonic()
    done = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
            done += len(chunk)
            now = time.monotonic()
            if show and (now - last >= PROGRESS_SECONDS or done == size):
                last = now
                rate = done / max(now - start, 1e-9) / 1e6
                print(f"hashing {path.name}: {done / 2**30:.1f}/{size / 2**30:.1f} GiB, {rate:.0f} MB/s",
                      file=sys.stderr, flush=True)
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _sha256_cached(path: str, size: int, mtime_ns: int, cache: str) -> str:
    key = _key(Path(path), size, mtime_ns)
    entry = Path(cache) / _entry_name(key)
    digest = _valid_digest(_read_entry(entry, key))
    if digest is None:
        digest = _hash(Path(path), size)
        _write_entry(entry, key, {"sha256": digest})
    return digest


def sha256_file(path: str | Path) -> str:
    """The sha256 hex digest of ``path``'s bytes, read from the per-machine cache when the file is unchanged."""
    p = Path(path).resolve()
    st = p.stat()
    return _sha256_cached(str(p), st.st_size, st.st_mtime_ns, str(hash_cache_dir()))


@functools.lru_cache(maxsize=64)
def _memo_cached(path: str, size: int, mtime_ns: int, directory: str, compute: Callable[[Path], Any]) -> Any:
    key = _key(Path(path), size, mtime_ns)
    entry = Path(directory) / _entry_name(key)
    data = _read_entry(entry, key)
    if data is not None and "value" in data:
        return data["value"]
    value = json.loads(json.dumps(compute(Path(path))))  # the same types a later process reads back
    _write_entry(entry, key, {"value": value})
    return value


def file_memo(path: str | Path, kind: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(path)``, a JSON-serializable value read from the file (a GGUF's metadata: seconds to parse), remembered per
    machine like the digests (under ``<cache>/<kind>``, keyed by path, size and mtime) and per process. Callers must
    not change the returned value."""
    from trtkv.cache_dir import cache_root

    p = Path(path).resolve()
    st = p.stat()
    return _memo_cached(str(p), st.st_size, st.st_mtime_ns, str(cache_root() / kind), compute)


__all__ = ["sha256_file", "hash_cache_dir", "file_memo", "PROGRESS_BYTES"]
