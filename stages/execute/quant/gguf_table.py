"""A GGUF file's tensor table, read without torch (the GGUF format: ``ggml/docs/gguf.md``;
header, metadata skipped but for the architecture and alignment, tensor infos), so the model
cache can size a conversion and refuse a damaged file before anything heavy is imported
(:mod:`stages.models`; :mod:`stages.execute.quant.gguf` maps the table to a model's
parameters; docs/architecture.md §6.3)."""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

__all__ = ["GGUF_TYPES", "GGUFTensor", "read_tensor_table"]

#: the GGML tensor types run as they are, by GGML type number (ggml.h: enum ggml_type)
GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12}
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # size by type
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")
#: GGML type number → (elements a block, bytes a block) (ggml.c: type_traits; gguf-py's
#: GGML_QUANT_SIZES); a type not here is not size-checked
_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the table: its GGML type, dims (``ne``, innermost first) and the byte
    offset of its data in the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int | None:
        """The bytes of its data in the file; None for a GGML type not known here."""
        block = _BLOCKS.get(self.ggml_type)
        if block is None:
            return None
        elements, size = block
        return -(-math.prod(self.dims) // elements) * size


class _Cursor:
    def __init__(self, data: Any) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        text = bytes(self.data[self.at : self.at + length]).decode("utf-8", "replace")
        self.at += length
        return text

    def skip(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.take("<Q")  # NOTE: not `self.at += self.take(...)`: take moves at
            self.at += length
        elif value_type == _ARRAY:
            element, count = self.take("<I"), self.take("<Q")
            if element in _SCALARS:
                self.at += _SCALARS[element] * count
            elif element == _STRING:  # a vocabulary: tens of thousands, so one tight loop
                data, at, length = self.data, self.at, _U64.unpack_from
                for _ in range(count):
                    at += 8 + length(data, at)[0]
                self.at = at
            else:
                for _ in range(count):
                    self.skip(element)
        elif value_type in _SCALARS:
            self.at += _SCALARS[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


def read_tensor_table(data: Any) -> tuple[str, list[GGUFTensor]]:
    """The architecture and tensor table of a GGUF file's bytes (a buffer, the whole file);
    offsets are absolute. Every tensor's data is checked to lie within the buffer, so a
    truncated file is refused here, before anything reads (or dequantizes) its tensors.

    Raises:
        ValueError: not a GGUF file this reads (version 2 or 3), or a truncated one.
    """
    cursor = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read here (2 or 3)")
    count, kv_count = cursor.take("<Q"), cursor.take("<Q")
    architecture, alignment = "", _DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key, value_type = cursor.string(), cursor.take("<I")
        if key == "general.architecture" and value_type == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and value_type == 4:
            alignment = cursor.take("<I")
        else:
            cursor.skip(value_type)
    infos = []
    for _ in range(count):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        infos.append((name, cursor.take("<I"), dims, cursor.take("<Q")))
    start = -(-cursor.at // alignment) * alignment
    tensors = [GGUFTensor(name, kind, dims, start + at) for name, kind, dims, at in infos]
    _check_extents(tensors, len(data))
    return architecture, tensors


def _check_extents(tensors: list[GGUFTensor], size: int) -> None:
    """Raises ValueError naming the first tensor whose data runs past the file's ``size``
    bytes (a truncated file)."""
    for tensor in tensors:
        nbytes = tensor.nbytes
        end = tensor.offset + (nbytes or 0)
        if end > size:
            raise ValueError(
                f"the file is truncated: tensor {tensor.name!r} ends at byte {end} but the "
                f"file has {size} bytes"
            )
