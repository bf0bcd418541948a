"""Pieces shared by the byte transports (:mod:`transports.zmq`, :mod:`transports.grpc`).

Both hand every set of frames they receive to one :class:`InboundFrames` per link. It
decodes them, remembers the peer's name from its HELLO, counts what arrives, and turns a
frame that does not decode into a logged warning and a counter increment instead of an
exception: a peer can send anything, and one bad frame must not take a link down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from transports.base import Transport
from transports.codec import Buffer
from transports.errors import DecodeError
from transports.framing import FrameCodec, FrameKind

__all__ = ["InboundFrames", "SilenceWatchdog", "cancel_requested", "link_frame_codec"]


def link_frame_codec(transport: Transport) -> FrameCodec:
    """A FrameCodec for one link of ``transport`` (its codec, compression and size limit)."""
    options = transport.options
    return FrameCodec(
        transport.codec, options.compression, max_frame_bytes=options.max_message_bytes
    )


def cancel_requested() -> bool:
    """Whether the current task itself is being cancelled, as opposed to a future it awaited
    having been cancelled (which is how a link interrupts a pending read or write)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    return bool(cancelling()) if cancelling is not None else False


class InboundFrames:
    """Decodes what one receiving link gets, keeping its counters and the peer's name.

    ``address``: the link's own address, used to name an unknown peer in logs.
    """

    def __init__(self, framer: FrameCodec, logger: logging.Logger, address: str) -> None:
        self.framer = framer
        self.logger = logger
        self.address = address
        #: the sender's name from its HELLO ("" until one arrives)
        self.peer_name = ""
        self.hello_received = False
        self.messages_received = 0
        self.bytes_received = 0
        self.decode_errors = 0
        self.codec_seconds = 0.0

    @property
    def peer(self) -> str:
        """How logs and errors name the sender."""
        if self.peer_name:
            return f"{self.peer_name!r} (to {self.address})"
        return f"an unnamed sender (to {self.address})"

    def accept(self, frames: Sequence[Buffer], nbytes: int) -> tuple[FrameKind, object] | None:
        """Decode one set of frames (``nbytes`` long on the wire).

        Returns ``(kind, message)`` (for HELLO the message is the peer's name, which is also
        recorded), or None when the frames do not decode: that is logged as a warning
        naming the peer and the error type, and counted in ``decode_errors``.
        """
        self.bytes_received += nbytes
        began = time.perf_counter()
        try:
            kind, message = self.framer.decode(frames)
        except DecodeError as exc:
            self.reject(exc)
            return None
        finally:
            self.codec_seconds += time.perf_counter() - began
        if kind is FrameKind.DATA:
            self.messages_received += 1
        elif kind is FrameKind.HELLO:
            self.hello_received = True
            self.peer_name = str(message)
        return kind, message

    def reject(self, error: DecodeError) -> None:
        """Log and count frames that could not be decoded."""
        error.peer = self.peer
        self.decode_errors += 1
        self.logger.warning(
            "dropped a frame from %s: %s: %s", self.peer, type(error).__name__, error.args[0]
        )


class SilenceWatchdog:
    """Detects a silent peer without a timeout around every read.

    The link sets :attr:`last_heard` (``time.monotonic()``) whenever anything arrives; one
    timer, rescheduled only when it fires, calls ``on_lost(silent_for)`` once nothing was
    heard for ``timeout`` seconds while ``silence_counts()`` is true. ``silence_counts`` says
    whether the link could have heard its peer: a link whose consumer is busy elsewhere, or
    that has messages waiting, proves nothing about the peer, and the wait starts over.
    """

    def __init__(
        self,
        timeout: float,
        silence_counts: Callable[[], bool],
        on_lost: Callable[[float], None],
    ) -> None:
        self.timeout = timeout
        self.last_heard = 0.0
        self._silence_counts = silence_counts
        self._on_lost = on_lost
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start watching (from now); a no-op when already watching."""
        if self._timer is None:
            self.last_heard = time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(self.timeout, self._check)

    def stop(self) -> None:
        """Stop watching (the link ended, was closed or is lost). Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        silent_for = now - self.last_heard
        if silent_for < self.timeout:
            self._timer = loop.call_later(self.timeout - silent_for, self._check)
        elif not self._silence_counts():
            self.last_heard = now
            self._timer = loop.call_later(self.timeout, self._check)
        else:
            self._timer = None
            self._on_lost(silent_for)
