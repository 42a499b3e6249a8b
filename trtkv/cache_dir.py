"""The per-machine cache folder every cache lives under: converted models, dataset downloads, content hashes.

Its own module, importing nothing of trtkv, so that ``models``, ``data`` and ``content_hash`` share it without
importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TRTKV_CACHE``, default ``~/.cache/trtkv``."""
    return Path(os.environ.get("TRTKV_CACHE") or "~/.cache/trtkv").expanduser()
