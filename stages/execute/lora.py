"""LoRA adapters on the model runner (docs/lora.md): each targeted projection's linear is
wrapped in a :class:`LoRALinear` that adds, to the base linear's output, the delta of each
row's adapter, ``scale * (x @ A^T) @ B^T`` (in torch: the step's adapters concatenated in
one shrink and one expand, :mod:`stages.execute.lora_segments`), as vLLM's punica wrapper
adds its ``lora_shrink`` / ``lora_expand`` to the base output
(``vllm/lora/layers/base_linear.py``, ``vllm/lora/punica_wrapper/punica_cpu.py``). The base
weights are never touched, so base rows and rows of different adapters share one step, and
the delta follows any kind of base linear (fp32, packed, bf16 panels, int8, GGUF): the
wrapper calls whatever module is there.

A fused gate/up projection (:class:`~stages.execute.fused.FusedGatedMLP`'s ``gate_up``)
takes the concatenation of the gate and up deltas: its adapter's ``A`` is the two ``A``
stacked, its ``B`` the two ``B`` block-diagonal, so one shrink and one expand give
``[delta_gate, delta_up]``.

:class:`LoRABank` owns the loaded adapters (at most ``max_cpu_loras``; the least recently
used one not in use is unloaded past it) and the step's row groups, which the runner sets
around a forward pass with :meth:`LoRABank.rows`. A step with no adapter row leaves every
wrapper a pass-through. The CPU step graph runs decode steps with adapter rows too: its native
code adds the same concatenated deltas after each linear (:mod:`stages.execute.step_graph_lora`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from stages.execute.bookkeeping import StepError
from stages.execute.lora_native import native_lora_delta
from stages.execute.lora_segments import ConcatCache, StepSegments
from stages.execute.lora_shard import LoRAShard, full_shape, shard_weights
from stages.lora import (
    LORA_TARGETS,
    AdapterSpec,
    LoRAAdapterError,
    LoRARequest,
    LoRATarget,
    read_adapter,
)
from stages.messages import EngineRequest

__all__ = [
    "WANTED_SECONDS",
    "LoRABank",
    "LoRALinear",
    "LoRARows",
    "LoadedAdapter",
    "acquire_adapter",
    "lora_rows",
]

logger = logging.getLogger("actorline.execute")

_MODULE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(LORA_TARGETS) + r")$"
)
_MLP = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")
_FUSED_PARTS = ("gate_proj", "up_proj")
#: seconds an adapter a request was admitted for (:meth:`LoRABank.ready`,
#: :meth:`LoRABank.offer`) is not unloaded, while the request may still wait in the queue
WANTED_SECONDS = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Delta:
    """One adapter's weights for one wrapped linear: ``a`` ``[R, in]``, ``b`` ``[out, R]``
    (``R``: the rank, or twice it for a fused gate/up), already scaled."""

    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass(slots=True)
class LoadedAdapter:
    """An adapter as :class:`LoRABank` holds it: its request, what :func:`read_adapter`
    found, and its weights per ``(layer, wrapped projection)``."""

    request: LoRARequest
    spec: AdapterSpec | None
    deltas: dict[tuple[int, str], _Delta]  # (layer, wrapper kind) -> weights


@dataclasses.dataclass(frozen=True, slots=True)
class LoRARows:
    """A step's rows of one adapter: ``rows`` (packed-batch row indices; None: every row)."""

    adapter: LoadedAdapter
    rows: torch.Tensor | None


