"""What the model runner decides once, at load: the device and dtype, the KV cache's one
layer shape, the decode attention mode, the key its load-time checks are remembered under, and
the probe that checks paged attention against the model's own before any request runs.

Pure functions of their arguments (the runner, :mod:`stages.execute.runner`, holds the state);
kept apart from the runner so that file is the step, not the load.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from pathlib import Path
from typing import Any, cast

import torch

from stages.execute.allocator import BlockAllocator
from stages.execute.attention import (
    DecodeAttentionMode,
    KVCache,
    LayerShape,
    UnsupportedModelError,
    build_step_metadata,
    forward_context,
)
from stages.execute.bf16 import bf16_gemm_kernel, choose_cpu_dtype, cpu_flags
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.native import fused_ops_kernel, packed_gemm_kernel, paged_decode_kernel
from stages.execute.probe_cache import probe_key
from stages.execute.step_graph import step_graph_library

__all__ = [
    "PROBE_REQUEST",
    "PROBE_TOKENS",
    "check_paged_attention",
    "decode_mode",
    "layer_shape",
    "load_key",
    "probe_token_ids",
    "resolve_device",
    "resolve_dtype",
    "resolve_kv_dtype",
]

logger = logging.getLogger("actorline.execute")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the load-time probe: tokens computed as prefill, prefix chunk and decode, checked against
#: the model's own attention
PROBE_TOKENS = 8
#: the probe's request id in the allocator (no engine request can take it: ids are checked)
PROBE_REQUEST = "__actorline_probe__"
# relative tolerance on the probe's logits per dtype (of the weights)
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def resolve_device(device: str) -> torch.device:
    """``ExecuteConfig.device`` as a torch device (``auto``: CUDA where there is one).

    Raises:
        ExecuteConfigError: CUDA asked for where there is none.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ExecuteConfigError("device", f"is {device!r} but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; ``auto``: on CPU what :func:`stages.execute.bf16.
    choose_cpu_dtype` picks for this CPU (logged with its reason), elsewhere the checkpoint's."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        chosen, reason = choose_cpu_dtype(cpu_flags(), bf16_gemm_kernel())
        logger.info("execute: dtype auto -> %s: %s", chosen, reason)
        return _DTYPES[chosen]
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str) and declared in _DTYPES:
        return _DTYPES[declared]
    return torch.float32


def resolve_kv_dtype(requested: str, dtype: torch.dtype, bf16_weights: bool) -> torch.dtype:
    """``kv_cache_dtype`` as a torch dtype: ``auto`` is the model's dtype (``dtype``, the
    activations'), which for native bf16 weights on CPU is bf16 (their activations are fp32;
    vLLM's ``auto`` is the model's dtype too, vllm/utils/torch_utils.py
    ``kv_cache_dtype_str_to_dtype``)."""
    if requested != "auto":
        return _DTYPES[requested]
    return torch.bfloat16 if bf16_weights else dtype


def decode_mode(requested: str, device: torch.device, native_fits: bool) -> DecodeAttentionMode:
    """Resolve ``ExecuteConfig.decode_attention``; ``native_fits``: the model's dtype, device
    and head shapes are ones the native kernel serves.

    Raises:
        ExecuteConfigError: ``native`` asked for where it cannot run.
    """
    if requested == "native" or (requested == "auto" and native_fits):
        if not native_fits:
            raise ExecuteConfigError(
                "decode_attention",
                "'native' serves fp32 models on CPU with head_dim a multiple of 8 (<= 256) "
                "and at most 16 query heads per KV head",
            )
        if paged_decode_kernel() is not None:
            return "native"
        if requested == "native":
            raise ExecuteConfigError(
                "decode_attention",
                "'native' is unavailable: the kernel could not be built (see the log)",
            )
    if requested == "auto":
        # NOTE: on a GPU one padded call is best; CPU caches favour length groups.
        return "padded" if device.type == "cuda" else "grouped"
    return cast(DecodeAttentionMode, requested)


def layer_shape(layers: dict[int, LayerShape], text_config: Any) -> LayerShape:
    """The one shape every layer's KV cache takes, read from the modules' attention calls.

    Raises:
        UnsupportedModelError: the layers do not all call attention, or differ in KV heads
            or head size (the cache holds one shape for all).
    """
    num_layers = int(text_config.num_hidden_layers)
    if sorted(layers) != list(range(num_layers)):
        raise UnsupportedModelError(
            f"the model's config states {num_layers} layers but attention was called for "
            f"layers {sorted(layers)}; it does not route every layer's attention through "
            "transformers' attention interface"
        )
    shapes = {(s.num_heads, s.num_kv_heads, s.head_dim) for s in layers.values()}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            "the model's layers differ in (query heads, KV heads, head size): "
            f"{sorted(shapes)}; the paged KV cache holds one shape for every layer"
        )
    first = layers[0]
    stated_heads = int(getattr(text_config, "num_attention_heads", first.num_heads))
    stated_kv = int(getattr(text_config, "num_key_value_heads", None) or stated_heads)
    if (stated_heads, stated_kv) != (first.num_heads, first.num_kv_heads):
        logger.info(
            "execute: the config states %d query and %d KV heads, the attention modules have "
            "%d and %d; the KV cache follows the modules",
            stated_heads,
            stated_kv,
            first.num_heads,
            first.num_kv_heads,
        )
    return first


def load_key(
    config: ExecuteConfig,
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    bf16_weights: bool,
    rank: int,
) -> str:
    """The key under which a load's checks are remembered (stages.execute.probe_cache): the
    model, the library versions, the native kernels it uses and every setting that changes
    what runs."""
    libraries: list[Path] = []
    if device.type == "cpu":
        wanted = (
            (packed_gemm_kernel, config.cpu_linears and config.native_linears),
            (fused_ops_kernel, config.fused_ops),
            (paged_decode_kernel, config.decode_attention in ("auto", "native")),
            (bf16_gemm_kernel, bf16_weights),
        )
        for build, used in wanted:
            kernel = build() if used else None
            if kernel is not None:
                libraries.append(kernel.path)
        graph_library = step_graph_library() if config.use_cuda_graphs else None
        if graph_library is not None:
            libraries.append(graph_library.path)
    fields = (
        "cpu_linears",
        "native_linears",
        "fused_ops",
        "decode_attention",
        "attention_backend",
        "block_size",
        "max_model_len",
        "tensor_parallel_size",
        "quantization",
        "quant_activations",
        "model_impl",
        "use_cuda_graphs",
    )
    versions = {
        "python": sys.version,
        "torch": torch.__version__,
        "transformers": _library_version("transformers"),
    }
    settings_used: dict[str, object] = {name: getattr(config, name) for name in fields}
    settings_used.update(dtype=str(dtype), bf16_weights=bf16_weights, device=str(device), rank=rank)
    return probe_key(model_dir, versions, libraries, settings_used)


def probe_token_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The probe's ``[1, PROBE_TOKENS]`` token ids (spread over the vocabulary)."""
    return torch.tensor(
        [[(17 * index + 3) % vocab_size for index in range(PROBE_TOKENS)]], device=device
    )


def check_paged_attention(
    model: Any,
    kv_cache: KVCache,
    allocator: BlockAllocator,
    input_ids: torch.Tensor,
    expected: torch.Tensor,
    *,
    num_layers: int,
    decode_attention: DecodeAttentionMode,
    flex: bool,
    max_model_len: int,
    device: torch.device,
    weights_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    rounded_inputs: bool = False,
) -> None:
    """Check paged attention (``model`` is switched to it, its cache in ``kv_dtype``) against
    the model's own attention (``expected`` logits of ``input_ids [1, PROBE_TOKENS]``) on the
    same tokens, run as a prefill, a prefix chunk and a decode step. ``rounded_inputs``: the
    linears round their inputs (int8 activations, Q8_0 steps of max|x| / 127 per 32 inputs),
    so float noise between the two attention paths can flip a rounding, as with bf16: bf16's
    tolerance (the default model's Q4_1 GGUF with int8 activations, an AVX2 CPU: 0.677).

    Raises:
        UnsupportedModelError: a layer does not call paged attention, or the logits disagree
            beyond ``weights_dtype``'s tolerance.
    """
    allocator.allocate(PROBE_REQUEST, PROBE_TOKENS)
    table = allocator.block_table(PROBE_REQUEST)
    try:
        pieces = ((0, 4), (4, PROBE_TOKENS - 1), (PROBE_TOKENS - 1, PROBE_TOKENS))
        for start, end in pieces:
            metadata, positions = build_step_metadata(
                kv_cache=kv_cache,
                block_tables=[table],
                query_starts=[start],
                query_lens=[end - start],
                num_decode=1 if end - start == 1 else 0,
                decode_mode=decode_attention,
                flex=flex,
                max_model_len=max_model_len,
                device=device,
            )
            with torch.inference_mode(), forward_context(metadata):
                logits = model(
                    input_ids=input_ids[:, start:end],
                    position_ids=positions.unsqueeze(0),
                    use_cache=False,
                ).logits[0]  # [n, V]
            if metadata.calls != num_layers:
                raise UnsupportedModelError(
                    f"{type(model).__name__} called paged attention {metadata.calls} "
                    f"times for {num_layers} layers; it does not route every layer's "
                    "attention through transformers' attention interface"
                )
            reference = expected[start:end]
            # NOTE: bf16 weights round the activations to bf16 at each linear, so float
            # noise between two attention paths can flip a rounding: bf16's tolerance. A
            # cache in another dtype than the activations rounds K/V (the model's own
            # attention does not): the looser of the two.
            tolerance = max(
                _PROBE_TOLERANCE.get(weights_dtype, 5e-2),
                _PROBE_TOLERANCE.get(kv_dtype, 5e-2) if kv_dtype != weights_dtype else 0,
                _PROBE_TOLERANCE[torch.bfloat16] if rounded_inputs else 0,
            )
            error = (logits.float() - reference).abs().max().item()
            scale = max(reference.abs().max().item(), 1.0)
            if not error <= tolerance * scale:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: paged attention disagrees with the model's "
                    f"own attention (max logit error {error:.3g} at positions "
                    f"{start}..{end - 1}); the model needs an attention feature this path "
                    "does not implement"
                )
    finally:
        allocator.free(PROBE_REQUEST)


def _library_version(name: str) -> str:
    """An installed distribution's version, read without importing it (transformers' import
    takes seconds, and an engine serving a native model never needs it)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
