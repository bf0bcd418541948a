"""Paged attention for HF transformers models, plugged in through transformers' attention
interface, over a token-major paged KV cache.

The model runs on a packed batch: ``input_ids [1, T]`` holds every scheduled token of every
sequence, with explicit ``position_ids`` and ``use_cache=False``. transformers projects
q/k/v, applies RoPE and calls :func:`paged_attention_forward` for each layer with
``query [1, Hq, T, D]`` and ``key``/``value [1, Hkv, T, D]``. The function reads the step's
:class:`StepMetadata` from a forward context (never from kwargs), writes the step's K/V into
the cache and attends:

- **decode rows** (one query token each) come first in the packed batch, ordered by context
  length. On CPU in fp32 ("native", the default there) one call of the compiled kernel of
  :mod:`stages.execute.native` attends them all, reading keys and values in place through
  the block tables (an fp32 or a bf16 cache). Otherwise ("grouped", "padded",
  "per_sequence") they are attended in groups, each one batched SDPA call over the group's
  padded context (whole blocks gathered with one ``index_select``, a length mask for uneven
  rows), viewing each query ``[Hq]`` as ``[Hkv, Hq/Hkv]`` so GQA needs no key expansion. One
  group over the whole batch ("padded") has static shapes for a padded batch size and is what
  CUDA graphs capture; on CPU, big or uneven batches are split into smaller groups (down to one
  per sequence), which keeps the gathered keys in cache (see :func:`plan_decode_groups`).
- **prefill rows** (chunks, prefix hits) are attended per sequence with a causal mask aligned
  lower-right: the queries are the *last* ``n`` of the ``L`` context positions.
- with ``attention_backend="flex"`` (``build_step_metadata(flex=True)``), the decode rows and
  each prefill chunk over a cached prefix are attended by FlexAttention reading the cache in
  place through their block tables instead (:mod:`stages.execute.flex`; docs/architecture.md
  §6.4); a chunk that is its whole context keeps causal SDPA over its own keys.

The cache may hold another dtype than the activations (``kv_cache_dtype``: bf16 under native
bf16 weights' fp32 activations): K/V are rounded to it as they are written and widened back as
they are read, and a prefill chunk's own fresh keys are rounded the same way, so a prompt
computed whole and one that reads its prefix back from the cache see the same keys
(docs/architecture.md §3.1).

Every path also serves the variants of :mod:`stages.execute.variants` (docs/architecture.md
§6.1): a layer's sliding window masks keys before it (and a windowed prefill
gathers only the blocks from the window's start on, so blocks freed behind the window are
never read), soft-capped scores and sinks go through :func:`~stages.execute.variants.
eager_attention` on the torch paths and through the kernel's own arguments natively. The
masks a window needs are built once per step and window (the first layer that asks) and
shared by the layers with that window.

Follows vLLM's transformers backend (``vllm/model_executor/models/transformers/``: the
function registered in ``ALL_ATTENTION_FUNCTIONS`` that reads a forward context) and the
token-major cache and precomputed index tensors of transformers' continuous batching
(``transformers/generation/continuous_batching/cache.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import mmap
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from stages.execute.allocator import RESERVED_BLOCK_ID
from stages.execute.cpu import prefault_pages
from stages.execute.flex import FlexRows, flex_paged_attention
from stages.execute.native import PagedDecodeKernel, paged_decode_kernel
from stages.execute.variants import (
    LayerVariant,
    UnsupportedModelError,
    causal_window_mask,
    eager_attention,
    key_window_mask,
    layer_variant,
)

__all__ = [
    "ATTENTION_NAME",
    "DECODE_ATTENTION_MODES",
    "DecodeAttentionMode",
    "DecodeGroup",
    "KVCache",
    "LayerShape",
    "PrefillSequence",
    "StepMetadata",
    "UnsupportedModelError",
    "build_step_metadata",
    "check_model_config",
    "enable_paged_attention",
    "forward_context",
    "gather_blocks",
    "key_padding_mask",
    "paged_attention_forward",
    "plan_decode_groups",
    "prefill_in_bf16",
    "survey_layers",
]

ATTENTION_NAME = "actorline_paged"
"""The name the paged attention function is registered under in transformers."""

DecodeAttentionMode = Literal["native", "grouped", "padded", "per_sequence"]
DECODE_ATTENTION_MODES: tuple[str, ...] = ("native", "grouped", "padded", "per_sequence")

# NOTE: measured per layer on a 2-core CPU, SmolLM2-135M shapes (9 query / 3 KV heads, D 64),
# one thread. A loop per sequence costs ~0.1 ms per sequence; one padded call over a big batch
# gathers megabytes of keys that fall out of cache (B=32 x 1500: 27 ms padded vs 19 ms loop;
# B=64 x 20..1000: padded ~5x slower than a loop). Groups of <= 4096 padded keys were the best
# or near it in every case tried: B=64 x 200: 5.9 ms vs 9.6 loop; B=256 x 100: 11 vs 28;
# B=64 x 64: 1.2 vs 6.0; B=32 x 1500: 17 vs 19; B=128 x 500: 25 vs 32.
# "grouped" splits the length-sorted batch into padded groups bounded by these two limits.
AUTO_GROUP_MAX_KEYS = 4096  # padded keys (rows x longest context) per group
AUTO_GROUP_MAX_PADDING = 1.5  # max length / min length within a group


@dataclasses.dataclass(slots=True)
class KVCache:
    """The paged KV cache: per layer, keys and values token-major ``[num_slots, Hkv, D]``
    where slot ``block_id * block_size + offset`` holds one token. Block 0 is the reserved
    trash block padding tokens write to."""

    key: list[torch.Tensor]  # per layer [num_slots, Hkv, D]
    value: list[torch.Tensor]  # per layer [num_slots, Hkv, D]
    block_size: int
    # The CPU cache's whole mapping until prefault() hands it to its thread.
    unfaulted: torch.Tensor | None = None
    # Prefill attention in bf16 (see prefill_in_bf16): q rounded to bf16 and attended over
    # the bf16 keys and values as they are, the output widened back to the activations' fp32.
    bf16_prefill: bool = False

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Zero-filled cache of ``num_blocks`` blocks (including block 0) per layer.

        On CPU every layer's keys and values are views of one anonymous ``mmap``: the OS maps
        its pages on first write, zeroed, so start-up waits for none of it (``torch.zeros``
        writes every byte: ~0.5 s for the default 384 MiB here); :meth:`prefault` later
        faults the rest in off the steps' path.

        NOTE: in 4 KiB pages, not transparent huge pages. numpy's ``zeros`` (which this used)
        ``madvise``s large buffers ``MADV_HUGEPAGE``, and then each first write to a 2 MiB
        region faults in a huge page the kernel must find and zero: 4-5 ms a fault on this
        machine kind, so a model's first token paid one per layer's keys and values (60 for
        SmolLM2-135M: 0.24-0.32 s), and every ~2,700 tokens of one layer's cache another. In
        4 KiB pages the first token's writes cost 0.4 ms and 800 KiB more of each of the 60
        tensors 13 ms, against 2 ms plus the faults; reading them back costs the same
        (docs/performance.md §3).
        """
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        if device.type == "cpu":
            element = torch.empty((), dtype=dtype).element_size()
            size = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * element
            pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            flat = torch.frombuffer(pages, dtype=dtype)
            buffer = flat.view(2, num_layers, *shape)
            return cls(list(buffer[0]), list(buffer[1]), block_size, unfaulted=flat)
        key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(key=key, value=value, block_size=block_size)

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers (keys and values)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @property
    def num_slots(self) -> int:
        return int(self.key[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))

    def prefault(self) -> None:
        """Fault the CPU cache's pages in on a daemon thread (once; nothing on CUDA). The
        runner calls it after its first step, so that neither loading nor the first token
        shares the CPU with it. Left to the steps, each 4 KiB page's first write (every ~5
        tokens of a sequence, per layer's keys and values) stalls the step's
        ``index_copy_``: 0.2-0.5 s of the offline benchmark's decode, 0.09 s with the pages
        present (docs/performance.md §4). The whole cache is then resident, as vLLM's is."""
        if self.unfaulted is not None:
            prefault_pages(self.unfaulted)
            self.unfaulted = None


