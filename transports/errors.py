"""Errors raised by links, the codec and the framing layer.

Every error a peer can provoke by sending bad bytes is a :class:`DecodeError`; a receiving
link logs it with the peer's address, counts it in its statistics and goes on to the next
message. Nothing here is ever raised by unpickling: nothing from the wire is unpickled.
"""

from __future__ import annotations

__all__ = [
    "DecodeError",
    "DecompressionError",
    "EncodeError",
    "EndOfStream",
    "FieldTypeError",
    "FrameTooLargeError",
    "LinkClosedError",
    "NestingTooDeepError",
    "NotMsgpackError",
    "PeerLostError",
    "TransportError",
    "TruncatedFrameError",
    "UnknownTagError",
]


class TransportError(Exception):
    """Base class of every error raised by :mod:`transports`."""


class LinkClosedError(TransportError):
    """This end of the link was closed; it can no longer send or receive."""


class EndOfStream(TransportError):
    """The peer closed the link gracefully and every message it sent was delivered."""


class PeerLostError(TransportError):
    """The peer went away without closing: its process died, the connection broke, or it
    fell silent for longer than the heartbeat timeout. ``silent_for``: in that last case,
    the seconds it had been silent (None when the link broke)."""

    def __init__(self, message: str, *, silent_for: float | None = None) -> None:
        super().__init__(message)
        self.silent_for = silent_for


class EncodeError(TransportError):
    """A message could not be encoded (for example its type is not registered)."""


class DecodeError(TransportError):
    """Bytes received from a peer are not a valid message.

    ``peer`` names the sending side when the receiving link knows it.
    """

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} (from {self.peer})" if self.peer else text


class NotMsgpackError(DecodeError):
    """The payload is not valid msgpack, or not a registered message at its top level."""


class TruncatedFrameError(DecodeError):
    """A frame is shorter than its header declares, or frames are missing."""


class NestingTooDeepError(DecodeError):
    """Messages are nested inside each other deeper than the codec allows."""


class UnknownTagError(DecodeError):
    """The payload names a message type tag that is not registered."""


class FieldTypeError(DecodeError):
    """A field of a registered message has a value of the wrong type."""


class DecompressionError(DecodeError):
    """A frame flagged as zstd-compressed does not decompress."""


class FrameTooLargeError(DecodeError):
    """A frame (or its decompressed content) exceeds the link's size limit."""
