"""The CPU step graph: a decode-only step of actorline's own Llama (every row one new token, up
to :func:`plan_rows` rows) run as ONE native call, ``kernels/step_graph.c`` — the CPU analogue of
the CUDA graphs of :mod:`stages.execute.cuda_graphs` (docs/architecture.md §6.5).

At one stream the module path's forward is mostly Python: ~15 module calls and as many ctypes
calls per layer, each a few microseconds, against a step whose weights take ~4 ms to read
(issue 36). The plan is recorded once at load: every layer's weights as
:class:`~stages.execute.native.NativeGemm` (whatever kind of linear: packed fp32, GGUF / int8
blocks, anything with ``native_gemm()``), its norms and KV cache tensors, the kernels of
``fused_cpu.c`` and ``paged_decode.c`` as function pointers, fp32 workspaces of ``max_rows``
rows, a rotary cos/sin table over every position, and small input buffers. The KV cache may
hold fp32 or bf16 (``kv_cache_dtype``): the C code rounds each new K/V row to the cache's type
as it writes it and calls the decode attention entry point that reads that type. A step fills the
input buffers (token ids, positions, block tables, the rows that sample) and makes one ctypes
call, which releases the GIL for its whole length. Unlike a CUDA graph nothing is captured per
batch size: the C executor takes the row count, so one plan serves every bucket up to
``max_rows``.

A step is one OpenMP region (``step_threaded`` in the C file): its threads stay alive across
the layers and claim chunks of each phase (columns of a linear through
:attr:`~stages.execute.native.NativeGemm.part`, (row, head) pairs of attention), a phase
starting once the one before it has finished; :attr:`StepGraph.threaded` ``False`` runs the
per-op form (a region per kernel), which plans whose linears or shapes do not split keep.

The step graph calls the very kernels the module path calls, in the same order with the same
arguments, so the logits are equal bit for bit where the module path runs the fused forms
(:mod:`stages.execute.fused`); where it runs torch's SiLU (a gated MLP whose projections are
quantized, so not fused) the fused SiLU-and-mul here differs by rounding. The runner checks
the plan against the module path on a probe step at load and refuses a plan that disagrees.

What it does not serve (:class:`StepGraphUnsupported` says which): a model other than
:class:`~stages.execute.llama.NativeLlamaForCausalLM`, norms or MLPs not in their fused forms, a
linear without ``native_gemm()``, a layer without the fused rotary embeddings, or native kernels
that do not build. The runner also keeps the module path for prefill and mixed steps, batches
over ``max_rows`` (:func:`plan_rows`), CUDA, tensor parallelism, sliding windows, soft caps and
sinks, and ``use_cuda_graphs=False`` (one switch for both kinds of graph).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.execute.allocator import BlockAllocator
from stages.execute.attention import (
    DecodeAttentionMode,
    KVCache,
    build_step_metadata,
    forward_context,
)
from stages.execute.bf16 import BF16Linear
from stages.execute.cpu import PackedEmbedding, PackedLinear
from stages.execute.fused import FusedGatedMLP, FusedRMSNorm
from stages.execute.llama import LlamaAttention, LlamaMLP, NativeLlamaForCausalLM
from stages.execute.native import (
    KERNEL_SOURCE,
    NativeGemm,
    NativeKernelError,
    PagedDecodeKernel,
    build_library,
    fused_ops_kernel,
)

#: paged_decode.c's one-thread entry per cache dtype (as PagedDecodeKernel.ENTRY_POINTS)
_HEADS_ENTRY_POINTS = {
    torch.float32: "actorline_paged_decode_heads_f32",
    torch.bfloat16: "actorline_paged_decode_heads_f32_bf16kv",
}

__all__ = [
    "LORA_SLOTS",
    "MAX_ROWS",
    "STEP_GRAPH_SOURCE",
    "StepGraph",
    "StepGraphLibrary",
    "StepGraphUnsupported",
    "StepLoRA",
    "check_step_graph",
    "plan_rows",
    "step_graph_library",
]

logger = logging.getLogger("actorline.execute")

STEP_GRAPH_SOURCE = Path(__file__).with_name("kernels") / "step_graph.c"
MAX_ROWS = 16
"""Decode rows a plan serves unless every linear is fp32 or bf16 panels (:func:`plan_rows`): larger
steps take the module path, whose per-op Python cost is shared by more rows (not measured above
16 with 4/8-bit weights)."""
_MAX_TABLE_BYTES = 64 << 20  # the rotary cos/sin table over every position
_SILU_NAMES = ("SiLU", "SiLUActivation")
# The step graph against the module path, relative to the largest logit: the same kernels in the
# same order give equal logits; a fused SiLU-and-mul where the module path runs torch's (a
# quantized MLP) differs by rounding (~1e-6).
CHECK_TOLERANCE = 1e-4

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Gemm(ctypes.Structure):
    _fields_ = [("function", _p), ("part", _p), ("weights", _p), ("format", _i64),
                ("bias", _p), ("n", _i64), ("k", _i64)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _p), ("norm2", _p), ("eps1", _f32), ("eps2", _f32),
                ("q", _Gemm), ("k", _Gemm), ("v", _Gemm), ("o", _Gemm),
                ("gate", _Gemm), ("up", _Gemm), ("down", _Gemm),
                ("key_cache", _p), ("value_cache", _p),
                ("silu", _p), ("silu_part", _p)]  # fmt: skip


_WORKSPACES = ("h", "xn", "q", "kb", "vb", "attn_out", "o", "gate_buf", "up_buf", "gate_up",
               "act", "down", "cos", "sin", "kept", "logits")  # fmt: skip
_INPUTS = ("tokens", "positions", "slots", "block_tables", "context_lens", "keep")


class _Plan(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                    "block_size", "num_cache_blocks", "table_width", "max_rows",
                                    "num_layers")),
        ("scale", _f32), ("final_eps", _f32),
        ("rms", _p), ("silu", _p), ("rope", _p), ("attn", _p), ("kv_bf16", _i64),
        ("rms_rows", _p), ("silu_cols", _p), ("rope_heads", _p), ("attn_heads", _p),
        ("threaded", _i64),
        ("emb", _p), ("emb_panel", _i64), ("emb_panel_stride", _i64), ("emb_lane_stride", _i64),
        ("emb_elem_stride", _i64),
        ("cos_table", _p), ("sin_table", _p), ("table_rows", _i64),
        ("final_norm", _p), ("head", _Gemm), ("layers", _p),
        *((name, _p) for name in _INPUTS),
        *((name, _p) for name in _WORKSPACES),
        ("lora", _p), ("lora_rows", _p), ("lora_rank", _i64),
    ]  # fmt: skip


#: a layer's linears in the order of step_graph.c's LoRA entries (SG_Q .. SG_DOWN)
LORA_SLOTS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True, slots=True)
class StepLoRA:
    """A decode step's LoRA deltas for :meth:`StepGraph.run` (made by
    :mod:`stages.execute.step_graph_lora`): ``table``, the address of ``len(LORA_SLOTS)``
    ``sg_lora`` entries a layer (``step_graph.c``), alive while the caller holds ``keep``;
    ``rank``, the largest rank of an entry; ``groups``, each row's adapter group (-1: the
    base model)."""

    table: int
    rank: int
    groups: tuple[int, ...]
    keep: object


class StepGraphUnsupported(Exception):
    """The model (or this machine) is one the step graph does not serve; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepGraphLibrary:
    """The executor's shared library: where it lies, and loaded."""

    path: Path
    library: ctypes.CDLL


