"""Optional zstd compression of frames, applied above a size threshold."""

from __future__ import annotations

import dataclasses
import threading

import zstandard

from transports.errors import DecompressionError, FrameTooLargeError

__all__ = ["Compression", "ZstdFrames"]


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
        """Raises DecompressionError or FrameTooLargeError; never returns partial output."""
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise DecompressionError(f"not a zstd frame: {exc}") from None
        if size < 0:
            raise DecompressionError("zstd frame does not declare its content size")
        if size > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"zstd frame expands to {size} bytes, over the limit of {self.max_frame_bytes}"
            )
        try:
            return self._contexts()[1].decompress(data, max_output_size=max(size, 1))
        except zstandard.ZstdError as exc:
            raise DecompressionError(f"zstd frame does not decompress: {exc}") from None