class LoRALinear(torch.nn.Module):
    """``base(x)`` plus the step's adapters' deltas on their rows (see the module
    docstring). ``kind``: the projection (``gate_up`` for the fused gate/up one)."""

    def __init__(self, base: Any, layer: int, kind: str, bank: LoRABank) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.kind = kind
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self._bank = bank
        if callable(getattr(base, "native_gemm", None)):
            # NOTE: the base linear's, for the CPU step graph, which adds the deltas after
            # it in native code (stages.execute.step_graph_lora)
            self.native_gemm = base.native_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        output = self.base(x)
        groups = self._bank.step_rows
        if not groups:
            return output
        flat_x = x.reshape(-1, x.shape[-1])
        flat = output.view(-1, output.shape[-1])  # [T, N], the same storage
        key = (self.layer, self.kind)
        segments = self._bank.step_segments
        if segments is not None:  # some rows: two GEMMs (stages.execute.lora_segments)
            segments.add_delta(key, flat_x, flat)
            return output
        for group in groups:
            delta = group.adapter.deltas.get(key)
            if delta is None:
                continue  # the adapter leaves this projection alone
            a, b = delta.a.to(flat_x.dtype), delta.b.to(flat_x.dtype)
            if group.rows is None:  # every row: the expand fused with the add
                target = flat if b.shape[0] == flat.shape[1] else flat[:, : b.shape[0]]
                target.addmm_(flat_x @ a.t(), b.t())
            else:
                rows = flat_x.index_select(0, group.rows)
                update = (rows @ a.t()) @ b.t()  # [G, out]
                if b.shape[0] != flat.shape[1]:  # padded output columns stay as they are
                    update = torch.nn.functional.pad(update, (0, flat.shape[1] - b.shape[0]))
                flat.index_add_(0, group.rows, update)
        return output

    def extra_repr(self) -> str:
        return f"layer={self.layer}, kind={self.kind} (LoRA)"


