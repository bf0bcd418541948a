"""What the conformance kit sends: its message types (tags 900-999), sample tensors and
arrays, and frames a broken or hostile peer might send. Used by :mod:`transports.testing`."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import zstandard

from transports.codec import MAX_NESTING, Buffer, message
from transports.compression import Compression
from transports.errors import (
    DecodeError,
    DecompressionError,
    FieldTypeError,
    FrameTooLargeError,
    NestingTooDeepError,
    NotMsgpackError,
    TruncatedFrameError,
    UnknownTagError,
)
from transports.framing import (
    FLAG_ZSTD,
    FRAME_HEADER,
    FRAME_MAGIC,
    FRAME_VERSION,
    FrameCodec,
    FrameKind,
)

__all__ = [
    "KitArrays",
    "KitEnvelope",
    "KitPayload",
    "KitPing",
    "assert_same_value",
    "bad_frames",
    "data_frame",
    "payload_of",
    "sample_arrays",
    "sample_tensors",
]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KitPing:
    seq: int


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KitPayload:
    seq: int
    data: bytes


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KitArrays:
    """Tensors and arrays, positional and by name."""

    label: str
    values: tuple[Any, ...]
    named: dict[str, Any]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KitEnvelope:
    """A message nesting other messages."""

    note: str
    inner: KitArrays
    more: tuple[KitArrays, ...] = ()


def sample_tensors() -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        "float32": torch.randn(64, 33, generator=generator),
        "bfloat16": torch.randn(17, 5, generator=generator).to(torch.bfloat16),
        "float16": torch.randn(300, generator=generator).to(torch.float16),
        "int64": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
        "bool": torch.rand(7, 9, generator=generator) > 0.5,
        "uint8": torch.randint(0, 256, (500,), dtype=torch.uint8, generator=generator),
        "transposed": torch.randn(40, 30, generator=generator).t(),
        "strided": torch.arange(3000, dtype=torch.int64)[::7],
        "scalar": torch.tensor(3.5),
        "scalar_int": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "nan_bits": torch.tensor([float("nan"), -0.0, float("inf")]),
        # a conjugate view: it reads as values it does not store (the sign bits of -0.0 too)
        "conjugate": torch.tensor([1 + 2j, -3 + 0j, 0.5j], dtype=torch.complex64).conj(),
    }


def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "float32": rng.standard_normal((40, 40)).astype(np.float32),
        "float16": rng.standard_normal(200).astype(np.float16),
        "int64": np.arange(2000, dtype=np.int64).reshape(20, 100),
        "bool": rng.random((5, 11)) > 0.5,
        "uint8": rng.integers(0, 256, 700, dtype=np.uint8),
        "transposed": rng.standard_normal((30, 20)).astype(np.float32).T,
        "strided": np.arange(5000, dtype=np.int64)[::3],
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def assert_same_value(label: str, sent: Any, got: Any) -> None:
    if isinstance(sent, np.ndarray):
        assert isinstance(got, np.ndarray), f"{label}: got {type(got).__name__}"
        assert got.dtype == sent.dtype and got.shape == sent.shape, f"{label}: {got.dtype}"
        assert got.tobytes() == sent.tobytes(), f"{label}: the bits differ"
        return
    import torch

    assert isinstance(got, torch.Tensor), f"{label}: got {type(got).__name__}"
    assert got.dtype == sent.dtype and got.shape == sent.shape, f"{label}: {got.dtype}"

    def bits(tensor: Any) -> Any:
        """The bits of the values ``tensor`` reads as (a conjugate view's resolved)."""
        values = tensor.resolve_conj().resolve_neg()
        return values.reshape(-1).contiguous().view(torch.uint8)

    assert torch.equal(bits(sent), bits(got)), f"{label}: the bits differ"


def data_frame(payload: bytes, *, flags: int = 0, buffer_flags: bytes = b"") -> bytes:
    header = FRAME_HEADER.pack(
        FRAME_MAGIC, FRAME_VERSION, FrameKind.DATA, flags, len(payload), len(buffer_flags)
    )
    return header + buffer_flags + payload


def payload_of(frame: Buffer) -> bytes:
    data = bytes(frame)
    n_buffers = FRAME_HEADER.unpack_from(data)[-1]
    return data[FRAME_HEADER.size + n_buffers :]


def bad_frames(max_message_bytes: int) -> list[tuple[str, list[Buffer], type[DecodeError]]]:
    """Frames a broken or hostile peer might send: ``(label, frames, expected error)``."""
    framer = FrameCodec()
    ping = framer.encode(KitPing(1))[0]
    payload = framer.encode(KitPayload(1, b"abcdefgh" * 8))[0]
    array = np.arange(1024, dtype=np.int64)
    with_buffer = framer.encode(KitArrays("oob", (array,), {}))
    head, buffer = with_buffer[0], memoryview(with_buffer[1]).tobytes()
    unknown_tag = msgpack.packb(msgpack.ExtType(1, msgpack.packb([987_654, 1])))
    unknown_ext = msgpack.packb(msgpack.ExtType(42, b"?"))
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(max_message_bytes + 1))
    # what a streaming compressor writes: no content size in the header
    unsized_bomb = zstandard.ZstdCompressor(write_content_size=False).compress(
        bytes(max_message_bytes + 1)
    )
    wrong_nested = framer.encode(KitEnvelope("x", KitPing(1), ()))[0]  # type: ignore[arg-type]
    nested = msgpack.packb([900, 1])
    for _ in range(MAX_NESTING * 10):  # a few KB that would recurse once per level
        nested = msgpack.packb([900, msgpack.ExtType(1, nested)])
    too_deep = msgpack.packb(msgpack.ExtType(1, nested))
    compressed = FrameCodec(compression=Compression(threshold=0)).encode(
        KitPayload(1, b"abc" * 1000)
    )[0]
    huge_empty = [  # numpy refuses these shapes; a tensor of them must be refused the same
        msgpack.packb(msgpack.ExtType(1, msgpack.packb([902, "huge", [shaped], {}])))
        for shaped in (
            msgpack.ExtType(code, msgpack.packb(["float32", [0, 2**63 - 1], b""]))
            for code in (2, 3)  # a tensor, an array
        )
    ]
    corrupt = bytearray(payload_of(compressed))
    corrupt[len(corrupt) // 2] ^= 0xFF  # a valid zstd header, a corrupt body
    corrupt[-3] ^= 0x55
    return [
        ("not an actorline frame", [b"this is not msgpack at all"], NotMsgpackError),
        ("payload is not msgpack", [data_frame(b"\xc1\xc1")], NotMsgpackError),
        ("top level is not a message", [data_frame(msgpack.packb([1, 2]))], NotMsgpackError),
        ("unknown extension type", [data_frame(unknown_ext)], NotMsgpackError),
        ("unknown message tag", [data_frame(unknown_tag)], UnknownTagError),
        ("truncated header", [bytes(ping)[:3]], TruncatedFrameError),
        ("truncated payload", [bytes(payload)[:-5]], TruncatedFrameError),
        ("missing buffer frame", [head], TruncatedFrameError),
        ("truncated buffer frame", [head, buffer[:-8]], TruncatedFrameError),
        ("wrong field type", framer.encode(KitPing("seven")), FieldTypeError),  # type: ignore[arg-type]
        ("wrong nested message type", [wrong_nested], FieldTypeError),
        ("empty tensor of a huge shape", [data_frame(huge_empty[0])], NotMsgpackError),
        ("empty array of a huge shape", [data_frame(huge_empty[1])], NotMsgpackError),
        ("messages nested too deep", [data_frame(too_deep)], NestingTooDeepError),
        ("bad zstd", [data_frame(payload_of(payload), flags=FLAG_ZSTD)], DecompressionError),
        ("corrupt zstd body", [data_frame(bytes(corrupt), flags=FLAG_ZSTD)], DecompressionError),
        (
            "truncated zstd",
            [data_frame(payload_of(compressed)[:-10], flags=FLAG_ZSTD)],
            DecompressionError,
        ),
        (
            "bad zstd buffer frame",
            [data_frame(payload_of(ping), buffer_flags=bytes([FLAG_ZSTD])), b"not zstd"],
            DecompressionError,
        ),
        ("zstd bomb", [data_frame(bomb, flags=FLAG_ZSTD)], FrameTooLargeError),
        (
            "zstd bomb without a declared size",
            [data_frame(unsized_bomb, flags=FLAG_ZSTD)],
            FrameTooLargeError,
        ),
        ("oversized payload", [data_frame(bytes(max_message_bytes + 1))], FrameTooLargeError),
    ]
