"""Defaults of the HTTP front end, importable without FastAPI (the CLI shows them in its
help without loading the server)."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_REQUEST_BYTES"]

#: the default body cap, 1 MiB (llama.cpp's server has the same): room for a 128k-token
#: context in the usual JSON forms (token ids take 6 or 7 bytes each, English text about 4
#: bytes a token, text escaped as \uXXXX 6 bytes a character), while what one body costs the
#: event loop to parse stays tens of milliseconds (docs/serving.md, "Request body cap")
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
