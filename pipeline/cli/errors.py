"""The CLI's one error type."""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """An error reported as one line on stderr with exit status 2 (bad input) or 1."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status