@dataclasses.dataclass(slots=True)
class DecodeGroup:
    """Decode rows ``[start, end)`` of the packed batch attended in one SDPA call, over the
    first ``key_len`` positions of the blocks in ``key_blocks``."""

    start: int
    end: int
    key_blocks: torch.Tensor  # [end - start, num_blocks] block ids, padded with block 0
    key_len: int  # key positions attended (<= num_blocks * block_size)
    key_mask: torch.Tensor | None  # [end - start, 1, 1, key_len] bool; None: no padding
    # "native" mode: each row's context length [end - start] int64; the kernel reads exactly
    # that many positions of its blocks (key_len and key_mask unused).
    context_lens: torch.Tensor | None = None
    # Each row's context length on the attention's device [end - start]: windowed layers
    # build their key masks from it (None: taken from context_lens).
    lengths: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The key mask of a layer with this window (built once per step and window)."""
        if window is None:
            return self.key_mask
        mask = self.window_masks.get(window)
        if mask is None:
            lengths = self.lengths if self.lengths is not None else self.context_lens
            assert lengths is not None, "a decode group knows its rows' context lengths"
            mask = self.window_masks[window] = key_window_mask(lengths, self.key_len, window)
        return mask


@dataclasses.dataclass(slots=True)
class PrefillSequence:
    """A multi-token chunk at packed rows ``[query_start, query_end)`` whose context is its
    first ``context_len`` positions (the queries are the last ``query_end - query_start``)."""

    query_start: int
    query_end: int
    context_len: int
    # None when the chunk is the whole context (attend to this step's k/v directly).
    key_blocks: torch.Tensor | None  # [ceil(context_len / block_size)]
    causal_mask: torch.Tensor | None  # [n, context_len] bool, lower-right aligned
    # window -> (first block of key_blocks read, mask over the keys from that block on)
    windows: dict[int, tuple[int, torch.Tensor]] = dataclasses.field(default_factory=dict)
    # attention_backend "flex" with a cached prefix: the chunk's row, read in place.
    flex: FlexRows | None = None

    def window_keys(
        self, window: int, block_size: int, device: torch.device
    ) -> tuple[int, torch.Tensor]:
        """For a layer with this window: the first of ``key_blocks`` its queries read (the
        ones before lie wholly behind the window, maybe freed) and the ``[n, keys]`` mask over
        the keys from that block on (``key_blocks`` None: over this step's keys)."""
        entry = self.windows.get(window)
        if entry is None:
            count = self.query_end - self.query_start
            first_query = self.context_len - count
            first_block = 0
            if self.key_blocks is not None:
                first_block = max(0, first_query - window + 1) // block_size
            first_key = first_block * block_size if self.key_blocks is not None else first_query
            mask = causal_window_mask(
                count, first_query, self.context_len - first_key, first_key, window, device
            )
            entry = self.windows[window] = (first_block, mask)
        return entry


@dataclasses.dataclass(slots=True)
class StepMetadata:
    """Everything the attention layers need for one packed forward pass; built once per
    step and shared by all layers."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot each packed token writes its K/V to
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSequence]
    max_model_len: int
    # Set in "native" mode: the kernel attending the decode groups.
    decode_kernel: PagedDecodeKernel | None = None
    # attention_backend "flex": the decode rows (the first rows of the packed batch), attended
    # by FlexAttention in place (stages.execute.flex); decode_groups is then empty.
    flex_decode: FlexRows | None = None
    # Counts attention calls (one per layer): the load-time probe checks every layer came.
    calls: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class LayerShape:
    """What one layer's attention call shows of it: head counts and size (as the modules
    have them, whatever the config states), its variant and the dtype of its keys."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    softcap: float | None
    has_sinks: bool
    dtype: torch.dtype


