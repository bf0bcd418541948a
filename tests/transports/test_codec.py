"""Tests for transports/codec.py: typed messages, tensors out of band, safe decoding."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Literal

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transports.codec import Codec, MessageRegistry, message
from transports.errors import (
    DecodeError,
    EncodeError,
    FieldTypeError,
    NotMsgpackError,
    TruncatedFrameError,
    UnknownTagError,
)

REGISTRY = MessageRegistry()
EXT_MESSAGE, EXT_TENSOR, EXT_NDARRAY = 1, 2, 3


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@message(1, registry=REGISTRY)
@dataclasses.dataclass(frozen=True, slots=True)
class Inner:
    name: str
    weight: float = 1.0


@message(2, registry=REGISTRY)
@dataclasses.dataclass(frozen=True, slots=True)
class Everything:
    flag: bool
    count: int
    ratio: float
    text: str
    blob: bytes
    maybe: int | None
    ids: tuple[int, ...]
    pair: tuple[str, int]
    names: list[str]
    table: dict[str, int]
    mode: Literal["a", "b"]
    color: Color
    level: Level
    inner: Inner
    inners: tuple[Inner, ...]
    array: np.ndarray
    tensor: torch.Tensor
    anything: Any = None


@message(3, registry=REGISTRY)
@dataclasses.dataclass(frozen=True, slots=True)
class Validated:
    size: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")


@message(4, registry=REGISTRY)
@dataclasses.dataclass(frozen=True, slots=True)
class Blob:
    data: bytes
    values: tuple[Any, ...] = ()


def everything(**changes: Any) -> Everything:
    fields: dict[str, Any] = dict(
        flag=True,
        count=-7,
        ratio=0.25,
        text="héllo",
        blob=b"\x00\xff",
        maybe=None,
        ids=(1, 2, 3),
        pair=("x", 9),
        names=["a", "b"],
        table={"k": 1},
        mode="b",
        color=Color.BLUE,
        level=Level.HIGH,
        inner=Inner("in", 2.5),
        inners=(Inner("a"), Inner("b", 0.5)),
        array=np.arange(12, dtype=np.float32).reshape(3, 4),
        tensor=torch.arange(6, dtype=torch.int64).reshape(2, 3),
        anything={"free": [1, "form"]},
    )
    fields.update(changes)
    return Everything(**fields)


def raw_message(tag: int, *values: Any) -> bytes:
    """A payload built by hand, as a peer could send it."""
    return msgpack.packb(msgpack.ExtType(EXT_MESSAGE, msgpack.packb([tag, *values])))


def assert_everything_equal(got: object, sent: Everything) -> None:
    assert isinstance(got, Everything)
    for field in dataclasses.fields(Everything):
        want, have = getattr(sent, field.name), getattr(got, field.name)
        if isinstance(want, np.ndarray):
            assert have.dtype == want.dtype and np.array_equal(have, want)
        elif isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype and torch.equal(have, want)
        else:
            assert have == want and type(have) is type(want), field.name


# -- round trips ---------------------------------------------------------------------------------


def test_every_supported_field_type_round_trips() -> None:
    codec = Codec(REGISTRY)
    sent = everything()
    payload, buffers = codec.encode(sent)
    assert_everything_equal(codec.decode(payload, buffers), sent)


def test_an_int_is_accepted_for_a_float_field_and_becomes_a_float() -> None:
    codec = Codec(REGISTRY)
    got = codec.decode(*codec.encode(Inner("x", 3)))
    assert isinstance(got, Inner) and got.weight == 3.0 and type(got.weight) is float


def test_trailing_fields_with_defaults_may_be_left_out_by_the_peer() -> None:
    got = Codec(REGISTRY).decode(raw_message(1, "only-the-name"))
    assert got == Inner("only-the-name", 1.0)


def test_small_arrays_are_inline_and_large_ones_out_of_band_without_copying() -> None:
    codec = Codec(REGISTRY, oob_threshold=256)
    small = np.arange(8, dtype=np.int64)  # 64 bytes
    large = np.arange(1024, dtype=np.int64)  # 8 KiB
    payload, buffers = codec.encode(Blob(b"", (small, large)))
    assert len(buffers) == 1
    assert memoryview(buffers[0]).nbytes == large.nbytes
    assert np.shares_memory(np.frombuffer(buffers[0], dtype=np.uint8), large)
    got = codec.decode(payload, buffers)
    assert isinstance(got, Blob)
    assert np.array_equal(got.values[0], small) and np.array_equal(got.values[1], large)


def test_non_contiguous_tensors_and_arrays_round_trip() -> None:
    codec = Codec(REGISTRY)
    tensor = torch.arange(200, dtype=torch.float32).reshape(10, 20).t()[::2]
    array = np.arange(300, dtype=np.int16).reshape(15, 20)[:, ::3]
    got = codec.decode(*codec.encode(Blob(b"", (tensor, array))))
    assert isinstance(got, Blob)
    assert torch.equal(got.values[0], tensor) and got.values[0].shape == tensor.shape
    assert np.array_equal(got.values[1], array)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.uint8]
)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (4, 70)])
def test_tensors_of_every_dtype_and_shape_round_trip_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    codec = Codec(REGISTRY)
    tensor = (torch.randn(shape) * 100).to(dtype)
    got = codec.decode(*codec.encode(Blob(b"", (tensor,))))
    assert isinstance(got, Blob)
    (value,) = got.values
    assert value.dtype == dtype and value.shape == tensor.shape
    assert torch.equal(value.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_a_tensor_decoded_from_read_only_bytes_is_writable() -> None:
    codec = Codec(REGISTRY)
    payload, buffers = codec.encode(Blob(b"", (torch.ones(100),)))
    got = codec.decode(payload, [bytes(b) for b in buffers])
    assert isinstance(got, Blob)
    got.values[0].add_(1)  # would fail on read-only memory
    assert torch.equal(got.values[0], torch.full((100,), 2.0))


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(min_value=-(2**63), max_value=2**64 - 1),
    text=st.text(),
    blob=st.binary(),
    ids=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1)),
    table=st.dictionaries(st.text(), st.integers(min_value=0, max_value=2**32)),
    ratio=st.floats(allow_nan=False),
)
def test_round_trip_of_arbitrary_field_values(
    count: int, text: str, blob: bytes, ids: list[int], table: dict[str, int], ratio: float
) -> None:
    codec = Codec(REGISTRY)
    sent = everything(count=count, text=text, blob=blob, ids=tuple(ids), table=table, ratio=ratio)
    assert_everything_equal(codec.decode(*codec.encode(sent)), sent)


# -- registration --------------------------------------------------------------------------------


def test_registration_refuses_what_cannot_be_a_message() -> None:
    registry = MessageRegistry()

    class NotADataclass:
        pass

    with pytest.raises(TypeError, match="not a dataclass"):
        registry.register(NotADataclass, 1)
    with pytest.raises(ValueError, match="out of range"):
        registry.register(Inner, -1)

    @dataclasses.dataclass(frozen=True, slots=True)
    class UsesASet:
        items: set[int]

    with pytest.raises(TypeError, match="does not support"):
        registry.register(UsesASet, 2)


def test_a_tag_cannot_be_taken_by_a_second_class_but_re_registering_is_fine() -> None:
    registry = MessageRegistry()
    registry.register(Inner, 10)
    registry.register(Inner, 10)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Validated, 10)
    assert registry.tags() == {10: f"{__name__}.Inner"}


# -- encoding errors -----------------------------------------------------------------------------


def test_encoding_an_unregistered_type_is_an_encode_error() -> None:
    with pytest.raises(EncodeError, match="not a registered message"):
        Codec(REGISTRY).encode(object())


@pytest.mark.parametrize(
    "value",
    [
        object(),
        np.zeros(3, dtype=">i4"),
        np.array(["text"], dtype=object),
        torch.zeros(2, dtype=torch.float8_e4m3fn),
    ],
    ids=["object", "big-endian", "object-array", "float8"],
)
def test_encoding_an_unsupported_value_is_an_encode_error(value: Any) -> None:
    with pytest.raises(EncodeError):
        Codec(REGISTRY).encode(Blob(b"", (value,)))


TENSORS_WITHOUT_DENSE_DATA: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse-coo": (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
    "sparse-csr": (lambda: torch.eye(3).to_sparse(layout=torch.sparse_csr), "sparse_csr tensor"),
    "meta": (lambda: torch.empty(3, device="meta"), "meta tensor"),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        "nested tensor",
    ),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR / nested are beta
@pytest.mark.parametrize("kind", sorted(TENSORS_WITHOUT_DENSE_DATA))
def test_a_tensor_with_no_dense_data_is_an_encode_error_naming_the_field(kind: str) -> None:
    make, why = TENSORS_WITHOUT_DENSE_DATA[kind]
    value = make()
    with pytest.raises(EncodeError, match=rf"^Blob\.values: cannot encode a {why}"):
        Codec(REGISTRY).encode(Blob(b"", (value,)))
    nested = everything(anything=Blob(b"", (value,)))
    with pytest.raises(EncodeError, match=rf"^Everything\.anything: Blob\.values: .*{why}"):
        Codec(REGISTRY).encode(nested)


def test_an_out_of_range_integer_is_an_encode_error_naming_the_field() -> None:
    with pytest.raises(EncodeError, match=r"^Everything\.count: "):
        Codec(REGISTRY).encode(everything(count=2**64))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_conjugate_and_negative_views_travel_as_the_values_they_read_as(
    dtype: torch.dtype,
) -> None:
    base = torch.tensor([1 + 2j, -3 - 0j, 0.5j], dtype=dtype)
    views = [base.conj(), torch.conj_physical(base), base.conj().imag, base.conj()[::2]]
    codec = Codec(REGISTRY)
    for view in views:
        payload, buffers = codec.encode(Blob(b"", (view,)))
        got = codec.decode(payload, buffers)
        assert isinstance(got, Blob)
        (value,) = got.values
        assert not value.is_conj() and not value.is_neg()
        assert value.dtype == view.dtype and value.shape == view.shape
        want = view.resolve_conj().resolve_neg().contiguous()
        assert value.reshape(-1).view(torch.uint8).tolist() == (
            want.reshape(-1).view(torch.uint8).tolist()
        )  # bit-exact, the sign of -0.0 included


# -- decoding errors: every DecodeError subclass ---------------------------------------------------

BAD_PAYLOADS: list[tuple[str, bytes, type[DecodeError]]] = [
    ("never-used msgpack byte", b"\xc1", NotMsgpackError),
    ("truncated msgpack", raw_message(1, "name", 2.0)[:-3], NotMsgpackError),
    ("top level is not a message", msgpack.packb([1, 2, 3]), NotMsgpackError),
    ("unknown extension code", msgpack.packb(msgpack.ExtType(42, b"")), NotMsgpackError),
    (
        "message body is not a list",
        msgpack.packb(msgpack.ExtType(EXT_MESSAGE, msgpack.packb("x"))),
        NotMsgpackError,
    ),
    ("message tag is not an int", raw_message("1", "name"), NotMsgpackError),  # type: ignore[arg-type]
    (
        "malformed tensor header",
        raw_message(4, b"", [msgpack.ExtType(EXT_TENSOR, msgpack.packb(["float32", "3", 0]))]),
        NotMsgpackError,
    ),
    (
        "unknown dtype",
        raw_message(4, b"", [msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["object", [1], b"x"]))]),
        NotMsgpackError,
    ),
    (
        "numpy bfloat16",
        raw_message(
            4, b"", [msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["bfloat16", [1], b"xx"]))]
        ),
        NotMsgpackError,
    ),
    (
        "array data neither bytes nor a buffer index",
        raw_message(4, b"", [msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["uint8", [1], "x"]))]),
        NotMsgpackError,
    ),
    *(
        (
            f"{kind} shape {shape} too large",
            raw_message(4, b"", [msgpack.ExtType(code, msgpack.packb(["float32", shape, b""]))]),
            NotMsgpackError,
        )
        for kind, code in (("tensor", EXT_TENSOR), ("array", EXT_NDARRAY))
        for shape in ([0, 2**63 - 1], [2**40, 0, 2**40], [0] * 65)
    ),
    ("unknown tag", raw_message(999, 1), UnknownTagError),
    ("bool field gets an int", raw_message(3, True), FieldTypeError),
    ("int field gets a float", raw_message(3, 1.5), FieldTypeError),
    ("str field gets bytes", raw_message(1, b"name"), FieldTypeError),
    ("float field gets a str", raw_message(1, "n", "1.0"), FieldTypeError),
    ("bytes field gets a str", raw_message(4, "data"), FieldTypeError),
    ("too many fields", raw_message(3, 1, 2), FieldTypeError),
    ("too few fields", raw_message(4), FieldTypeError),
    ("__post_init__ refuses the value", raw_message(3, -1), FieldTypeError),
]


def everything_with(**changes: Any) -> bytes:
    """An Everything payload with some fields replaced by raw values."""
    codec = Codec(REGISTRY)
    payload, _ = codec.encode(everything(array=np.zeros(1), tensor=torch.zeros(1)))
    body = msgpack.unpackb(msgpack.unpackb(payload).data, raw=False, strict_map_key=False)
    names = [f.name for f in dataclasses.fields(Everything)]
    for name, value in changes.items():
        body[1 + names.index(name)] = value
    return msgpack.packb(msgpack.ExtType(EXT_MESSAGE, msgpack.packb(body)))


FIELD_MISMATCHES = {
    "flag": 1,
    "count": True,
    "maybe": "x",
    "ids": [1, "2"],
    "pair": ["x"],
    "names": "ab",
    "table": {1: 1},
    "mode": "c",
    "color": "green",
    "level": 3,
    "inner": msgpack.ExtType(EXT_MESSAGE, msgpack.packb([3, 1])),
    "inners": [msgpack.ExtType(EXT_MESSAGE, msgpack.packb([3, 1]))],
    "array": [1, 2],
    "tensor": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["uint8", [1], b"x"])),
}


@pytest.mark.parametrize(
    ("label", "payload", "error"), BAD_PAYLOADS, ids=[b[0] for b in BAD_PAYLOADS]
)
def test_bad_payloads_raise_the_matching_decode_error(
    label: str, payload: bytes, error: type[DecodeError]
) -> None:
    with pytest.raises(error):
        Codec(REGISTRY).decode(payload)


@pytest.mark.parametrize("field", sorted(FIELD_MISMATCHES))
def test_every_field_kind_is_type_checked(field: str) -> None:
    with pytest.raises(FieldTypeError, match=f"Everything.{field}"):
        Codec(REGISTRY).decode(everything_with(**{field: FIELD_MISMATCHES[field]}))


def test_out_of_band_buffers_must_exist_and_have_the_declared_size() -> None:
    codec = Codec(REGISTRY)
    payload, buffers = codec.encode(Blob(b"", (np.arange(1000, dtype=np.int32),)))
    with pytest.raises(TruncatedFrameError, match="missing"):
        codec.decode(payload, [])
    with pytest.raises(TruncatedFrameError, match="needs 4000 bytes"):
        codec.decode(payload, [memoryview(buffers[0])[:-1]])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_to_a_message_or_a_decode_error(data: bytes) -> None:
    try:
        result = Codec(REGISTRY).decode(data)
    except DecodeError:
        return
    assert type(result) in (Inner, Everything, Validated, Blob)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_corrupting_one_byte_of_a_valid_payload_never_escapes_decode_error(
    position: int, value: int
) -> None:
    codec = Codec(REGISTRY)
    payload, buffers = codec.encode(everything())
    corrupted = bytearray(payload)
    corrupted[position % len(corrupted)] = value
    try:
        codec.decode(bytes(corrupted), buffers)
    except DecodeError:
        pass
