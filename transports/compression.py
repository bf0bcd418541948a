"""Optional zstd compression of frames, applied above a size threshold.

Decompression is bounded by the link's size limit before any output exists beyond it: a
frame that declares its content size (as this module's compressor writes it) is refused when
the size is over the limit and decompressed in one call otherwise (zstd refuses a frame that
holds more than it declares); a frame without one (a streaming compressor's) is decompressed
chunk by chunk and refused as soon as its output passes the limit (docs/architecture.md §5.5).
"""

from __future__ import annotations

import dataclasses
import threading

import zstandard

from transports.errors import DecompressionError, FrameTooLargeError

__all__ = ["Compression", "ZstdFrames"]

#: output read at a time from a frame that does not declare its size
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Compression:
    """How a byte transport compresses frames.

    ``threshold``: frames smaller than this many bytes are sent as they are, so small
    messages pay nothing. ``compress_buffers``: also compress out-of-band tensor/array
    buffers (off by default: dense numeric data rarely shrinks and costs the most time).
    """

    algorithm: str = "zstd"
    level: int = 1
    threshold: int = 1024
    compress_buffers: bool = False

    def __post_init__(self) -> None:
        if self.algorithm != "zstd":
            raise ValueError(f"unknown compression algorithm {self.algorithm!r}; known: 'zstd'")
        if not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {self.level}")
        if self.threshold < 0:
            raise ValueError(f"compression threshold must be >= 0, got {self.threshold}")

    @classmethod
    def parse(cls, value: str | Compression | None) -> Compression | None:
        """Accept ``None``/``"none"``, ``"zstd"`` or a :class:`Compression`."""
        if value is None or isinstance(value, Compression):
            return value
        if value in ("", "none", "off"):
            return None
        return cls(algorithm=value)


class ZstdFrames:
    """Compresses and decompresses single frames; one per link (per-thread contexts)."""

    def __init__(self, compression: Compression, max_frame_bytes: int) -> None:
        self.compression = compression
        self.max_frame_bytes = max_frame_bytes
        self._local = threading.local()

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        contexts = getattr(self._local, "contexts", None)
        if contexts is None:
            contexts = (
                zstandard.ZstdCompressor(level=self.compression.level, write_content_size=True),
                zstandard.ZstdDecompressor(),
            )
            self._local.contexts = contexts
        return contexts

    def compress(self, data: bytes | bytearray | memoryview) -> bytes:
        return self._contexts()[0].compress(data)

    def decompress(self, data: bytes | bytearray | memoryview) -> bytes:
        """The frame's content, never more than ``max_frame_bytes`` of it held at once.

        Raises:
            DecompressionError: not a zstd frame, or one that does not decompress.
            FrameTooLargeError: it declares, or decompresses to, more than the limit.
        """
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise DecompressionError(f"not a zstd frame: {exc}") from None
        if size > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"zstd frame expands to {size} bytes, over the limit of {self.max_frame_bytes}"
            )
        decompressor = self._contexts()[1]
        try:
            if size >= 0:  # (-1: not declared)
                # NOTE: the output buffer is the declared size, and zstd refuses a frame that
                # holds more than it declares
                return decompressor.decompress(data, max_output_size=max(size, 1))
            return self._decompress_capped(decompressor, data)
        except zstandard.ZstdError as exc:
            raise DecompressionError(f"zstd frame does not decompress: {exc}") from None

    def _decompress_capped(
        self, decompressor: zstandard.ZstdDecompressor, data: bytes | bytearray | memoryview
    ) -> bytes:
        """A frame that does not declare its size: first measured, a chunk of output at a
        time (each dropped once counted), and refused as soon as it passes the limit; then,
        its size known, decompressed in one call, which also refuses a truncated frame (the
        streaming read ends quietly where the input does).

        Raises:
            FrameTooLargeError: it decompresses past the limit.
            zstandard.ZstdError: it does not decompress, or is truncated.
        """
        limit = self.max_frame_bytes
        size = 0
        with decompressor.stream_reader(data) as reader:
            while chunk := reader.read(min(limit + 1 - size, _CHUNK)):
                size += len(chunk)
                if size > limit:
                    raise FrameTooLargeError(
                        f"zstd frame (no declared size) expands past the limit of {limit} bytes"
                    )
        return decompressor.decompress(data, max_output_size=max(size, 1))