@functools.cache
def step_graph_library() -> StepGraphLibrary | None:
    """The step graph's executor, built or loaded once per process; ``None`` (reason logged
    once) when it cannot be built here."""
    try:
        path = build_library(STEP_GRAPH_SOURCE)
        library = ctypes.CDLL(str(path))
    except (NativeKernelError, OSError) as error:
        logger.warning("native step_graph unavailable, using the module path: %s", error)
        return None
    expected = ctypes.sizeof(_Plan) * 1000 + ctypes.sizeof(_Layer)
    if library.actorline_step_graph_abi() != expected:  # the structures above mirror the C
        logger.warning("native step_graph: its structures differ from step_graph.py's; unused")
        return None
    library.actorline_step_graph.argtypes = [_p, _i64, _i64, ctypes.c_int]
    library.actorline_step_graph.restype = ctypes.c_int
    return StepGraphLibrary(path, library)


def _address(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value or 0


def _gemm(module: Any, what: str, k: int, n: int) -> tuple[_Gemm, NativeGemm]:
    """``module``'s NativeGemm as the plan's structure, checked to take ``k`` inputs and give
    at least ``n`` outputs.

    Raises:
        StepGraphUnsupported: the module has no ``native_gemm()``, or other shapes.
    """
    native_gemm = getattr(module, "native_gemm", None)
    if not callable(native_gemm):
        raise StepGraphUnsupported(f"{what} ({type(module).__name__}) has no native_gemm()")
    gemm = native_gemm()
    if not isinstance(gemm, NativeGemm) or gemm.k != k or gemm.n < n or not gemm.function:
        raise StepGraphUnsupported(f"{what}: its native GEMM takes other shapes")
    structure = _Gemm(
        gemm.function, gemm.part or None, gemm.weights, gemm.format, gemm.bias or None, gemm.n,
        gemm.k,
    )  # fmt: skip
    return structure, gemm


def _splits_by_columns(plan: _Plan, layers: Any, head_dim: int, inter: int) -> bool:
    """Whether a step can run as one OpenMP region (``step_threaded`` in ``step_graph.c``):
    every linear has a column-range entry, the heads start at multiples of 16 columns, and the
    gate/up columns a thread takes meet the up columns it needs at a multiple of 32 (a fused
    projection's halves) or at the same columns (two projections of one width)."""
    if head_dim % 16 != 0 or not plan.head.part:
        return False
    for layer in layers:
        if not all(getattr(layer, name).part for name in ("q", "k", "v", "o", "gate", "down")):
            return False
        if layer.silu and not layer.silu_part:
            return False
        if layer.up.function is None:
            if inter % 32 != 0:
                return False
        elif not layer.up.part or layer.up.n != layer.gate.n:
            return False
    return True


def plan_rows(model: torch.nn.Module, limit: int) -> int:
    """The decode rows a step graph of ``model`` serves, given the engine's bound ``limit``
    (``cuda_graph_max_batch_size``, the CUDA graphs' bound): ``limit`` where every linear is
    fp32 panels (the packed GEMM at every row count) or bf16 panels that multiply that many rows
    on the native kernel (the AMX tiles or the portable widen-and-FMA path; VDPBF16PS below
    :data:`~stages.execute.bf16.TORCH_ROWS`: :meth:`~stages.execute.bf16.BF16Linear.native_rows`),
    the very kernel the module path calls at that count, so 32- and 64-row steps of an offline
    batch are one native call too (measured: docs/performance.md §12.2, "The step graph at 64
    rows", and §13 for fp32); else at most :data:`MAX_ROWS`.
    """
    linears = [m for m in model.modules() if callable(getattr(m, "native_gemm", None))]
    if linears and all(_native_at(m, limit) for m in linears):
        return limit
    return min(limit, MAX_ROWS)


def _native_at(linear: torch.nn.Module, rows: int) -> bool:
    """Whether the module path multiplies ``rows`` rows by ``linear`` on the very kernel the step
    graph calls: fp32 panels (:class:`~stages.execute.cpu.PackedLinear`, the packed GEMM at every
    row count) or bf16 panels that take that many rows natively."""
    return type(linear) is PackedLinear or (type(linear) is BF16Linear and linear.native_rows(rows))


def _norm(module: Any, what: str, hidden: int) -> FusedRMSNorm:
    if type(module) is not FusedRMSNorm or tuple(module.weight.shape) != (hidden,):
        raise StepGraphUnsupported(f"{what} is {type(module).__name__}, not the fused RMSNorm")
    return module


class StepGraph:
    """One recorded plan (see the module docstring): :meth:`build` records it, :meth:`run` runs
    a decode step of up to :attr:`max_rows` rows."""

    def __init__(self) -> None:  # use build()
        self.max_rows = 0
        self.vocab_size = 0
        #: the engine's decode steps run so far
        self.steps = 0
        #: layers whose gate/up projection runs with its SiLU-and-mul epilogue (bf16 panels)
        self.silu_epilogues = 0
        self._can_thread = False
        self._library: ctypes.CDLL | None = None
        self._plan = _Plan()
        self._keep: list[object] = []  # what the plan's pointers point into
        self._inputs: dict[str, np.ndarray] = {}
        self._logits = torch.empty(0)
        self._hidden = torch.empty(0)
        self._embed: torch.nn.Module | None = None  # embeddings the C code cannot read
        self._lora_rows = np.zeros(0, dtype=np.int64)  # each row's adapter group, with LoRA

    @classmethod
    def build(
        cls, model: Any, kv_cache: KVCache, *, max_rows: int, max_model_len: int
    ) -> StepGraph:
        """Record the plan of ``model`` (loaded, its modules fused, packed or quantized, paged
        attention on) over ``kv_cache``, for steps of up to ``max_rows`` decode rows attending
        up to ``max_model_len`` positions.

        Raises:
            StepGraphUnsupported: the model or the machine is one the plan does not serve.
        """
        built = step_graph_library()
        fused = fused_ops_kernel()
        if built is None or fused is None:
            raise StepGraphUnsupported("the native kernels do not build here")
        if type(model) is not NativeLlamaForCausalLM:
            raise StepGraphUnsupported(f"{type(model).__name__} is not actorline's own Llama")
        kv_dtype = kv_cache.key[0].dtype
        if kv_dtype not in PagedDecodeKernel.ENTRY_POINTS or kv_cache.key[0].device.type != "cpu":
            raise StepGraphUnsupported(f"the KV cache is {kv_dtype} on CPU, not fp32 or bf16")
        config = model.config
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        kv_heads, head_dim = int(config.num_key_value_heads), int(config.head_dim)
        inter, vocab = int(config.intermediate_size), int(config.vocab_size)
        if tuple(kv_cache.key[0].shape[1:]) != (kv_heads, head_dim):
            raise StepGraphUnsupported("the KV cache's heads differ from the config's")
        graph = cls()
        graph._library = built.library
        graph.max_rows, graph.vocab_size = max_rows, vocab
        plan, keep = graph._plan, graph._keep
        decoder = model.model
        layers = (_Layer * len(decoder.layers))()
        keep.append(layers)
        widths = {"q": heads * head_dim, "kb": kv_heads * head_dim, "vb": kv_heads * head_dim,
                  "o": hidden, "gate_buf": 2 * inter, "up_buf": inter, "down": hidden}  # fmt: skip
        for index, layer in enumerate(decoder.layers):
            entry, attention, mlp = layers[index], layer.self_attn, layer.mlp
            where = f"layer {index}"
            norm1 = _norm(layer.input_layernorm, f"{where}'s input_layernorm", hidden)
            norm2 = _norm(layer.post_attention_layernorm, f"{where}'s post-attention norm", hidden)
            entry.norm1, entry.eps1 = norm1.weight.data_ptr(), norm1.variance_epsilon
            entry.norm2, entry.eps2 = norm2.weight.data_ptr(), norm2.variance_epsilon
            if type(attention) is not LlamaAttention or attention.rotary is None:
                raise StepGraphUnsupported(f"{where}'s attention lacks the fused rotary embeddings")
            if attention.scaling != head_dim**-0.5 or attention.layer_idx != index:
                raise StepGraphUnsupported(f"{where}'s attention is scaled or numbered otherwise")
            gemms: dict[str, NativeGemm] = {}
            for name, width in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                                ("v", kv_heads * head_dim)):  # fmt: skip
                module = getattr(attention, f"{name}_proj")
                structure, gemms[name] = _gemm(module, f"{where}'s {name}_proj", hidden, width)
                setattr(entry, name, structure)
            entry.o, gemms["o"] = _gemm(attention.o_proj, f"{where}'s o_proj", heads * head_dim,
                                        hidden)  # fmt: skip
            if type(mlp) is FusedGatedMLP:
                entry.gate, gemms["gate"] = _gemm(mlp.gate_up, f"{where}'s gate/up", hidden,
                                                  2 * inter)  # fmt: skip
                entry.up = _Gemm()
                gate_up = mlp.gate_up
                if (
                    type(gate_up) is BF16Linear
                    and gate_up.out_features == 2 * inter
                    and gate_up.fuses_silu_mul(max_rows)
                ):
                    # the module path's epilogue (FusedGatedMLP.forward), so the same bits
                    gemms["silu"] = gate_up.silu_mul_gemm()
                    entry.silu, entry.silu_part = gemms["silu"].function, gemms["silu"].part
                    graph.silu_epilogues += 1
            elif type(mlp) is LlamaMLP and type(mlp.act_fn).__name__ in _SILU_NAMES:
                entry.gate, gemms["gate"] = _gemm(mlp.gate_proj, f"{where}'s gate", hidden, inter)
                entry.up, gemms["up"] = _gemm(mlp.up_proj, f"{where}'s up_proj", hidden, inter)
            else:
                raise StepGraphUnsupported(f"{where}'s MLP is {type(mlp).__name__}")
            entry.down, gemms["down"] = _gemm(mlp.down_proj, f"{where}'s down_proj", inter, hidden)
            entry.key_cache = kv_cache.key[index].data_ptr()
            entry.value_cache = kv_cache.value[index].data_ptr()
            keep.append(gemms)
            buffers = {"q": "q", "kb": "k", "vb": "v", "o": "o", "gate_buf": "gate",
                       "up_buf": "up", "down": "down"}  # fmt: skip
            for buffer, name in buffers.items():
                if name in gemms:
                    widths[buffer] = max(widths[buffer], gemms[name].n)
        if len(kv_cache.key) != len(decoder.layers):
            raise StepGraphUnsupported("the KV cache has another number of layers")
        final = _norm(decoder.norm, "the final norm", hidden)
        plan.head, head_gemm = _gemm(model.lm_head, "the LM head", hidden, vocab)
        keep.append((head_gemm, kv_cache))
        plan.final_norm, plan.final_eps = final.weight.data_ptr(), final.variance_epsilon
        graph._record_embedding(decoder.embed_tokens, hidden, vocab)
        graph._record_rotary(decoder.rotary_emb, head_dim, max_model_len)

        library_fused = ctypes.CDLL(str(fused.path))
        library_attention = ctypes.CDLL(str(build_library(KERNEL_SOURCE)))
        keep.extend((library_fused, library_attention))
        plan.rms = _address(library_fused, "actorline_rms_norm_f32")
        plan.silu = _address(library_fused, "actorline_silu_mul_f32")
        plan.rope = _address(library_fused, "actorline_rope_f32")
        # NOTE: the entry point for the cache's type; the C code rounds K/V rows to bf16 as it
        # writes them where kv_bf16 is set (the bits the module path's index_copy_ writes).
        plan.attn = _address(library_attention, PagedDecodeKernel.ENTRY_POINTS[kv_dtype])
        plan.kv_bf16 = int(kv_dtype == torch.bfloat16)
        plan.rms_rows = _address(library_fused, "actorline_rms_norm_rows_f32")
        plan.silu_cols = _address(library_fused, "actorline_silu_mul_cols_f32")
        plan.rope_heads = _address(library_fused, "actorline_rope_heads_f32")
        plan.attn_heads = _address(library_attention, _HEADS_ENTRY_POINTS[kv_dtype])
        graph._can_thread = _splits_by_columns(plan, layers, head_dim, inter)
        plan.threaded = int(graph._can_thread)
        block_size = kv_cache.block_size
        table_width = -(-max_model_len // block_size)
        for name, value in (("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("inter", inter), ("vocab", vocab),
                            ("block_size", block_size),
                            ("num_cache_blocks", kv_cache.num_slots // block_size),
                            ("table_width", table_width), ("max_rows", max_rows),
                            ("num_layers", len(decoder.layers))):  # fmt: skip
            setattr(plan, name, value)
        plan.scale = head_dim**-0.5
        plan.layers = ctypes.addressof(layers)
        widths.update(h=hidden, xn=hidden, attn_out=heads * head_dim, gate_up=2 * inter,
                      act=inter, cos=head_dim, sin=head_dim, kept=hidden,
                      logits=head_gemm.n)  # fmt: skip
        for workspace in _WORKSPACES:
            tensor = torch.zeros(max_rows, widths[workspace])
            keep.append(tensor)
            setattr(plan, workspace, tensor.data_ptr())
            if workspace == "logits":
                graph._logits = tensor
            elif workspace == "h":
                graph._hidden = tensor
        for name in _INPUTS:
            array = np.zeros((max_rows, table_width) if name == "block_tables" else max_rows,
                             dtype=np.int64)  # fmt: skip
            graph._inputs[name] = array
            setattr(plan, name, array.ctypes.data)
        graph._lora_rows = np.full(max_rows, -1, dtype=np.int64)
        plan.lora_rows = graph._lora_rows.ctypes.data
        return graph

    def linear_shape(self, layer: int, slot: str) -> tuple[int, int] | None:
        """``(k, n)`` of layer ``layer``'s linear ``slot`` (one of :data:`LORA_SLOTS`; ``gate``:
        the fused gate/up projection where ``up`` is None), None where the plan has none.

        Raises:
            IndexError: no such layer.
        """
        if not 0 <= layer < self._plan.num_layers:
            raise IndexError(f"the plan has {self._plan.num_layers} layers, not {layer + 1}")
        entry = getattr(ctypes.cast(self._plan.layers, ctypes.POINTER(_Layer))[layer], slot)
        return (int(entry.k), int(entry.n)) if entry.function else None

    @property
    def serves_lora(self) -> bool:
        """Whether LoRA deltas can be added after every linear: not where a gate/up
        projection runs with its SiLU-and-mul epilogue (a delta would have to go in before
        the SiLU; a bank wraps gate/up, so a plan of a LoRA model never records one)."""
        return self.silu_epilogues == 0

    @property
    def threaded(self) -> bool:
        """Whether a step runs as ONE OpenMP region, its threads kept across the layers and
        each computing its columns of every linear (``kernels/step_graph.c``), rather than a
        region per op (the form before it; the same logits bit for bit). Set it to ``False``
        to run the per-op form (tests and benchmarks compare the two).

        Raises:
            ValueError: set to ``True`` on a plan that cannot split its steps by columns
                (a linear without a column-range entry, or shapes the split cannot serve).
        """
        return bool(self._plan.threaded)

    @threaded.setter
    def threaded(self, on: bool) -> None:
        if on and not self._can_thread:
            raise ValueError("this plan's linears or shapes do not split by columns")
        self._plan.threaded = int(on)

    def _record_embedding(self, embed: Any, hidden: int, vocab: int) -> None:
        """Read embedding rows in C where the module is a plain table or the packed LM head's
        panels; any other kind (quantized rows, scaled rows) is called from Python."""
        plan = self._plan
        if type(embed) is torch.nn.Embedding and embed.max_norm is None:
            table = embed.weight.detach()
            if table.dtype == torch.float32 and table.is_contiguous():
                self._keep.append(table)
                plan.emb, plan.emb_panel, plan.emb_panel_stride = table.data_ptr(), 1, hidden
                plan.emb_lane_stride, plan.emb_elem_stride = 0, 1
                return
        if type(embed) is PackedEmbedding and embed.scale is None:
            packed = embed.head.packed.detach()
            panel = int(packed.shape[2])
            self._keep.append(packed)
            plan.emb, plan.emb_panel, plan.emb_panel_stride = (
                packed.data_ptr(),
                panel,
                packed.stride(0),
            )
            plan.emb_lane_stride, plan.emb_elem_stride = 1, packed.stride(1)
            return
        if int(getattr(embed, "embedding_dim", hidden)) != hidden:
            raise StepGraphUnsupported("the input embeddings have another width")
        self._embed = embed

    def _record_rotary(self, rotary: Any, head_dim: int, max_model_len: int) -> None:
        """The model's own cos/sin of every position (its module, so its arithmetic)."""
        if max_model_len * head_dim * 8 > _MAX_TABLE_BYTES:
            raise StepGraphUnsupported(f"a rotary table of {max_model_len} positions is too big")
        positions = torch.arange(max_model_len).unsqueeze(0)
        with torch.inference_mode():
            cos, sin = rotary(torch.empty(0), positions)
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()  # [L, D]
        if tuple(cos.shape) != (max_model_len, head_dim):
            raise StepGraphUnsupported("the rotary embeddings have another shape")
        self._keep.extend((cos, sin))
        plan = self._plan
        plan.cos_table, plan.sin_table, plan.table_rows = (
            cos.data_ptr(),
            sin.data_ptr(),
            max_model_len,
        )

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        keep: Sequence[int],
        lora: StepLoRA | None = None,
    ) -> torch.Tensor:
        """One decode step: row ``r`` computes token ``token_ids[r]`` at ``positions[r]`` with
        its K/V in the blocks of ``block_tables[r]`` (attending every position up to it);
        ``lora``: the rows' LoRA deltas (:mod:`stages.execute.step_graph_lora`), added after
        each linear they target.

        Returns:
            ``[len(keep), V]`` logits of rows ``keep`` (a new tensor).

        Raises:
            ValueError: more rows than the plan's, a block table too wide, a LoRA group per
                row missing, or a token, position, slot or group out of range (nothing of
                the cache was written then).
            NativeKernelError: a kernel refused its arguments midway.
        """
        rows = len(positions)
        inputs = self._inputs
        tables = inputs["block_tables"]
        if not 0 < rows <= self.max_rows or len(token_ids) != rows or len(block_tables) != rows:
            raise ValueError(f"a step graph step takes 1..{self.max_rows} rows, got {rows}")
        inputs["tokens"][:rows] = token_ids
        inputs["positions"][:rows] = positions
        inputs["keep"][: len(keep)] = keep
        block_size = self._plan.block_size
        for row, (table, position) in enumerate(zip(block_tables, positions, strict=True)):
            if len(table) > tables.shape[1] or position // block_size >= len(table):
                raise ValueError(f"row {row}: its block table does not hold position {position}")
            tables[row, : len(table)] = table
            inputs["slots"][row] = (
                table[position // block_size] * block_size + position % block_size
            )
            inputs["context_lens"][row] = position + 1
        plan = self._plan
        if lora is None:
            plan.lora, plan.lora_rank = None, 0
        else:
            if len(lora.groups) != rows:
                raise ValueError(f"{len(lora.groups)} LoRA groups for {rows} rows")
            if not self.serves_lora:
                raise ValueError("this plan fuses SiLU into gate/up: it serves no LoRA delta")
            self._lora_rows[:rows] = lora.groups
            plan.lora, plan.lora_rank = lora.table, lora.rank
        if self._embed is not None:
            with torch.inference_mode():
                rows_in = self._embed(torch.tensor(token_ids, dtype=torch.long).unsqueeze(0))[0]
            self._hidden[:rows].copy_(rows_in)
        assert self._library is not None
        try:
            status = self._library.actorline_step_graph(
                ctypes.addressof(plan), rows, len(keep), torch.get_num_threads()
            )
        finally:
            plan.lora = None  # the table lives while the caller holds it: not past the step
        self.steps += 1
        if status == 2:
            raise ValueError(
                "step graph: a token, position, slot, block id or kept row is out of range"
            )
        if status != 0:
            raise NativeKernelError(f"step graph: a kernel failed (status {status})")
        return self._logits[: len(keep), : self.vocab_size].clone()


def check_step_graph(
    graph: StepGraph,
    model: Any,
    kv_cache: KVCache,
    allocator: BlockAllocator,
    *,
    decode_mode: DecodeAttentionMode,
    max_model_len: int,
    probe_name: str,
) -> None:
    """Run one decode step of up to three rows (contexts 3, one block + 2 and two blocks + 1:
    across block boundaries; fewer where the cache has fewer free blocks) through the module
    path and through ``graph``, on blocks allocated for the probe (as ``probe_name0``, ...) and
    freed after; their logits must agree.

    Raises:
        StepGraphUnsupported: they disagree (the error says by how much), or ``graph.run``
            refused the step.
    """
    block_size = kv_cache.block_size
    lengths = [n for n in (3, block_size + 2, 2 * block_size + 1) if n <= max_model_len]
    lengths = lengths[: graph.max_rows]
    while sum(-(-n // block_size) for n in lengths) > allocator.num_free_blocks:
        lengths.pop()  # a small cache: fewer rows
    if not lengths:
        raise StepGraphUnsupported("the KV cache has no block free for its probe step")
    names = [f"{probe_name}{index}" for index in range(len(lengths))]
    vocab = graph.vocab_size
    tokens = [[(31 * i + 7 * row + 5) % vocab for i in range(n)] for row, n in enumerate(lengths)]
    try:
        for name, length in zip(names, lengths, strict=True):
            allocator.allocate(name, length)
        tables = [allocator.block_table(name) for name in names]

        def module_path(starts: list[int], ends: list[int], num_decode: int) -> torch.Tensor:
            metadata, positions = build_step_metadata(
                kv_cache=kv_cache,
                block_tables=tables,
                query_starts=starts,
                query_lens=[end - start for start, end in zip(starts, ends, strict=True)],
                num_decode=num_decode,
                decode_mode=decode_mode,
                max_model_len=max_model_len,
                device=torch.device("cpu"),
            )
            ids = [t for row, s, e in zip(tokens, starts, ends, strict=True) for t in row[s:e]]
            keep = torch.tensor(np.cumsum([e - s for s, e in zip(starts, ends, strict=True)]) - 1)
            with torch.inference_mode(), forward_context(metadata):
                logits: torch.Tensor = model(
                    input_ids=torch.tensor([ids]),
                    position_ids=positions.unsqueeze(0),
                    use_cache=False,
                    logits_to_keep=keep,
                ).logits[0]
            return logits

        last = [n - 1 for n in lengths]
        module_path([0] * len(lengths), last, 0)  # the prompts' K/V
        expected = module_path(last, lengths, len(lengths))
        try:
            got = graph.run([row[-1] for row in tokens], last, tables, range(len(lengths)))
            graph.steps -= 1  # counts the engine's steps, not the probe
        except (ValueError, NativeKernelError) as refusal:
            raise StepGraphUnsupported(f"it refused the probe step ({refusal})") from refusal
    finally:
        for name in names:
            if allocator.has_request(name):
                allocator.free(name)
    error = (got - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    if not error <= CHECK_TOLERANCE * scale:
        logger.warning("execute: the step graph disagrees with the module path; not used")
        raise StepGraphUnsupported(f"its logits differ from the module path's by {error:.3g}")
    logger.info(
        "execute: the step graph's probe logits %s the module path's",
        "equal" if error == 0 else f"are within {error:.3g} of",
    )