@dataclasses.dataclass(slots=True)
class _Survey:
    """The forward context of :func:`survey_layers`: records each layer's call."""

    max_model_len: int
    layers: dict[int, LayerShape] = dataclasses.field(default_factory=dict)
    calls: int = 0


_FORWARD_CONTEXT: contextvars.ContextVar[StepMetadata | _Survey | None] = contextvars.ContextVar(
    "actorline_paged_attention_metadata", default=None
)


@contextlib.contextmanager
def forward_context(metadata: StepMetadata) -> Iterator[StepMetadata]:
    """Make ``metadata`` visible to :func:`paged_attention_forward` during a forward pass
    (per thread: the context is a ``ContextVar``)."""
    token = _FORWARD_CONTEXT.set(metadata)
    try:
        yield metadata
    finally:
        _FORWARD_CONTEXT.reset(token)


def survey_layers(model: Any, input_ids: torch.Tensor, max_model_len: int) -> dict[int, LayerShape]:
    """Run ``model`` (switched to paged attention) once over ``input_ids [1, T]`` recording
    each layer's attention call instead of attending (outputs are zeros, the logits
    meaningless): the shapes the KV cache must have, read from the modules rather than the
    config (a config may state head counts its modules do not have), and the variants.

    Returns:
        ``{layer_idx: LayerShape}`` for every layer that called attention.

    Raises:
        UnsupportedModelError: a layer passes an attention feature the paged path lacks, or
            has no integer ``layer_idx``.
    """
    survey = _Survey(max_model_len)
    token = _FORWARD_CONTEXT.set(survey)
    try:
        with torch.inference_mode():
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            model(input_ids=input_ids, position_ids=positions, use_cache=False)
    finally:
        _FORWARD_CONTEXT.reset(token)
    return survey.layers


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for every layer (see the module docstring).

    Returns:
        ``(attn_output [1, T, Hq, D], None)``.

    Raises:
        RuntimeError: called outside :func:`forward_context`.
        UnsupportedModelError: the model passes an attention feature this path ignores.
    """
    metadata = _FORWARD_CONTEXT.get()
    if metadata is None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention called outside forward_context(); the model must be "
            "run by the execute stage's runner"
        )
    variant = layer_variant(kwargs, metadata.max_model_len)
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise UnsupportedModelError(
            f"attention module {type(module).__name__} has no integer layer_idx"
        )
    metadata.calls += 1
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    if isinstance(metadata, _Survey):
        metadata.layers[layer] = LayerShape(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            window=variant.window,
            softcap=variant.softcap,
            has_sinks=variant.sinks is not None,
            dtype=key.dtype,
        )
        return query.new_zeros(1, num_tokens, num_heads, head_dim), None
    key_cache = metadata.kv_cache.key[layer]  # [num_slots, Hkv, D]
    value_cache = metadata.kv_cache.value[layer]  # [num_slots, Hkv, D]
    group_size = num_heads // num_kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5

    # Write this step's K/V first, so reads below see the whole context. NOTE: the cache may
    # hold another dtype than the activations (kv_cache_dtype: bf16 under fp32 activations):
    # K/V are rounded to it as they are written, and every read below widens what it reads
    # back to the query's dtype, so the arithmetic stays in the activations' precision.
    cache_dtype = key_cache.dtype
    # [T, Hkv, D] as the cache holds them, rounded once: written, and attended by whole prompts
    key_rows = key[0].transpose(0, 1).to(cache_dtype)
    value_rows = value[0].transpose(0, 1).to(cache_dtype)
    key_cache.index_copy_(0, metadata.slot_mapping, key_rows)
    value_cache.index_copy_(0, metadata.slot_mapping, value_rows)

    block_size = metadata.kv_cache.block_size
    output = query.new_empty(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    kernel = metadata.decode_kernel
    window = variant.window
    if metadata.flex_decode is not None:
        rows = metadata.flex_decode.tables.shape[0]
        # NOTE: FlexAttention reads the cache layer in place, so its queries take the cache's
        # dtype (a bf16 cache under fp32 activations attends in bf16 here).
        attended = flex_paged_attention(
            query[0, :, :rows].transpose(0, 1).unsqueeze(2).to(cache_dtype),  # [B, Hq, 1, D]
            key_cache,
            value_cache,
            metadata.flex_decode,
            scale=scale,
            window=window,
            softcap=variant.softcap,
            sinks=variant.sinks,
        )  # [B, Hq, 1, D]
        output[:rows] = attended[:, :, 0].to(output.dtype)
    for group in metadata.decode_groups:
        if kernel is not None and group.context_lens is not None:
            sinks = variant.sinks.float().contiguous() if variant.sinks is not None else None
            kernel(
                query[0, :, group.start : group.end],  # [Hq, g, D]
                key_cache,
                value_cache,
                group.key_blocks,
                group.context_lens,
                output[group.start : group.end],  # [g, Hq, D]
                block_size,
                scale,
                window=window,
                softcap=variant.softcap,
                sinks=sinks,
            )
            continue
        rows = group.end - group.start
        # [Hq, g, D] -> [g, Hq, D] -> [g, Hkv, rep, D]: the query heads of one KV head become
        # the query axis, so one SDPA call serves GQA without expanding keys.
        group_query = query[0, :, group.start : group.end].transpose(0, 1)
        group_query = group_query.reshape(rows, num_kv_heads, group_size, head_dim)
        keys = gather_blocks(key_cache, group.key_blocks, block_size)  # [g, nb*bs, Hkv, D]
        values = gather_blocks(value_cache, group.key_blocks, block_size)
        group_keys = keys[:, : group.key_len].transpose(1, 2).to(query.dtype)  # [g, Hkv, L, D]
        group_values = values[:, : group.key_len].transpose(1, 2).to(query.dtype)
        if variant.needs_eager:
            attended = eager_attention(
                group_query,
                group_keys,
                group_values,
                group.mask(window),
                scale,
                variant.softcap,
                _sinks_view(variant, 1, num_kv_heads, group_size),
            )
        else:
            attended = F.scaled_dot_product_attention(
                group_query, group_keys, group_values, attn_mask=group.mask(window), scale=scale
            )  # [g, Hkv, rep, D]
        output[group.start : group.end] = attended.reshape(rows, num_heads, head_dim)
    bf16_prefill = metadata.kv_cache.bf16_prefill and cache_dtype == torch.bfloat16
    # bf16 prefill (KVCache.bf16_prefill): the keys and values stay in the cache's bf16 and
    # the query is rounded to it (once for the step's rows, each sequence a slice of it); the
    # variants that need eager attention stay fp32.
    low = bf16_prefill and not variant.needs_eager
    attend_dtype = cache_dtype if low else query.dtype
    low_query = query.to(cache_dtype) if low and metadata.prefills else query
    for sequence in metadata.prefills:
        start, end = sequence.query_start, sequence.query_end
        sequence_query = query[:, :, start:end]  # [1, Hq, n, D]
        count = end - start
        if sequence.flex is not None:
            attended = flex_paged_attention(
                sequence_query.to(cache_dtype),
                key_cache,
                value_cache,
                sequence.flex,
                scale=scale,
                window=window,
                softcap=variant.softcap,
                sinks=variant.sinks,
            )  # [1, Hq, n, D]
            output[start:end] = attended[0].transpose(0, 1).to(output.dtype)
            continue
        mask = sequence.causal_mask
        if window is not None and sequence.context_len > window:
            first_block, mask = sequence.window_keys(window, block_size, query.device)
        else:
            first_block = 0
        if sequence.key_blocks is None:
            keys, values = key[:, :, start:end], value[:, :, start:end]  # [1, Hkv, n, D]
            if cache_dtype != key.dtype:
                # NOTE: rounded as the cache holds them, so a prompt computed whole attends
                # the keys a prefix-cache hit on it would read back (the same tokens).
                keys = key_rows[start:end].transpose(0, 1).unsqueeze(0).to(attend_dtype)
                values = value_rows[start:end].transpose(0, 1).unsqueeze(0).to(attend_dtype)
        else:
            blocks = sequence.key_blocks[first_block:]
            length = sequence.context_len - first_block * block_size
            keys = gather_blocks(key_cache, blocks, block_size)[:length]  # [L, Hkv, D]
            values = gather_blocks(value_cache, blocks, block_size)[:length]
            keys, values = keys.to(attend_dtype), values.to(attend_dtype)
            keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            values = values.transpose(0, 1).unsqueeze(0)
        if low:
            sequence_query = low_query[:, :, start:end]
        if variant.needs_eager:
            if mask is None:  # the whole context, square: plain causal
                mask = causal_window_mask(count, 0, count, 0, None, query.device)
            attended = eager_attention(
                sequence_query.reshape(num_kv_heads, group_size, count, head_dim),
                keys.transpose(0, 1),  # [Hkv, 1, L, D]
                values.transpose(0, 1),
                mask,
                scale,
                variant.softcap,
                _sinks_view(variant, num_kv_heads, group_size, 1),
            ).view(1, num_heads, count, head_dim)
        else:
            attended = F.scaled_dot_product_attention(
                sequence_query,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,  # square: top-left and lower-right alignment agree
                scale=scale,
                enable_gqa=group_size > 1,
            )  # [1, Hq, n, D]
        output[start:end] = attended[0].transpose(0, 1)  # (widened back where bf16)
    return output.unsqueeze(0), None


def _sinks_view(variant: LayerVariant, *shape: int) -> torch.Tensor | None:
    """The layer's sinks ``[Hq]`` as ``[*shape, 1]`` (``shape`` multiplies to ``Hq`` with the
    KV-head axis first), or None."""
    if variant.sinks is None:
        return None
    return variant.sinks.reshape(*shape, 1)


def prefill_in_bf16(
    *, kv_dtype: torch.dtype, activations: torch.dtype, device: torch.device, native_bf16: bool
) -> bool:
    """Whether prefill attention runs in bf16 (:attr:`KVCache.bf16_prefill`): on CPU, for
    fp32 activations over a bf16 KV cache where the model's weights are bf16 and the CPU
    multiplies bf16 natively (``native_bf16``: the bf16 GEMM built on AVX512-BF16, so torch's
    bf16 flash attention runs on oneDNN's AVX512-BF16 or AMX kernels, not an emulation).

    The keys and values are then the cache's bf16 as they are (exactly what the fp32 path
    widens), the query is rounded to bf16 once and the attention output is rounded to bf16
    before it is widened back: the output projection rounds its input rows to bf16 anyway
    (``stages.execute.bf16``). Scores, softmax and accumulation are fp32 inside torch's
    kernel (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``: fp32 accumulators, the
    probabilities rounded to bf16 for the P·V product). 1.4-2.2x fp32's flash attention per
    call at 64-1,000-token prompts (docs/performance.md §12.2). Models with fp32 weights keep
    fp32 attention whatever their cache holds.
    """
    return (
        native_bf16
        and device.type == "cpu"
        and kv_dtype == torch.bfloat16
        and activations == torch.float32
    )


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Copy whole blocks out of a token-major cache layer.

    ``cache [num_slots, Hkv, D]`` viewed as ``[num_blocks, block_size, Hkv, D]``; ``blocks``
    any shape ``[..., nb]`` of block ids. One ``index_select`` of contiguous blocks, several
    times faster on CPU than indexing token by token.

    Returns:
        ``[..., nb * block_size, Hkv, D]``.
    """
    paged = cache.view(-1, block_size, *cache.shape[1:])  # [num_blocks, bs, Hkv, D]
    gathered = paged.index_select(0, blocks.reshape(-1))  # [prod(blocks.shape), bs, Hkv, D]
    return gathered.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


