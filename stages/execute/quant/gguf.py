"""A GGUF file's quantized tensors, as they are, for the HF model converted from it
(docs/architecture.md §6.3).

The engine loads a GGUF model as the HF checkpoint transformers converts it to (dequantized to
fp32 once and cached: :mod:`stages.models`). With ``quantization="gguf"`` its linears run on
the file's own blocks instead. This module reads the file's tensor table
(:mod:`stages.execute.quant.gguf_table`: far quicker than ``gguf.GGUFReader``, which builds
every metadata array, the tokenizer's included), maps each HF parameter to its tensor with the
gguf package's name map for the file's architecture (as
``transformers/modeling_gguf_pytorch_utils.py``'s ``get_gguf_hf_weights_map`` does), applies
Llama's q/k row permutation (transformers' ``LlamaTensorProcessor``: it moves whole rows, so
it holds for raw blocks too), and hands the raw blocks of Q8_0, Q4_0, Q4_1 and Q4_K to
:func:`~stages.execute.quant.layers.pack_gguf`. Other types (F32, F16, Q5, Q6_K, ...) are
left to the fp32 checkpoint.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.execute.quant.gguf_table import GGUF_TYPES, GGUFTensor, read_tensor_table
from stages.execute.quant.kernel import QuantGemmKernel
from stages.execute.quant.layers import QuantizedWeight, pack_gguf

__all__ = ["GGUF_TYPES", "GGUFTensor", "GGUFWeights", "file_layer_name", "read_tensor_table"]


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def file_layer_name(hf_name: str, layer_offset: int) -> str:
    """``hf_name`` with its decoder layer index moved up by ``layer_offset``
    (``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.15.mlp.up_proj.weight`` at 15):
    the name in the whole model of a pipeline shard's parameter."""
    if not layer_offset:
        return hf_name
    return _LAYER.sub(
        lambda match: f"{match.group(1)}layers.{int(match.group(2)) + layer_offset}.",
        hf_name,
        count=1,
    )


class GGUFWeights:
    """The quantized tensors of the GGUF file ``path`` for ``model`` (the HF model converted
    from it; with ``layer_offset``, a pipeline shard of it whose layer 0 is the whole
    model's layer ``layer_offset``).

    Raises:
        ValueError: the file cannot be read, or gguf knows no name map for its architecture.
    """

    def __init__(
        self, path: Path, model: Any, kernel: QuantGemmKernel, layer_offset: int = 0
    ) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        self.path = path
        self._kernel = kernel
        with path.open("rb") as handle:
            self._mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        architecture, tensors = read_tensor_table(self._mapping)
        arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
        if arch is None:
            raise ValueError(f"{path}: the gguf package knows no architecture {architecture!r}")
        num_layers = int(model.config.get_text_config().num_hidden_layers)
        name_map = get_tensor_name_map(arch, layer_offset + num_layers)
        by_name = {tensor.name: tensor for tensor in tensors}
        self._tensors: dict[str, GGUFTensor] = {}
        for hf_name in model.state_dict():
            # NOTE: a pipeline shard's layers are renumbered from 0 (cut_layers); the file
            # names them by their place in the whole model
            base, dot, suffix = file_layer_name(hf_name, layer_offset).rpartition(".")
            gguf_base = name_map.get_name(base) if dot else None
            tensor = by_name.get(f"{gguf_base}.{suffix}") if gguf_base else None
            if tensor is not None:
                self._tensors[hf_name] = tensor
        self._permute = (
            LlamaTensorProcessor(config=model.config.to_dict()) if architecture == "llama" else None
        )

    def tensor_type(self, names: Iterable[str]) -> int | None:
        """The GGML type of the first of ``names`` (one parameter's names, tied ones
        included) the file holds, or None."""
        tensor = self._find(names)
        return tensor.ggml_type if tensor is not None else None

    def quantized(self, names: Iterable[str]) -> QuantizedWeight | None:
        """The packed weight of the parameter called ``names``, or None when the file does
        not hold it as a 2-D tensor of a type run as it is (:data:`GGUF_TYPES`)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor = self._find(names)
        if tensor is None or tensor.ggml_type not in GGUF_TYPES.values() or len(tensor.dims) != 2:
            return None
        in_features, out_features = tensor.dims
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        row_bytes = in_features // block_size * type_size
        raw = np.frombuffer(
            self._mapping, dtype=np.uint8, count=row_bytes * out_features, offset=tensor.offset
        ).reshape(out_features, row_bytes)
        if self._permute is not None:  # Llama's q/k rows, as transformers reorders them
            raw = self._permute.process(weights=raw, name=tensor.name).weights
        rows = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the mapping is read-only
        return pack_gguf(rows, tensor.ggml_type, in_features, self._kernel)

    def _find(self, names: Iterable[str]) -> GGUFTensor | None:
        for name in names:
            tensor = self._tensors.get(name)
            if tensor is not None:
                return tensor
        return None
