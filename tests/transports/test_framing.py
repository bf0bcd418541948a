"""Tests for transports/framing.py: header layout, control frames, per-frame zstd, limits."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import zstandard

from transports.codec import Buffer
from transports.compression import Compression
from transports.errors import (
    DecodeError,
    DecompressionError,
    FrameTooLargeError,
    NotMsgpackError,
    TruncatedFrameError,
)
from transports.framing import FrameCodec, FrameKind
from transports.testing import KitArrays, KitPayload

HEADER = struct.Struct("!BBBBIH")  # magic, version, kind, flags, payload_len, n_buffers
MAGIC, VERSION, ZSTD = 0xAC, 1, 1
COMPRESSIBLE = b"token ids and text compress well " * 1000


def header_of(frame: Buffer) -> tuple[int, ...]:
    return HEADER.unpack_from(bytes(frame))


def data_frame(payload: bytes, *, flags: int = 0, buffer_flags: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, FrameKind.DATA, flags, len(payload), len(buffer_flags)) + (
        buffer_flags + payload
    )


def test_a_data_message_round_trips_with_its_header_layout() -> None:
    framer = FrameCodec()
    frames = framer.encode(KitPayload(7, b"abc"))
    assert len(frames) == 1
    magic, version, kind, flags, payload_len, n_buffers = header_of(frames[0])
    assert (magic, version, kind, flags, n_buffers) == (MAGIC, VERSION, FrameKind.DATA, 0, 0)
    assert len(frames[0]) == HEADER.size + payload_len
    assert framer.decode(frames) == (FrameKind.DATA, KitPayload(7, b"abc"))


def test_out_of_band_buffers_follow_the_header_frame() -> None:
    framer = FrameCodec()
    array = np.arange(4096, dtype=np.float32)
    frames = framer.encode(KitArrays("oob", (array,), {}))
    assert len(frames) == 2 and header_of(frames[0])[5] == 1
    kind, got = framer.decode(frames)
    assert kind is FrameKind.DATA and isinstance(got, KitArrays)
    assert np.array_equal(got.values[0], array)


@pytest.mark.parametrize("kind", [FrameKind.HEARTBEAT, FrameKind.END])
def test_control_frames_carry_nothing(kind: FrameKind) -> None:
    frames = FrameCodec.control(kind)
    assert frames == [HEADER.pack(MAGIC, VERSION, kind, 0, 0, 0)]
    assert FrameCodec().decode(frames) == (kind, None)


def test_hello_carries_the_sender_name_and_tolerates_bad_utf8() -> None:
    assert FrameCodec().decode(FrameCodec.control(FrameKind.HELLO, "stage-a")) == (
        FrameKind.HELLO,
        "stage-a",
    )
    bad = HEADER.pack(MAGIC, VERSION, FrameKind.HELLO, 0, 2, 0) + b"\xff\xfe"
    kind, name = FrameCodec().decode([bad])
    assert kind is FrameKind.HELLO and isinstance(name, str)


def test_compression_flags_large_compressible_payloads_only() -> None:
    framer = FrameCodec(compression=Compression(threshold=1024))
    small = framer.encode(KitPayload(1, b"x" * 100))
    large = framer.encode(KitPayload(2, COMPRESSIBLE))
    assert header_of(small[0])[3] == 0
    assert header_of(large[0])[3] == ZSTD
    assert len(large[0]) < len(COMPRESSIBLE) // 10
    assert framer.bytes_after_compression < framer.bytes_before_compression
    # A receiver without compression configured still decodes compressed frames.
    assert FrameCodec().decode(large) == (FrameKind.DATA, KitPayload(2, COMPRESSIBLE))


def test_incompressible_payloads_are_sent_as_they_are() -> None:
    framer = FrameCodec(compression=Compression(threshold=1024))
    noise = np.random.default_rng(0).bytes(50_000)
    frames = framer.encode(KitPayload(1, noise))
    assert header_of(frames[0])[3] == 0
    assert framer.decode(frames) == (FrameKind.DATA, KitPayload(1, noise))


def test_buffers_are_compressed_only_when_asked() -> None:
    zeros = np.zeros(100_000, dtype=np.float32)
    plain = FrameCodec(compression=Compression()).encode(KitArrays("z", (zeros,), {}))
    squeezed = FrameCodec(compression=Compression(compress_buffers=True)).encode(
        KitArrays("z", (zeros,), {})
    )
    assert memoryview(plain[1]).nbytes == zeros.nbytes
    assert len(squeezed[1]) < zeros.nbytes // 100
    assert bytes(squeezed[0])[HEADER.size] == ZSTD  # the buffer's flag
    _, got = FrameCodec().decode(squeezed)
    assert isinstance(got, KitArrays) and np.array_equal(got.values[0], zeros)


def valid_payload() -> bytes:
    return bytes(FrameCodec().encode(KitPayload(1, b"payload"))[0])[HEADER.size :]


#: a compressor that writes no content size, as streaming compressors do
UNSIZED = zstandard.ZstdCompressor(write_content_size=False)


def understated() -> bytes:
    """A zstd frame of 1000 bytes whose header says 256."""
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(b"a" * 1000))
    assert frame[4] == 0x60 and frame[5:7] == (1000 - 256).to_bytes(2, "little")  # 2-byte size
    frame[5:7] = (0).to_bytes(2, "little")
    assert zstandard.frame_content_size(bytes(frame)) == 256
    return bytes(frame)


def test_a_frame_without_a_declared_size_decodes() -> None:
    """A peer's streaming compressor writes no content size: the frame is measured a chunk at
    a time under the limit, then decoded."""
    payload = bytes(FrameCodec().encode(KitPayload(3, COMPRESSIBLE))[0])[HEADER.size :]
    frame = data_frame(UNSIZED.compress(payload), flags=ZSTD)
    assert FrameCodec().decode([frame]) == (FrameKind.DATA, KitPayload(3, COMPRESSIBLE))


@pytest.mark.parametrize("sized", [True, False], ids=["declared size", "no declared size"])
def test_a_zstd_bomb_is_refused_before_it_expands(sized: bool) -> None:
    """1 GiB of zeros in 32 KB: refused within the 1 MiB limit's worth of memory, whether its
    header says how big it is or not."""
    compressor = zstandard.ZstdCompressor(write_content_size=sized)
    frame = data_frame(compressor.compress(bytes(1 << 30)), flags=ZSTD)
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLargeError, match="limit of 1048576"):
            FrameCodec(max_frame_bytes=1 << 20).decode([frame])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


BAD_FRAMES: list[tuple[str, list[Buffer], type[DecodeError]]] = [
    ("no frames", [], TruncatedFrameError),
    ("short header", [b"\xac\x01\x00"], TruncatedFrameError),
    ("bad magic", [b"\x00" * HEADER.size], NotMsgpackError),
    ("bad version", [HEADER.pack(MAGIC, 9, 0, 0, 0, 0)], NotMsgpackError),
    ("unknown kind", [HEADER.pack(MAGIC, VERSION, 77, 0, 0, 0)], NotMsgpackError),
    ("payload shorter than declared", [data_frame(valid_payload())[:-1]], TruncatedFrameError),
    ("payload longer than declared", [data_frame(valid_payload()) + b"!"], TruncatedFrameError),
    (
        "missing buffer frame",
        [data_frame(valid_payload(), buffer_flags=b"\x00")],
        TruncatedFrameError,
    ),
    ("extra frame", [data_frame(valid_payload()), b"extra"], TruncatedFrameError),
    ("not zstd", [data_frame(valid_payload(), flags=ZSTD)], DecompressionError),
    (
        "zstd without content size, past the limit",
        [data_frame(UNSIZED.compress(bytes(2048)), flags=ZSTD)],
        FrameTooLargeError,
    ),
    (
        "zstd without content size, truncated",
        [data_frame(UNSIZED.compress(valid_payload())[:-3], flags=ZSTD)],
        DecompressionError,
    ),
    (
        "zstd declaring less than it holds",
        [data_frame(understated(), flags=ZSTD)],
        DecompressionError,
    ),
    (
        "zstd expanding past the limit",
        [data_frame(zstandard.ZstdCompressor().compress(bytes(2048)), flags=ZSTD)],
        FrameTooLargeError,
    ),
    ("payload past the limit", [data_frame(bytes(2048))], FrameTooLargeError),
    (
        "buffer past the limit",
        [data_frame(valid_payload(), buffer_flags=b"\x00"), bytes(2048)],
        FrameTooLargeError,
    ),
]


@pytest.mark.parametrize(("label", "frames", "error"), BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_bad_frames_raise_the_matching_decode_error(
    label: str, frames: list[Buffer], error: type[DecodeError]
) -> None:
    with pytest.raises(error):
        FrameCodec(max_frame_bytes=1024).decode(frames)