def key_padding_mask(context_lens: torch.Tensor, key_len: int) -> torch.Tensor:
    """Which of the first ``key_len`` positions each row attends to (its context).

    Pure tensor ops with static shapes (usable inside a CUDA graph).

    Returns:
        ``[B, 1, 1, key_len]`` bool.
    """
    positions = torch.arange(key_len, device=context_lens.device)  # [L]
    return (positions.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]


def plan_decode_groups(
    context_lens: Sequence[int], mode: DecodeAttentionMode
) -> list[tuple[int, int]]:
    """Split decode rows (sorted by ascending context length) into ``[start, end)`` groups.

    ``native`` and ``padded``: one group. ``per_sequence``: one group per row. ``grouped``:
    consecutive rows while the group's padded size stays under ``AUTO_GROUP_MAX_KEYS`` and its
    longest context under ``AUTO_GROUP_MAX_PADDING`` times its shortest.
    """
    count = len(context_lens)
    if count == 0:
        return []
    if mode in ("native", "padded"):
        return [(0, count)]
    if mode == "per_sequence":
        return [(row, row + 1) for row in range(count)]
    groups: list[tuple[int, int]] = []
    start = 0
    for row in range(1, count):
        length = context_lens[row]
        too_many_keys = (row - start + 1) * length > AUTO_GROUP_MAX_KEYS
        too_much_padding = length > AUTO_GROUP_MAX_PADDING * context_lens[start]
        if too_many_keys or too_much_padding:
            groups.append((start, row))
            start = row
    groups.append((start, count))
    return groups


