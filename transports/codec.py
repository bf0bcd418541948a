"""The wire codec: typed messages as msgpack, tensors and arrays out of band.

Every message type is a frozen, slotted dataclass registered under a small integer tag with
:func:`message`. On the wire a message is a msgpack ext object (code 1) whose body is
``[tag, field_0, field_1, ...]``; nested registered messages nest the same way. Torch tensors
(code 2) and numpy arrays (code 3) carry ``[dtype, shape, data]`` where ``data`` is either
inline bytes (small) or the index of an out-of-band buffer: those buffers travel as separate
frames so that ZMQ multipart can send them without copying.

Encoding fails only with :class:`~transports.errors.EncodeError`, naming the message field
and why (a type the codec does not know, a tensor with no data to send such as a sparse or
meta tensor, an integer out of msgpack's range). Conjugate and negative views of tensors are
sent as the values they read as.

Decoding is safe for any input: nothing is unpickled, every field is checked against the
dataclass' type hints (``tuple`` hints turn msgpack lists back into tuples), tensor and array
shapes are checked before anything is allocated, and every failure is a typed
:class:`~transports.errors.DecodeError`.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from transports.errors import (
    DecodeError,
    EncodeError,
    FieldTypeError,
    NestingTooDeepError,
    NotMsgpackError,
    TruncatedFrameError,
    UnknownTagError,
)
from transports.tags import tag_of

__all__ = [
    "DEFAULT_REGISTRY",
    "Buffer",
    "Codec",
    "MessageRegistry",
    "message",
]

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

_EXT_MESSAGE = 1
_EXT_TENSOR = 2
_EXT_NDARRAY = 3

# NOTE: numpy and torch dtypes share these names; anything not listed is refused on both ends.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_DTYPE_SET = frozenset(_DTYPE_NAMES)

Validator = Callable[[Any], Any]

#: a reused msgpack Packer that produced more than this is replaced (its buffer only grows)
_PACKER_KEEP_BYTES = 1 << 20
#: how deep messages may nest inside messages on decode. Each level is a msgpack call from
#: the ext hook (C stack), so a hostile frame of a few KB could otherwise overflow the stack.
MAX_NESTING = 64
#: the most dimensions a decoded tensor or array may have (numpy's own limit)
MAX_DIMS = 64
#: a decoded tensor or array may not span more bytes than this, counting its non-zero
#: dimensions (numpy refuses larger shapes even when a zero dimension makes them empty)
_MAX_SPAN_BYTES = 2**63 - 1


class _Invalid(Exception):
    """Internal: a value does not match a type hint (turned into FieldTypeError)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _MessageSpec:
    cls: type
    tag: int
    field_names: tuple[str, ...]
    getter: Callable[[Any], tuple[Any, ...]]
    validators: tuple[Validator, ...]
    required: int  # number of leading fields without a default


class MessageRegistry:
    """Maps message dataclasses to tags and back.

    Registration happens at import time of the module that defines a message, in every
    process that imports it, so both ends of a link agree as long as they run the same code.
    """

    def __init__(self) -> None:
        self._by_tag: dict[int, _MessageSpec] = {}
        self._by_type: dict[type, _MessageSpec] = {}

    def register(self, cls: type[T], tag: int) -> type[T]:
        """Register ``cls`` (a dataclass) under ``tag``.

        Raises:
            TypeError: ``cls`` is not a dataclass or its type hints cannot be resolved.
            ValueError: the tag is taken by a different class, or is out of range.
        """
        if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
            raise TypeError(f"{cls!r} is not a dataclass; only dataclasses can be messages")
        if not (0 <= tag < 2**31):
            raise ValueError(f"message tag {tag} is out of range [0, 2**31)")
        existing = self._by_tag.get(tag)
        if existing is not None and _qualified(existing.cls) != _qualified(cls):
            raise ValueError(
                f"message tag {tag} is already registered for {_qualified(existing.cls)}; "
                f"cannot register {_qualified(cls)}"
            )
        fields = [f for f in dataclasses.fields(cls) if f.init]
        try:
            hints = typing.get_type_hints(cls)
        except Exception as exc:  # NameError for unresolvable forward references
            raise TypeError(f"cannot resolve the type hints of {_qualified(cls)}: {exc}") from exc
        names = tuple(f.name for f in fields)
        validators = tuple(_compile(hints[name], self) for name in names)
        required = 0
        for f in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required += 1
            else:
                break
        if not names:
            getter: Callable[[Any], tuple[Any, ...]] = lambda obj: ()  # noqa: E731
        elif len(names) == 1:
            single = operator.attrgetter(names[0])
            getter = lambda obj: (single(obj),)  # noqa: E731
        else:
            getter = operator.attrgetter(*names)
        spec = _MessageSpec(cls, tag, names, getter, validators, required)
        if existing is not None:
            self._by_type.pop(existing.cls, None)
        self._by_tag[tag] = spec
        self._by_type[cls] = spec
        return cls

    def spec_for_type(self, cls: type) -> _MessageSpec | None:
        return self._by_type.get(cls)

    def spec_for_tag(self, tag: int) -> _MessageSpec | None:
        return self._by_tag.get(tag)

    def tags(self) -> dict[int, str]:
        """Registered tags and the qualified names of their classes."""
        return {tag: _qualified(spec.cls) for tag, spec in sorted(self._by_tag.items())}


