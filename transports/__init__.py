"""Links between stages: in-memory, ZeroMQ and gRPC, with a shared codec and zstd framing.

The contract is in :mod:`transports.base`; :mod:`transports.testing` is the conformance kit
every transport's tests run.
"""

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
    NotMsgpackError,
    PeerLostError,
    TransportError,
    TruncatedFrameError,
    UnknownTagError,
)
from transports.memory import MemoryChannel, MemoryTransport

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
