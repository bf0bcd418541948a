r"""The servers of ``actorline serve``, two front ends over one engine: the gRPC
``actorline.v1.Generation`` service (``generation.proto``) with the wire conversions the
Python client (:mod:`pipeline.server.client`) shares with it, and the OpenAI-compatible HTTP
API (:mod:`pipeline.server.http`).

Modules: ``generation.proto`` and its generated ``generation_pb2``/``generation_pb2_grpc``
stubs; :mod:`~pipeline.server.auth` (API keys → engine tenants and limits, for both front
ends); :mod:`~pipeline.server.tls` (TLS files, for both); :mod:`~pipeline.server.listen`
(addresses); :mod:`~pipeline.server.convert` (protobuf ↔ Python);
:mod:`~pipeline.server.status` (errors ↔ gRPC status codes); :mod:`~pipeline.server.grpc_service`
(the servicer); :mod:`~pipeline.server.serve` (the gRPC server with health and reflection,
and ``serve``, which runs the front ends); :mod:`pipeline.server.http` (the HTTP API).

The generated stubs are committed. After editing ``generation.proto``, regenerate them from
the repository root with::

    python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
        pipeline/server/generation.proto

(tests/pipeline/server/test_generation_proto.py fails while they are stale).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SERVICE_NAME",
    "ApiKeys",
    "AuthenticationError",
    "GenerationServer",
    "GenerationService",
    "HttpServer",
    "PermissionDeniedError",
    "ServerTLS",
    "ServiceError",
    "ServiceUnavailableError",
    "serve",
]

# name -> module defining it; imported on first access, so the client does not pull in the
# server (and the server modules load only when used)
_LAZY = {
    "SERVICE_NAME": "pipeline.server.serve",
    "ApiKeys": "pipeline.server.auth",
    "AuthenticationError": "pipeline.server.auth",
    "GenerationServer": "pipeline.server.serve",
    "GenerationService": "pipeline.server.grpc_service",
    "HttpServer": "pipeline.server.http.server",
    "PermissionDeniedError": "pipeline.server.auth",
    "ServerTLS": "pipeline.server.tls",
    "ServiceError": "pipeline.server.status",
    "ServiceUnavailableError": "pipeline.server.status",
    "serve": "pipeline.server.serve",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