DEFAULT_REGISTRY = MessageRegistry()


def message(
    tag: int | None = None, *, registry: MessageRegistry = DEFAULT_REGISTRY
) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a dataclass as a wire message under ``tag``, by default its
    tag in the one table, :data:`transports.tags.WIRE_TAGS` (every actorline message takes
    its tag from there; an explicit tag is for messages outside actorline, tests included).

    Example::

        @message(950)
        @dataclass(frozen=True, slots=True)
        class Ping:
            seq: int

    Raises:
        LookupError: no ``tag`` and the class is not in the table.
    """

    def decorate(cls: type[T]) -> type[T]:
        return registry.register(cls, tag_of(cls) if tag is None else tag)

    return decorate


class Codec:
    """Encodes registered messages to ``(payload, out_of_band_buffers)`` and back.

    ``oob_threshold``: tensors and arrays of at least this many bytes travel as separate
    buffers; smaller ones are inlined in the payload. An instance keeps per-call state and is
    not thread-safe: give each thread (in practice, each event loop) its own.
    """

    def __init__(self, registry: MessageRegistry = DEFAULT_REGISTRY, *, oob_threshold: int = 256):
        self.registry = registry
        self.oob_threshold = oob_threshold
        self._aux_out: list[Buffer] | None = None
        self._packers: list[msgpack.Packer] = []
        self._depth = 0
        self._aux_in: Sequence[Buffer] = ()
        self._nesting = 0

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, obj: object) -> tuple[bytes, list[Buffer]]:
        """Encode ``obj`` (a registered message) into a payload and out-of-band buffers.

        Raises:
            EncodeError: ``obj`` or something inside it is of a type the codec cannot encode.
        """
        if type(obj) not in self.registry._by_type:
            raise EncodeError(f"{type(obj).__qualname__} is not a registered message type")
        aux: list[Buffer] = []
        self._aux_out = aux
        try:
            payload = self._pack(obj)
        except EncodeError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            raise EncodeError(f"cannot encode {type(obj).__qualname__}: {exc}") from exc
        finally:
            self._aux_out = None
        return payload, aux

    def _default(self, obj: Any) -> msgpack.ExtType:
        spec = self.registry._by_type.get(type(obj))
        if spec is not None:
            values = spec.getter(obj)
            try:
                body = self._pack((spec.tag, *values))
            except (EncodeError, TypeError, ValueError, OverflowError) as exc:
                raise self._field_error(spec, values, exc) from exc
            return msgpack.ExtType(_EXT_MESSAGE, body)
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj, torch)
        if isinstance(obj, enum.Enum):
            return obj.value
        if isinstance(obj, (tuple, frozenset, set)):
            return list(obj)
        if isinstance(obj, int):  # msgpack hands over only the ints it cannot carry
            raise EncodeError(
                f"an integer of {obj.bit_length()} bits is outside msgpack's range [-2**63, 2**64)"
            )
        raise EncodeError(f"cannot encode a value of type {type(obj).__qualname__}")

    def _field_error(
        self, spec: _MessageSpec, values: tuple[Any, ...], error: Exception
    ) -> EncodeError:
        """An EncodeError naming the field of ``spec`` that failed to encode (found by
        encoding each field alone; only on this error path)."""
        name = spec.cls.__qualname__
        for field_name, value in zip(spec.field_names, values):
            try:
                self._pack(value)
            except (EncodeError, TypeError, ValueError, OverflowError) as exc:
                return EncodeError(f"{name}.{field_name}: {exc}")
        return EncodeError(f"{name}: {error}")

    def _pack(self, obj: Any) -> bytes:
        """Pack with the Packer kept for the current nesting depth.

        NOTE: ``msgpack.packb`` makes a fresh Packer with a 256 KiB buffer per call; while an
        outer one is alive (a message inside a message, a tensor header) each nested call
        takes the allocator's slow path, ~20 us. One reused Packer per depth avoids that.
        """
        depth = self._depth
        packers = self._packers
        if depth == len(packers):
            packers.append(msgpack.Packer(default=self._default, use_bin_type=True))
        self._depth = depth + 1
        try:
            packed: bytes = packers[depth].pack(obj)
        finally:
            self._depth = depth
        if len(packed) > _PACKER_KEEP_BYTES:
            packers[depth] = msgpack.Packer(default=self._default, use_bin_type=True)
        return packed

    def _data_ref(self, raw: memoryview) -> bytes | int:
        if raw.nbytes < self.oob_threshold or self._aux_out is None:
            return raw.tobytes()
        self._aux_out.append(raw)
        return len(self._aux_out) - 1

    def _encode_array(self, array: np.ndarray) -> msgpack.ExtType:
        dtype = array.dtype.name
        if dtype not in _DTYPE_SET or array.dtype.byteorder == ">":
            raise EncodeError(f"cannot encode a numpy array of dtype {array.dtype}")
        contiguous = np.ascontiguousarray(array)
        raw = contiguous.reshape(-1).view(np.uint8).data
        body = self._pack((dtype, list(array.shape), self._data_ref(raw)))
        return msgpack.ExtType(_EXT_NDARRAY, body)

    def _encode_tensor(self, tensor: Any, torch: Any) -> msgpack.ExtType:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPE_SET:
            raise EncodeError(f"cannot encode a tensor of dtype {tensor.dtype}")
        if tensor.layout != torch.strided or tensor.is_nested:
            kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
            raise EncodeError(
                f"cannot encode a {kind} tensor: only dense (strided) tensors travel; "
                "send .to_dense() or its parts"
            )
        if tensor.device.type == "meta":
            raise EncodeError("cannot encode a meta tensor: it has a shape but no data")
        try:
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            # NOTE: a conjugate or negative view reads as values it does not store; send
            # those values (resolved into a new tensor), which is what the receiver must see.
            tensor = tensor.detach().resolve_conj().resolve_neg()
            shape = list(tensor.shape)
            flat = tensor.contiguous().reshape(-1)
            raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            raise EncodeError(
                f"cannot encode a tensor ({tensor.dtype} {tuple(tensor.shape)} on "
                f"{tensor.device}): {exc}"
            ) from exc
        body = self._pack((dtype, shape, self._data_ref(raw)))
        return msgpack.ExtType(_EXT_TENSOR, body)

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, payload: Buffer, aux: Sequence[Buffer] = ()) -> object:
        """Decode a payload and its out-of-band buffers into a registered message.

        Raises:
            NotMsgpackError: not msgpack, or not a message at the top level.
            UnknownTagError: a message tag that is not registered.
            FieldTypeError: a field whose value does not match its type hint.
            TruncatedFrameError: an out-of-band buffer is missing or of the wrong size.
            NestingTooDeepError: messages nested more than ``MAX_NESTING`` levels deep.
        """
        self._aux_in = aux
        self._nesting = 0
        try:
            obj = msgpack.unpackb(payload, ext_hook=self._ext_hook, raw=False, strict_map_key=False)
        except DecodeError:
            raise
        except _Invalid as exc:
            raise FieldTypeError(str(exc)) from None
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            detail = str(exc) or type(exc).__name__
            raise NotMsgpackError(f"payload is not valid msgpack: {detail}") from None
        finally:
            self._aux_in = ()
        if type(obj) not in self.registry._by_type:
            raise NotMsgpackError(f"payload is a {type(obj).__name__}, not a registered message")
        return obj

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_MESSAGE:
            return self._decode_message(data)
        if code in (_EXT_TENSOR, _EXT_NDARRAY):
            return self._decode_array(code, data)
        raise NotMsgpackError(f"unknown msgpack extension type {code}")

    def _decode_message(self, data: bytes) -> Any:
        if self._nesting >= MAX_NESTING:
            raise NestingTooDeepError(f"messages nested more than {MAX_NESTING} levels deep")
        self._nesting += 1
        try:
            body = msgpack.unpackb(data, ext_hook=self._ext_hook, raw=False, strict_map_key=False)
        finally:
            self._nesting -= 1
        if type(body) is not list or not body or type(body[0]) is not int:
            raise NotMsgpackError("a message body must be a list starting with an integer tag")
        tag = body[0]
        spec = self.registry._by_tag.get(tag)
        if spec is None:
            raise UnknownTagError(f"unknown message type tag {tag}")
        values = body[1:]
        name = spec.cls.__qualname__
        if len(values) > len(spec.validators) or len(values) < spec.required:
            raise FieldTypeError(
                f"{name} expects {spec.required}..{len(spec.validators)} fields, got {len(values)}"
            )
        args = []
        for field_name, validate, value in zip(spec.field_names, spec.validators, values):
            try:
                args.append(validate(value))
            except _Invalid as exc:
                raise FieldTypeError(f"{name}.{field_name}: {exc}") from None
        try:
            return spec.cls(*args)
        except Exception as exc:  # __post_init__ validation
            raise FieldTypeError(f"{name}: {exc}") from None

    def _decode_array(self, code: int, data: bytes) -> Any:
        header = msgpack.unpackb(data, raw=False)
        if (
            type(header) is not list
            or len(header) != 3
            or header[0] not in _DTYPE_SET
            or type(header[1]) is not list
            or not all(type(d) is int and d >= 0 for d in header[1])
        ):
            raise NotMsgpackError("malformed tensor/array header")
        dtype, shape, ref = header
        itemsize = _itemsize(dtype)
        _check_shape(shape, itemsize)
        if type(ref) is int:
            if not 0 <= ref < len(self._aux_in):
                raise TruncatedFrameError(
                    f"out-of-band buffer {ref} is missing ({len(self._aux_in)} received)"
                )
            raw: Buffer = self._aux_in[ref]
        elif type(ref) is bytes:
            raw = ref
        else:
            raise NotMsgpackError("tensor/array data must be bytes or a buffer index")
        count = 1
        for d in shape:
            count *= d
        nbytes = memoryview(raw).nbytes
        if nbytes != count * itemsize:
            raise TruncatedFrameError(
                f"{dtype}{shape} needs {count * itemsize} bytes, the buffer has {nbytes}"
            )
        if code == _EXT_NDARRAY:
            if dtype == "bfloat16":
                raise NotMsgpackError("numpy has no bfloat16; send a torch tensor instead")
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
        import torch  # the peer sent a tensor, so the receiving side needs torch

        if count == 0:  # an empty byte tensor cannot be viewed as a wider dtype
            return torch.empty(shape, dtype=getattr(torch, dtype))
        bytes_view = np.frombuffer(raw, dtype=np.uint8)
        if not bytes_view.flags.writeable:
            # NOTE: torch cannot hold read-only memory; one copy keeps the tensor writable.
            bytes_view = bytes_view.copy()
        flat = torch.from_numpy(bytes_view)
        return flat.view(getattr(torch, dtype)).reshape(shape)


def _check_shape(shape: list[int], itemsize: int) -> None:
    """Refuse a tensor/array shape that numpy could not hold, the same for tensors and
    arrays (torch would make an empty tensor of ``[0, 2**63 - 1]``; numpy refuses it).

    Raises:
        NotMsgpackError: too many dimensions, or the non-zero dimensions span more bytes
            than an array can.
    """
    if len(shape) > MAX_DIMS:
        raise NotMsgpackError(
            f"a tensor/array of {len(shape)} dimensions (at most {MAX_DIMS}) is malformed"
        )
    span = itemsize
    for d in shape:
        if d:
            span *= d
            if span > _MAX_SPAN_BYTES:
                raise NotMsgpackError(
                    f"tensor/array shape {shape} is too large: its non-zero dimensions span "
                    f"more than {_MAX_SPAN_BYTES} bytes"
                )


def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    return int(np.dtype(dtype).itemsize)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# -- validators compiled from type hints --------------------------------------------------------


def _compile(hint: Any, registry: MessageRegistry) -> Validator:
    """Build a function that checks (and where needed converts) a decoded value."""
    if hint is Any or hint is object:
        return _identity
    if hint is type(None) or hint is None:
        return _exact(type(None), "None")
    if hint is bool:
        return _exact(bool, "bool")
    if hint is int:
        return _exact(int, "int")
    if hint is str:
        return _exact(str, "str")
    if hint is float:
        return _float
    if hint is bytes:
        return _bytes
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return _union([_compile(arg, registry) for arg in args], hint)
    if origin is typing.Literal:
        return _literal(args)
    if origin in (list, Sequence, tuple) or hint in (list, tuple):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return _fixed_tuple([_compile(arg, registry) for arg in args])
        item = _compile(args[0], registry) if args else _identity
        return _sequence(
            item, to_tuple=origin is tuple or hint is tuple, item_hint=args[0] if args else Any
        )
    if origin in (dict, Mapping) or hint is dict:
        key = _compile(args[0], registry) if args else _identity
        value = _compile(args[1], registry) if args else _identity
        return _mapping(key, value)
    if isinstance(hint, type):
        if issubclass(hint, enum.Enum):
            return _enum(hint)
        if dataclasses.is_dataclass(hint):
            return _instance(hint)
        if hint.__module__ == "numpy" and hint.__name__ == "ndarray":
            return _instance(hint)
        if hint.__module__.startswith("torch") and hint.__name__ == "Tensor":
            return _instance(hint)
    raise TypeError(f"the codec does not support the type hint {hint!r}")


def _identity(value: Any) -> Any:
    return value


def _exact(kind: type, label: str) -> Validator:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise _Invalid(f"expected {label}, got {type(value).__name__}")
        return value

    return check


def _float(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        return float(value)
    raise _Invalid(f"expected float, got {kind.__name__}")


def _bytes(value: Any) -> bytes:
    if type(value) is bytes:
        return value
    raise _Invalid(f"expected bytes, got {type(value).__name__}")


def _union(options: list[Validator], hint: Any) -> Validator:
    def check(value: Any) -> Any:
        for option in options:
            try:
                return option(value)
            except _Invalid:
                continue
        raise _Invalid(f"expected {hint}, got {type(value).__name__}")

    return check


def _literal(allowed: tuple[Any, ...]) -> Validator:
    def check(value: Any) -> Any:
        if value not in allowed or type(value) not in {type(a) for a in allowed}:
            raise _Invalid(f"expected one of {allowed!r}, got {value!r}")
        return value

    return check


def _sequence(item: Validator, *, to_tuple: bool, item_hint: Any) -> Validator:
    fast_kind = item_hint if item_hint in (int, str, bool) else None

    def check(value: Any) -> Any:
        if type(value) is not list:
            raise _Invalid(f"expected a list, got {type(value).__name__}")
        if fast_kind is not None:
            for element in value:
                if type(element) is not fast_kind:
                    raise _Invalid(
                        f"expected {fast_kind.__name__} items, got {type(element).__name__}"
                    )
            return tuple(value) if to_tuple else value
        converted = [item(element) for element in value]
        return tuple(converted) if to_tuple else converted

    return check


def _fixed_tuple(items: list[Validator]) -> Validator:
    def check(value: Any) -> Any:
        if type(value) is not list or len(value) != len(items):
            raise _Invalid(f"expected a list of {len(items)} items")
        return tuple(validate(v) for validate, v in zip(items, value))

    return check


def _mapping(key: Validator, value_check: Validator) -> Validator:
    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        return {key(k): value_check(v) for k, v in value.items()}

    return check


def _enum(kind: type[enum.Enum]) -> Validator:
    def check(value: Any) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise _Invalid(f"{value!r} is not a valid {kind.__name__}") from None

    return check


def _instance(kind: type) -> Validator:
    def check(value: Any) -> Any:
        if not isinstance(value, kind):
            raise _Invalid(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return check
