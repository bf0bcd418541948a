"""Frames for byte transports (ZMQ, gRPC): one header frame, then out-of-band buffers.

Header frame layout (network byte order)::

    magic u8 (0xAC) | version u8 | kind u8 | flags u8 | payload_len u32 | n_buffers u16
    | buffer_flags u8 * n_buffers | payload

``kind`` is DATA (payload is a codec message), HELLO (payload is the sender's name, UTF-8),
HEARTBEAT or END (graceful close; no payload). Flag bit 0 marks a zstd-compressed payload or
buffer, so compression is decided frame by frame and small frames pay nothing.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from transports.codec import Buffer, Codec
from transports.compression import Compression, ZstdFrames
from transports.errors import (
    FrameTooLargeError,
    NotMsgpackError,
    TruncatedFrameError,
)

__all__ = ["FLAG_ZSTD", "FRAME_HEADER", "FRAME_MAGIC", "FRAME_VERSION", "FrameCodec", "FrameKind"]

#: the first byte of every frame
FRAME_MAGIC = 0xAC
#: the framing format version
FRAME_VERSION = 1
#: magic, version, kind, flags, payload length, buffer count
FRAME_HEADER = struct.Struct("!BBBBIH")
#: the flag of a zstd-compressed payload or buffer
FLAG_ZSTD = 1


class FrameKind(enum.IntEnum):
    DATA = 0
    HELLO = 1
    HEARTBEAT = 2
    END = 3


class FrameCodec:
    """Turns messages into frames and frames back into messages for one link.

    Not thread-safe (it holds a :class:`Codec`); each link owns one.
    """

    def __init__(
        self,
        codec: Codec | None = None,
        compression: Compression | None = None,
        *,
        max_frame_bytes: int = 1 << 30,
    ) -> None:
        self.codec = codec if codec is not None else Codec()
        self.compression = compression
        self.max_frame_bytes = max_frame_bytes
        self._zstd = ZstdFrames(compression, max_frame_bytes) if compression else None
        self.bytes_before_compression = 0
        self.bytes_after_compression = 0

    def encode(self, message: object) -> list[Buffer]:
        """Encode a message into ``[header_frame, *buffers]``. Raises EncodeError."""
        payload, buffers = self.codec.encode(message)
        flags = 0
        buffer_flags = bytearray(len(buffers))
        zstd = self._zstd
        if zstd is not None:
            threshold = zstd.compression.threshold
            if len(payload) >= threshold:
                compressed = zstd.compress(payload)
                self.bytes_before_compression += len(payload)
                self.bytes_after_compression += len(compressed)
                if len(compressed) < len(payload):
                    payload = compressed
                    flags |= FLAG_ZSTD
            if zstd.compression.compress_buffers:
                for index, buffer in enumerate(buffers):
                    if memoryview(buffer).nbytes >= threshold:
                        buffers[index] = zstd.compress(buffer)
                        buffer_flags[index] = FLAG_ZSTD
        header = FRAME_HEADER.pack(
            FRAME_MAGIC, FRAME_VERSION, FrameKind.DATA, flags, len(payload), len(buffers)
        )
        return [b"".join((header, buffer_flags, payload)), *buffers]

    @staticmethod
    def control(kind: FrameKind, text: str = "") -> list[Buffer]:
        """A control frame (HELLO carries ``text``; HEARTBEAT and END carry nothing)."""
        payload = text.encode()
        return [FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, kind, 0, len(payload), 0) + payload]

    def decode(self, frames: Sequence[Buffer]) -> tuple[FrameKind, object]:
        """Decode frames into ``(kind, message)``; for HELLO the message is the peer name.

        Raises:
            DecodeError: a subclass naming what is wrong with the frames.
        """
        if not frames:
            raise TruncatedFrameError("empty multipart message")
        head = memoryview(frames[0])
        if head.nbytes < FRAME_HEADER.size:
            raise TruncatedFrameError(
                f"header frame has {head.nbytes} bytes, needs at least {FRAME_HEADER.size}"
            )
        magic, version, kind_value, flags, payload_len, n_buffers = FRAME_HEADER.unpack_from(head)
        if magic != FRAME_MAGIC:
            raise NotMsgpackError(f"not an actorline frame (magic byte 0x{magic:02x})")
        if version != FRAME_VERSION:
            raise NotMsgpackError(f"unsupported frame version {version}")
        try:
            kind = FrameKind(kind_value)
        except ValueError:
            raise NotMsgpackError(f"unknown frame kind {kind_value}") from None
        start = FRAME_HEADER.size + n_buffers
        if head.nbytes != start + payload_len:
            raise TruncatedFrameError(
                f"header frame declares {start + payload_len} bytes, has {head.nbytes}"
            )
        if len(frames) != 1 + n_buffers:
            raise TruncatedFrameError(
                f"header declares {n_buffers} buffer frames, {len(frames) - 1} arrived"
            )
        if payload_len > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"payload of {payload_len} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        payload: Buffer = head[start:]
        if kind is FrameKind.HELLO:
            return kind, bytes(payload).decode("utf-8", "replace")
        if kind is not FrameKind.DATA:
            return kind, None
        if flags & FLAG_ZSTD:
            payload = self._decompress(payload)
        buffers: list[Buffer] = list(frames[1:])
        for index in range(n_buffers):
            if head[FRAME_HEADER.size + index] & FLAG_ZSTD:
                buffers[index] = self._decompress(buffers[index])
            elif memoryview(buffers[index]).nbytes > self.max_frame_bytes:
                raise FrameTooLargeError(f"buffer frame {index} exceeds the size limit")
        return kind, self.codec.decode(payload, buffers)

    def _decompress(self, data: Buffer) -> bytes:
        if self._zstd is None:
            # A peer may compress even if we do not; decompress with the default limits.
            self._zstd = ZstdFrames(Compression(threshold=1 << 62), self.max_frame_bytes)
        return self._zstd.decompress(data)
