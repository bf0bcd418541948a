"""Links between stages: in-memory, ZeroMQ and gRPC, with a shared codec and zstd framing.

The contract is in :mod:`transports.base`; :mod:`transports.testing` is the conformance kit
every transport's tests run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# NOTE: the names below load lazily (PEP 562), so importing one submodule, say
# ``transports.codec`` for the ``message`` decorator, does not pull in asyncio with the
# memory transport: the pure-logic modules of stages/ (scheduler, stop checker, step
# bookkeeping) import their message types through the codec and must stay free of asyncio.
if TYPE_CHECKING:
    from transports.base import LinkOptions, LinkStatistics, Receiver, Sender, Transport
    from transports.codec import DEFAULT_REGISTRY, Codec, MessageRegistry, message
    from transports.compression import Compression
    from transports.errors import (
        DecodeError,
        DecompressionError,
        EncodeError,
        EndOfStream,
        FieldTypeError,
        FrameTooLargeError,
        LinkClosedError,
        NestingTooDeepError,
        NotMsgpackError,
        PeerLostError,
        TransportError,
        TruncatedFrameError,
        UnknownTagError,
    )
    from transports.memory import MemoryChannel, MemoryTransport

_SOURCES = {
    **dict.fromkeys(("LinkOptions", "LinkStatistics", "Receiver", "Sender", "Transport"), "base"),
    **dict.fromkeys(("DEFAULT_REGISTRY", "Codec", "MessageRegistry", "message"), "codec"),
    "Compression": "compression",
    **dict.fromkeys(("MemoryChannel", "MemoryTransport"), "memory"),
}


def __getattr__(name: str) -> Any:
    if name in _SOURCES:
        module = _SOURCES[name]
    elif name in __all__:
        module = "errors"
    else:
        raise AttributeError(f"module 'transports' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"transports.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_REGISTRY",
    "Codec",
    "Compression",
    "DecodeError",
    "DecompressionError",
    "EncodeError",
    "EndOfStream",
    "FieldTypeError",
    "FrameTooLargeError",
    "LinkClosedError",
    "LinkOptions",
    "LinkStatistics",
    "MemoryChannel",
    "MemoryTransport",
    "MessageRegistry",
    "NestingTooDeepError",
    "NotMsgpackError",
    "PeerLostError",
    "Receiver",
    "Sender",
    "Transport",
    "TransportError",
    "TruncatedFrameError",
    "UnknownTagError",
    "message",
]