def build_step_metadata(
    *,
    kv_cache: KVCache,
    block_tables: Sequence[Sequence[int]],
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    num_decode: int,
    decode_mode: DecodeAttentionMode,
    max_model_len: int,
    device: torch.device,
    flex: bool = False,
) -> tuple[StepMetadata, torch.Tensor]:
    """Build the step's attention metadata and packed positions, vectorized (no per-token
    Python work). With ``flex`` (``attention_backend="flex"``) the decode rows and every
    prefill chunk with a cached prefix are attended in place by :mod:`stages.execute.flex`
    (``decode_mode`` is then unused); a chunk that is its whole context still runs causal
    SDPA over its own keys, which gathers nothing.

    Sequence ``i`` computes positions ``[query_starts[i], query_starts[i] + query_lens[i])``
    and attends to all positions before its end; its K/V goes to the blocks of
    ``block_tables[i]``. The first ``num_decode`` sequences must have ``query_lens == 1`` and
    ascending context lengths (they are the decode rows).

    Returns:
        ``(metadata, position_ids [T])``.

    Raises:
        ValueError: inconsistent arguments.
    """
    num_sequences = len(query_lens)
    if not (len(block_tables) == len(query_starts) == num_sequences):
        raise ValueError("block_tables, query_starts and query_lens must have equal lengths")
    if any(length != 1 for length in query_lens[:num_decode]):
        raise ValueError("the first num_decode sequences must compute exactly one token")
    block_size = kv_cache.block_size
    context_lens = [start + length for start, length in zip(query_starts, query_lens, strict=True)]
    width = max((len(table) for table in block_tables), default=1)
    for table, context_len in zip(block_tables, context_lens, strict=True):
        if len(table) * block_size < context_len:
            raise ValueError(
                f"a block table of {len(table)} blocks cannot hold {context_len} tokens"
            )
    tables = torch.tensor(
        [[*table, *[RESERVED_BLOCK_ID] * (width - len(table))] for table in block_tables],
        dtype=torch.long,
    ).reshape(num_sequences, width)  # [R, max_blocks]
    starts = torch.tensor(query_starts, dtype=torch.long)  # [R]
    if num_decode == num_sequences:
        # NOTE: a decode-only step (each row one token: every step of a stream after its
        # prompt): a row's position is its start and its slot one lookup in its own table,
        # so the per-token index arithmetic below (ten small tensor ops) is not needed
        positions = starts  # [T == R]
        slot_mapping = torch.tensor(
            [
                table[start // block_size] * block_size + start % block_size
                for table, start in zip(block_tables, query_starts, strict=True)
            ],
            dtype=torch.long,
        )  # [T]
    else:
        num_tokens = sum(query_lens)
        lengths = torch.tensor(query_lens, dtype=torch.long)  # [R]
        row_of_token = torch.repeat_interleave(torch.arange(num_sequences), lengths)  # [T]
        first_token = torch.cumsum(lengths, 0) - lengths  # [R] packed index of each row start
        positions = (
            torch.arange(num_tokens) - first_token[row_of_token] + starts[row_of_token]
        )  # [T]
        slot_mapping = (
            tables[row_of_token, positions // block_size] * block_size + positions % block_size
        )  # [T]

    decode_groups: list[DecodeGroup] = []
    decode_lens = context_lens[:num_decode]
    native = decode_mode == "native" and not flex
    decode_kernel = paged_decode_kernel() if native else None
    if native and decode_kernel is None:
        raise ValueError("decode_mode 'native' needs the native kernel, which is unavailable")
    compiled = device.type == "cuda"  # the fused kernel; CPU runs FlexAttention eagerly
    flex_decode = None
    if flex and num_decode:
        flex_decode = FlexRows.build(
            tables[:num_decode, : -(-max(decode_lens) // block_size)].to(device),
            starts[:num_decode].to(device),
            1,
            block_size=block_size,
            num_slots=kv_cache.num_slots,
            compiled=compiled,
        )
    planned = [] if flex else plan_decode_groups(decode_lens, decode_mode)
    for group_start, group_end in planned:
        group_lens = decode_lens[group_start:group_end]
        longest = max(group_lens)
        num_blocks = -(-longest // block_size)
        if decode_kernel is not None:
            decode_groups.append(
                DecodeGroup(
                    start=group_start,
                    end=group_end,
                    key_blocks=tables[group_start:group_end, :num_blocks],
                    key_len=longest,
                    key_mask=None,
                    context_lens=torch.tensor(group_lens, dtype=torch.long),
                )
            )
            continue
        uniform = min(group_lens) == longest
        key_mask = None
        lens = torch.tensor(group_lens, dtype=torch.long).to(device)
        if not uniform:
            key_mask = key_padding_mask(lens, num_blocks * block_size)
        decode_groups.append(
            DecodeGroup(
                start=group_start,
                end=group_end,
                key_blocks=tables[group_start:group_end, :num_blocks].to(device),
                key_len=longest if uniform else num_blocks * block_size,
                key_mask=key_mask,
                lengths=lens,
            )
        )

    prefills: list[PrefillSequence] = []
    packed = sum(query_lens[:num_decode])
    for row in range(num_decode, num_sequences):
        length, start, context_len = query_lens[row], query_starts[row], context_lens[row]
        key_blocks: torch.Tensor | None = None
        causal_mask: torch.Tensor | None = None
        if start > 0 and flex:
            rows = FlexRows.build(
                tables[row : row + 1, : -(-context_len // block_size)].to(device),
                starts[row : row + 1].to(device),
                length,
                block_size=block_size,
                num_slots=kv_cache.num_slots,
                compiled=compiled,
            )
            prefills.append(
                PrefillSequence(packed, packed + length, context_len, None, None, flex=rows)
            )
            packed += length
            continue
        if start > 0:
            key_blocks = tables[row, : -(-context_len // block_size)].to(device)
            # Lower-right causal: query i (position start + i) sees keys 0 .. start + i.
            causal_mask = (
                torch.arange(context_len).unsqueeze(0) <= torch.arange(length).unsqueeze(1) + start
            ).to(device)  # [n, L]
        prefills.append(
            PrefillSequence(packed, packed + length, context_len, key_blocks, causal_mask)
        )
        packed += length

    metadata = StepMetadata(
        kv_cache=kv_cache,
        slot_mapping=slot_mapping.to(device),
        decode_groups=decode_groups,
        prefills=prefills,
        max_model_len=max_model_len,
        decode_kernel=decode_kernel,
        flex_decode=flex_decode,
    )
    return metadata, positions.to(device)


def check_model_config(config: Any, max_model_len: int | None = None) -> None:
    """Refuse, before loading weights, model configs whose attention the paged path cannot
    serve correctly. Sliding windows, soft-capped logits and sinks are served
    (:mod:`stages.execute.variants`); ``max_model_len`` is unused and kept for callers.

    Raises:
        UnsupportedModelError: naming the feature (MLA, ALiBi, encoder-decoder, layers of
            another kind than full or sliding-window attention).
    """
    del max_model_len
    model_type = getattr(config, "model_type", "?")

    def refuse(feature: str) -> None:
        raise UnsupportedModelError(
            f"model type {model_type!r} uses {feature}, which actorline's paged attention "
            "does not implement; refusing to serve it rather than produce wrong outputs"
        )

    if getattr(config, "is_encoder_decoder", False):
        refuse("an encoder-decoder architecture")
    layer_types = getattr(config, "layer_types", None)
    served = ("full_attention", "sliding_attention")
    if layer_types and any(kind not in served for kind in layer_types):
        other = sorted({kind for kind in layer_types if kind not in served})
        refuse(f"layers other than full or sliding-window attention ({other})")
    if getattr(config, "attention_chunk_size", None):
        refuse(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        refuse("multi-head latent attention (MLA)")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "") == (
        "alibi"
    ):
        refuse("ALiBi position biases")


def enable_paged_attention(model: Any) -> None:
    """Register :func:`paged_attention_forward` with transformers (idempotent) and switch
    ``model`` to it. The model's config must be its own (load it from its own config copy):
    models sharing a config object would all switch.

    Raises:
        UnsupportedModelError: the model class does not dispatch through the attention
            interface.
    """
    set_function = getattr(model, "set_attention_function", None)
    if callable(set_function):  # actorline's own model classes (stages.execute.llama)
        set_function(ATTENTION_NAME, paged_attention_forward)
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface, so paged attention cannot be plugged in"
        )
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise UnsupportedModelError(
            f"{type(model).__name__} refused the {ATTENTION_NAME!r} attention implementation"
        )
