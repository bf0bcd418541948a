"""Environment variables, read here and nowhere else.

- ``ACTORLINE_CACHE_DIR``: where converted models are cached (default
  ``$XDG_CACHE_HOME/actorline`` or ``~/.cache/actorline``).
- ``ACTORLINE_LOG_LEVEL``: log level of the ``actorline`` loggers (default ``WARNING``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "log_level"]


def cache_dir() -> Path:
    """The actorline cache directory (not created here)."""
    explicit = os.environ.get("ACTORLINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actorline"


def log_level() -> str:
    return os.environ.get("ACTORLINE_LOG_LEVEL", "WARNING").upper()
