"""The OpenAI-compatible HTTP API of ``actorline serve --http-port``: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (SSE streaming, ``n``, logprobs, usage),
``/health`` and ``/metrics``, over the same engine, API keys, TLS and metrics as the gRPC
front end. User docs: ``docs/serving.md``.

Modules, in the order a request meets them: :mod:`~pipeline.server.http.server` (uvicorn
over a started engine), :mod:`~pipeline.server.http.gate` (API key and body cap),
:mod:`~pipeline.server.http.app` (the routes), :mod:`~pipeline.server.http.schema` (the
request bodies), :mod:`~pipeline.server.http.requests` (bodies to prompts and
SamplingParams), :mod:`~pipeline.server.http.state` and
:mod:`~pipeline.server.http.choices` (the engine requests of one HTTP request),
:mod:`~pipeline.server.http.completions` and :mod:`~pipeline.server.http.chat` (the
answers), :mod:`~pipeline.server.http.answers`, :mod:`~pipeline.server.http.logprobs`,
:mod:`~pipeline.server.http.sse` (their shared parts) and
:mod:`~pipeline.server.http.errors` (OpenAI-style errors).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ApiError", "HttpServer", "HttpService", "create_app"]

# name -> module defining it; imported on first access (FastAPI loads only when used)
_LAZY = {
    "DEFAULT_MAX_REQUEST_BYTES": "pipeline.server.http.defaults",
    "ApiError": "pipeline.server.http.errors",
    "HttpServer": "pipeline.server.http.server",
    "HttpService": "pipeline.server.http.state",
    "create_app": "pipeline.server.http.app",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.server.http' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
