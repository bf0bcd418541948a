"""The ``actorline`` command line (``python -m pipeline.cli`` runs it too)."""

from __future__ import annotations

from pipeline.cli.main import main

__all__ = ["main"]
