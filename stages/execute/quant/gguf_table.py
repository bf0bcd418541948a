"""A GGUF file's tensor table, read without torch (the GGUF format: ``ggml/docs/gguf.md``;
header, metadata skipped but for the architecture and alignment, tensor infos), so the model
cache can size a conversion and refuse a damaged file before anything heavy is imported
(:mod:`stages.models`; :mod:`stages.execute.quant.gguf` maps the table to a model's
parameters; docs/architecture.md §6.3)."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

__all__ = ["GGUF_TYPES", "GGUFTensor", "read_tensor_table"]

#: the GGML tensor types run as they are, by GGML type number (ggml.h: enum ggml_type)
GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12}
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # size by type
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the table: its GGML type, dims (``ne``, innermost first) and the byte
    offset of its data in the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


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
            else:
                for _ in range(count):
                    self.skip(element)
        elif value_type in _SCALARS:
            self.at += _SCALARS[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


def read_tensor_table(data: Any) -> tuple[str, list[GGUFTensor]]:
    """The architecture and tensor table of a GGUF file's bytes (a buffer); offsets are
    absolute.

    Raises:
        ValueError: not a GGUF file this reads (version 2 or 3).
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
    return architecture, tensors