class LoRABank:
    """The adapters a runner serves (see the module docstring).

    Args:
        max_lora_rank: the highest rank accepted.
        max_cpu_loras: adapters kept loaded.
        device: where their weights live.
        shard: with tensor parallelism, this rank's share of each adapter
            (:mod:`stages.execute.lora_shard`; None: all of it).
    """

    def __init__(
        self,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        shard: LoRAShard | None = None,
    ) -> None:
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.shard = shard
        self.targets: dict[str, LoRATarget] = {}
        self.num_layers = 0
        self.fused_mlp = False
        self.step_rows: list[LoRARows] = []
        #: a step's groups as concatenated weights, where its adapters cover only some rows
        self.step_segments: StepSegments | None = None
        #: a step whose adapters cover only some of its rows (several adapters, or base rows
        #: beside one) takes the concatenated path (True, the default: 3 torch calls per
        #: projection against the loop's 4-6 per row group, docs/lora.md "Benchmark");
        #: False: the loop over row groups
        self.segmented = True
        #: the concatenated path in native code on the CPU in fp32 (True, the default, where
        #: the library builds: :mod:`stages.execute.lora_native`); False: torch's three calls
        self.native = device.type == "cpu"
        self._concat = ConcatCache()
        self._loaded: collections.OrderedDict[int, LoadedAdapter] = collections.OrderedDict()
        # NOTE: _loaded is shared by the step thread (acquire) and the execute stage's
        # loader thread (offer, docs/lora.md "Loading"): every read or change of it holds
        # this lock, and nothing slow (a file read, a tensor copy) runs under it
        self._lock = threading.Lock()
        #: id -> when a request was last admitted for it (kept loaded WANTED_SECONDS)
        self._wanted: dict[int, float] = {}
        self.loads = 0  # adapters read from disk since start
        self.step_thread_loads = 0  # of which on the step thread (not prepared ahead)

    @classmethod
    def for_model(
        cls, model: Any, config: Any, device: torch.device, shard: LoRAShard | None = None
    ) -> LoRABank:
        """A bank serving ``model`` under ``config`` (an ExecuteConfig with enable_lora), its
        projections wrapped (:meth:`install`); ``shard``: this rank's share, with tensor
        parallelism.

        Raises:
            LoRAAdapterError: the model has no projection an adapter could target.
        """
        kept = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
        bank = cls(config.max_lora_rank, kept, device, shard)
        count = bank.install(model)
        logger.info("execute: LoRA on %d projections of %d layers", count, bank.num_layers)
        return bank

    def target_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """Each targetable projection as ``(name, in_features, out_features)``."""
        return tuple((t.name, t.in_features, t.out_features) for t in self.targets.values())

    # ---------------------------------------------------------------- the model
    def install(self, model: Any) -> int:
        """Wrap ``model``'s targetable projections (its ``layers.N.self_attn.*_proj`` and
        ``layers.N.mlp.*_proj`` modules, and the fused ``layers.N.mlp.gate_up``).

        Returns:
            How many linears were wrapped.

        Raises:
            LoRAAdapterError: the model has no projection an adapter could target.
        """
        wraps: list[tuple[torch.nn.Module, str, int, str]] = []
        layers: set[int] = set()
        for name, module in model.named_modules():
            if (match := _MODULE.search(name)) is not None and hasattr(module, "out_features"):
                parent = model.get_submodule(name.rpartition(".")[0])
                wraps.append((parent, name.rpartition(".")[2], int(match.group(1)), match[2]))
                self.targets[match[2]] = LoRATarget(
                    match[2],
                    *full_shape(
                        self.shard, match[2], int(module.in_features), int(module.out_features)
                    ),
                )
                layers.add(int(match.group(1)))
            elif (match := _MLP.search(name)) is not None and hasattr(module, "gate_up"):
                gate_up = module.gate_up
                half = int(gate_up.out_features) // 2
                wraps.append((module, "gate_up", int(match.group(1)), "gate_up"))
                for part in _FUSED_PARTS:
                    self.targets[part] = LoRATarget(
                        part, *full_shape(self.shard, part, int(gate_up.in_features), half)
                    )
                layers.add(int(match.group(1)))
                self.fused_mlp = True
        if not wraps:
            raise LoRAAdapterError(
                f"the model has no projection a LoRA adapter could target "
                f"({', '.join(LORA_TARGETS)})"
            )
        for parent, attribute, layer, kind in wraps:
            base = getattr(parent, attribute)
            setattr(parent, attribute, LoRALinear(base, layer, kind, self))
        self.num_layers = max(layers) + 1
        return len(wraps)

    # ---------------------------------------------------------------- adapters
    def acquire(self, lora: LoRARequest, in_use: set[int]) -> LoadedAdapter:
        """The loaded adapter of ``lora``, read and checked now if it is not loaded (the
        execute stage prepares adapters ahead on its loader thread, :meth:`prepare` and
        :meth:`offer`, so this read is the fallback); then the least recently used adapters
        not in ``in_use`` (ids) are unloaded past ``max_cpu_loras``.

        Raises:
            LoRAAdapterError: the adapter cannot be served (nothing of it stays loaded).
        """
        with self._lock:
            adapter = self._loaded.get(lora.lora_int_id)
        self._check_same(adapter, lora)
        if adapter is None:
            adapter = self.prepare(lora)
            self.step_thread_loads += 1
            logger.info(
                "execute: LoRA adapter %r loaded on the step thread (not prepared ahead)",
                lora.lora_name,
            )
        with self._lock:
            adapter = self._loaded.setdefault(lora.lora_int_id, adapter)
            self._loaded.move_to_end(lora.lora_int_id)
            excess = len(self._loaded) - self.max_cpu_loras
            # NOTE: an adapter a request was admitted for in the last WANTED_SECONDS stays
            # too (that request may wait in the queue behind max_loras): unloading it would
            # have the step thread read it again when the request runs
            recent = time.monotonic() - WANTED_SECONDS
            for lora_id in list(self._loaded):
                if excess <= 0:
                    break
                if (
                    lora_id != lora.lora_int_id
                    and lora_id not in in_use
                    and self._wanted.get(lora_id, -math.inf) < recent
                ):
                    del self._loaded[lora_id]
                    self._wanted.pop(lora_id, None)
                    excess -= 1
        return adapter

    def ready(self, lora: LoRARequest) -> bool:
        """Whether ``lora`` is loaded (:meth:`acquire` will not read it), for a request about
        to be scheduled: then it is marked the most recently used and wanted (not unloaded
        for :data:`WANTED_SECONDS`, while the request may wait to run)."""
        with self._lock:
            adapter = self._loaded.get(lora.lora_int_id)
            if adapter is None or adapter.request != lora:
                return False
            self._loaded.move_to_end(lora.lora_int_id)
            self._wanted[lora.lora_int_id] = time.monotonic()
            return True

    def offer(self, adapter: LoadedAdapter) -> None:
        """Keep ``adapter`` (made by :meth:`prepare` off the step thread) as loaded, the most
        recently used and wanted (see :meth:`ready`): swapping it in is all the step thread
        sees of its load. Unloading past ``max_cpu_loras`` waits for the next
        :meth:`acquire` (which knows what is in use). An adapter already loaded under its id
        stays as it is."""
        lora_id = adapter.request.lora_int_id
        with self._lock:
            self._loaded.setdefault(lora_id, adapter)
            self._loaded.move_to_end(lora_id)
            self._wanted[lora_id] = time.monotonic()

    def loaded(self) -> list[LoRARequest]:
        """The adapters loaded now, least recently used first."""
        with self._lock:
            return [adapter.request for adapter in self._loaded.values()]

    @staticmethod
    def _check_same(adapter: LoadedAdapter | None, lora: LoRARequest) -> None:
        if adapter is not None and adapter.request != lora:
            raise LoRAAdapterError(
                f"lora_int_id {lora.lora_int_id} is adapter {adapter.request.lora_name!r} "
                f"at {adapter.request.lora_path!r}; {lora.lora_name!r} at {lora.lora_path!r} "
                "needs an id of its own",
                field="lora_request",
            )

    def prepare(self, lora: LoRARequest) -> LoadedAdapter:
        """``lora`` read from disk, checked against the model (:func:`read_adapter`) and its
        weights laid out as :class:`LoRALinear` takes them, without keeping it (:meth:`offer`
        does). Touches nothing the steps use: safe on another thread than the step's.

        Raises:
            LoRAAdapterError: the adapter cannot be served (named, with the problem).
        """
        from safetensors import safe_open

        spec = read_adapter(
            lora.lora_path, self.targets, self.num_layers, self.max_lora_rank,
            name=lora.lora_name,
        )  # fmt: skip
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            with safe_open(f"{lora.lora_path}/adapter_model.safetensors", "pt") as file:
                for key, (a_name, b_name) in spec.tensors.items():
                    a = file.get_tensor(a_name).to(torch.float32)
                    b = file.get_tensor(b_name).to(torch.float32)
                    weights[key] = (a, b)
        except (OSError, RuntimeError) as exc:
            raise LoRAAdapterError(
                f"LoRA adapter {lora.lora_name!r}: adapter_model.safetensors is not readable "
                f"({exc})",
                field="lora_request",
            ) from None
        adapter = self.adapter_of_weights(weights, spec.scale, lora, spec)
        with self._lock:
            self.loads += 1
        logger.info(
            "execute: loaded LoRA adapter %r (id %d, rank %d, %d projections)",
            lora.lora_name, lora.lora_int_id, spec.rank, len(adapter.deltas),
        )  # fmt: skip
        return adapter

    def adapter_of_weights(
        self,
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        scale: float,
        request: LoRARequest | None = None,
        spec: AdapterSpec | None = None,
    ) -> LoadedAdapter:
        """An adapter of ``weights`` (``(layer, projection) -> (A [r, in], B [out, r])``,
        checked already; the whole model's, this rank keeps its share) and ``scale``, its
        gate/up deltas fused where the model's are; not kept by the bank (:meth:`acquire`
        keeps what it loads)."""
        whole = weights
        weights = shard_weights(self.shard, whole)
        deltas: dict[tuple[int, str], _Delta] = {}
        fused = self.fused_mlp
        for (layer, module), (a, b) in weights.items():
            if fused and module in _FUSED_PARTS:
                continue
            deltas[layer, module] = self._delta([a], [b], scale)
        if fused:
            for layer in sorted({layer for layer, module in weights if module in _FUSED_PARTS}):
                a_parts, b_parts = [], []
                rank = next(pair[0].shape[0] for (at, part), pair in whole.items()
                            if at == layer and part in _FUSED_PARTS)  # fmt: skip
                for part in _FUSED_PARTS:
                    pair = weights.get((layer, part))
                    if pair is None:  # the adapter leaves this half alone: a zero delta
                        target = self.targets[part]
                        zeros = (torch.zeros(rank, target.in_features),
                                 torch.zeros(target.out_features, rank))  # fmt: skip
                        pair = shard_weights(self.shard, {(layer, part): zeros})[layer, part]
                    a_parts.append(pair[0])
                    b_parts.append(pair[1])
                deltas[layer, "gate_up"] = self._delta(a_parts, b_parts, scale)
        return LoadedAdapter(request or LoRARequest("weights", 0, ""), spec, deltas)

    def _delta(
        self, a_parts: Sequence[torch.Tensor], b_parts: Sequence[torch.Tensor], scale: float
    ) -> _Delta:
        """``A`` stacked, ``B`` block-diagonal and scaled (one part: as they are)."""
        a = torch.cat(list(a_parts), dim=0)
        b = torch.block_diag(*b_parts) * scale
        return _Delta(a.contiguous().to(self.device), b.contiguous().to(self.device))

    # ---------------------------------------------------------------- steps
    def segments(self, adapters: Sequence[LoadedAdapter]) -> StepSegments:
        """The concatenated weights of the set ``adapters`` (in this order), from the cache
        the module path's steps use (:mod:`stages.execute.lora_segments`): the CPU step graph
        points its native code at the same tensors (:mod:`stages.execute.step_graph_lora`)."""
        groups = [LoRARows(adapter, None) for adapter in adapters]
        return StepSegments(groups, 0, self._concat)

    @contextlib.contextmanager
    def rows(self, groups: Sequence[tuple[LoadedAdapter | None, int, int]]) -> Iterator[None]:
        """Serve the forward pass inside with the packed rows ``[start, end)`` of each group
        under its adapter (None: the base model)."""
        by_adapter: dict[int, tuple[LoadedAdapter, list[int]]] = {}
        total = 0
        for adapter, start, end in groups:
            total = max(total, end)
            if adapter is not None:
                entry = by_adapter.setdefault(id(adapter), (adapter, []))
                entry[1].extend(range(start, end))
        step_rows = []
        for adapter, rows in by_adapter.values():
            index = None if len(rows) == total else torch.tensor(rows, device=self.device)
            step_rows.append(LoRARows(adapter, index))
        self.step_rows = step_rows
        if self.segmented and any(group.rows is not None for group in step_rows):
            native = native_lora_delta() if self.native else None
            self.step_segments = StepSegments(step_rows, total, self._concat, native)
        try:
            yield
        finally:
            self.step_rows = []
            self.step_segments = None


def lora_rows(
    bank: LoRABank | None, groups: Sequence[tuple[LoadedAdapter | None, int, int]]
) -> contextlib.AbstractContextManager[None]:
    """:meth:`LoRABank.rows` of ``groups`` where ``bank`` serves adapters and a group has
    one; else nothing to do."""
    if bank is None or all(adapter is None for adapter, _, _ in groups):
        return contextlib.nullcontext()
    return bank.rows(groups)


def acquire_adapter(
    bank: LoRABank | None, request: EngineRequest, registered: Iterable[Any]
) -> LoadedAdapter | None:
    """The loaded adapter of a request the runner registers (None: the base model), the
    adapters of the ``registered`` requests (each with ``lora``) kept loaded.

    Raises:
        StepError: the request has an adapter and the runner serves none (enable_lora off:
            the frontend refuses such a request, so a bug).
        LoRAAdapterError: the adapter cannot be served (its files changed since the
            frontend checked them).
    """
    if request.lora is None:
        return None
    if bank is None:
        raise StepError(f"request {request.request_id!r} has a LoRA adapter; enable_lora is off")
    in_use = {state.lora.request.lora_int_id for state in registered if state.lora is not None}
    return bank.acquire(request.lora, in_use)
