"""Defaults of the HTTP front end, importable without FastAPI (the CLI shows them in its
help without loading the server)."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_REQUEST_BYTES"]

#: the default body cap, 4 MiB: room for a whole 128k-token context in any JSON form (token
#: ids take about 7 bytes each, text escaped as \uXXXX 6 bytes a character), while what one
#: request can make the server buffer and parse stays a few megabytes (docs/serving.md,
#: "Request body cap")
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
