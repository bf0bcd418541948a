"""Multi-LoRA (docs/lora.md): the request's :class:`LoRARequest` (vLLM's field names,
``vllm/lora/request.py``) and the check of a PEFT adapter directory against the model it is
served on, from ``adapter_config.json`` and the safetensors file's header alone. Pure: no
torch, no asyncio.

A PEFT LoRA directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``.lora_B.weight``
(``[out, r]``), as peft's ``get_peft_model_state_dict`` saves them
(``peft/utils/save_and_load.py``). The delta of a module is ``scale * B @ A`` with ``scale``
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), as peft's
``LoraLayer.update_layer`` (``peft/tuners/lora/layer.py``).

:func:`read_adapter` checks everything a load could trip on (missing files, a malformed
config, a rank above ``max_lora_rank``, an unknown module, a wrong shape, a dtype
safetensors cannot hold) and raises :class:`LoRAAdapterError` naming it, so the frontend
refuses a bad adapter before any of it reaches the engine, and the execute stage's load
(:mod:`stages.execute.lora`) runs the same check before it reads a tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stages.errors import InvalidRequestError
from transports.codec import message

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LORA_TARGETS",
    "AdapterSpec",
    "LoRAAdapterError",
    "LoRAChecker",
    "LoRARequest",
    "LoRATarget",
    "RunningAdapters",
    "check_lora_request",
    "lora_cache_key",
    "read_adapter",
    "running_adapters",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: the projections an adapter may target: attention's q/k/v/o and the gated MLP's gate/up/down
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: the longest adapter name and path a request may carry
_MAX_TEXT = 4096
#: the largest adapter_config.json and safetensors header read (bytes)
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 64 << 20
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
#: builds the error of one problem (read_adapter's, naming the adapter)
_Fail = Callable[[str], "LoRAAdapterError"]
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(LORA_TARGETS)
    + r")\.lora_([AB])\.weight$"
)


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served: missing files, a malformed config or tensor
    file, a rank above ``max_lora_rank``, a module the model lacks or a shape it does not
    fit. ``field`` is ``lora_request``."""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class LoRARequest:
    """Serve a request with the LoRA adapter at ``lora_path`` (a PEFT directory), as vLLM's
    ``LoRARequest``: ``lora_name`` names it (the model name clients send over HTTP),
    ``lora_int_id`` (>= 1) identifies it in the engine: one id, one adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclasses.dataclass(frozen=True, slots=True)
class LoRATarget:
    """A projection an adapter may target, as the model has it: ``in_features`` and
    ``out_features`` of its base linear."""

    name: str
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What :func:`read_adapter` found: ``rank``, ``scale`` (of ``B @ A``), the tensors of
    each ``(layer, module)`` (their names in the file: ``(A, B)``) and ``digest``, a SHA-256
    of the config file, the weights file's tensor table, size and modification time (cheap:
    the frontend checks an adapter on the event loop, so the weights' bytes are not read)."""

    path: str
    rank: int
    scale: float
    tensors: Mapping[tuple[int, str], tuple[str, str]]
    digest: bytes


def check_lora_request(lora: object) -> LoRARequest:
    """``lora`` as a :class:`LoRARequest` whose fields are usable (a name, an id >= 1, a
    path), before anything reads the path.

    Raises:
        LoRAAdapterError: not a LoRARequest, or a field out of range (named).
    """
    if not isinstance(lora, LoRARequest):
        raise LoRAAdapterError(
            f"lora_request must be a LoRARequest, got {type(lora).__name__}",
            field="lora_request",
        )
    for name in ("lora_name", "lora_path"):
        value = getattr(lora, name)
        if not isinstance(value, str) or not value.strip() or len(value) > _MAX_TEXT:
            raise LoRAAdapterError(
                f"lora_request.{name} must be a non-empty string of at most {_MAX_TEXT} "
                f"characters, got {value!r:.80}",
                field="lora_request",
            )
    if type(lora.lora_int_id) is not int or not 1 <= lora.lora_int_id < (1 << 62):
        raise LoRAAdapterError(
            f"lora_request.lora_int_id must be an integer >= 1, got {lora.lora_int_id!r:.40}",
            field="lora_request",
        )
    return lora


class RunningAdapters:
    """The distinct adapters of the running requests, bounded by ``max_loras`` (the
    scheduler's admission of a waiting request, :func:`running_adapters`)."""

    def __init__(self, ids: set[int], max_loras: int) -> None:
        self.ids = ids
        self.max_loras = max_loras

    def admits(self, lora: LoRARequest | None) -> bool:
        """Whether a request of ``lora`` may run beside them (the base model always may)."""
        return lora is None or lora.lora_int_id in self.ids or len(self.ids) < self.max_loras

    def add(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.ids.add(lora.lora_int_id)


def running_adapters(running: Iterable[Any], max_loras: int | None) -> RunningAdapters | None:
    """The adapters of ``running`` (scheduler states, each with ``request.lora``) under
    ``max_loras`` (None: no bound, and None returned)."""
    if max_loras is None:
        return None
    ids = {state.request.lora.lora_int_id for state in running if state.request.lora is not None}
    return RunningAdapters(ids, max_loras)


def lora_cache_key(lora: LoRARequest | None) -> bytes:
    """What a request served by ``lora`` mixes into its KV blocks' prefix-cache hashes
    (b"" for the base model), so no block computed under one adapter serves another or the
    base (vLLM keys its blocks by the adapter likewise: ``vllm/v1/core/kv_cache_utils.py``,
    its extra keys). An id, name and path: one adapter, one key."""
    if lora is None:
        return b""
    return f"lora\0{lora.lora_int_id}\0{lora.lora_name}\0{lora.lora_path}".encode()


def read_adapter(
    path: str,
    targets: Mapping[str, LoRATarget],
    num_layers: int,
    max_lora_rank: int,
    *,
    name: str = "",
) -> AdapterSpec:
    """Check the PEFT LoRA directory ``path`` against a model of ``num_layers`` layers whose
    projections are ``targets`` (see the module docstring).

    Raises:
        LoRAAdapterError: naming the adapter (``name``, else the path) and what is wrong.
    """
    label = f"LoRA adapter {name or path!r:.200}"

    def fail(problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{label}: {problem}", field="lora_request")

    if not os.path.isdir(path):
        raise fail(f"{path!r:.200} is not a directory")
    config_path = os.path.join(path, ADAPTER_CONFIG)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    for required in (config_path, weights_path):
        if not os.path.isfile(required):
            raise fail(f"{os.path.basename(required)} is missing")
    digest = hashlib.sha256()
    try:
        with open(config_path, "rb") as file:
            raw = file.read(_MAX_CONFIG_BYTES + 1)
        if len(raw) > _MAX_CONFIG_BYTES:
            raise fail(f"{ADAPTER_CONFIG} is over {_MAX_CONFIG_BYTES} bytes")
        digest.update(raw)
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise fail(f"{ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise fail(f"{ADAPTER_CONFIG} is not a JSON object")
    rank, scale = _rank_and_scale(config, max_lora_rank, fail)
    header = _safetensors_header(weights_path, digest, fail)
    tensors = _tensors(header, targets, num_layers, rank, fail)
    return AdapterSpec(path, rank, scale, tensors, digest.digest())


def _rank_and_scale(
    config: dict[str, object], max_lora_rank: int, fail: _Fail
) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r:.40} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or rank < 1:
        raise fail(f"r must be an integer >= 1, got {rank!r:.40}")
    if rank > max_lora_rank:
        raise fail(f"rank {rank} is above max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a finite number, got {alpha!r:.40}")
    # NOTE: what changes the delta beyond r/alpha is refused, never ignored
    for key, harmless in (
        ("use_dora", (False, None)),
        ("fan_in_fan_out", (False, None)),
        ("bias", ("none", None)),
        ("modules_to_save", (None, [])),
        ("rank_pattern", ({}, None)),
        ("alpha_pattern", ({}, None)),
        ("layer_replication", (None, [])),
        ("lora_bias", (False, None)),
        ("target_parameters", (None, [])),
        ("trainable_token_indices", (None, [], {})),
        ("alora_invocation_tokens", (None, [])),
        ("use_qalora", (False, None)),
        ("use_bdlora", (False, None)),
    ):
        if config.get(key) not in harmless:
            raise fail(f"{key} {config.get(key)!r:.80} is not supported")
    rslora = config.get("use_rslora", False)
    if type(rslora) is not bool:
        raise fail(f"use_rslora must be a boolean, got {rslora!r:.40}")
    scale = float(alpha) / (math.sqrt(rank) if rslora else rank)
    return rank, scale


def _safetensors_header(path: str, digest: Any, fail: _Fail) -> dict[str, object]:
    """The header of a safetensors file (an 8-byte little-endian length, then JSON), its
    bytes, the file's size and modification time fed to ``digest``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) != 8:
                raise fail(f"{ADAPTER_WEIGHTS} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise fail(f"{ADAPTER_WEIGHTS} is not a safetensors file (header length)")
            raw = file.read(length)
            digest.update(prefix)
            digest.update(raw)
            digest.update(f"{size}:{os.stat(file.fileno()).st_mtime_ns}".encode())
            end = 8 + length
        header = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise fail(f"{ADAPTER_WEIGHTS} is not readable ({exc})") from None
    if not isinstance(header, dict):
        raise fail(f"{ADAPTER_WEIGHTS} has no tensor table")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise fail(f"{ADAPTER_WEIGHTS}: tensor {key!r:.120} has no entry")
        offsets, shape = entry.get("data_offsets"), entry.get("shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and 0 <= o <= size - end for o in offsets)
            or not isinstance(shape, list)
            or not all(type(d) is int and d >= 0 for d in shape)
        ):
            raise fail(f"{ADAPTER_WEIGHTS}: tensor {key!r:.120} has a malformed entry")
    return header


def _tensors(
    header: dict[str, object],
    targets: Mapping[str, LoRATarget],
    num_layers: int,
    rank: int,
    fail: _Fail,
) -> dict[tuple[int, str], tuple[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        match = _KEY.match(key)
        if match is None:
            raise fail(f"tensor {key!r:.160} is not a LoRA A/B weight of {', '.join(LORA_TARGETS)}")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if module not in targets:
            raise fail(f"module {module} ({key!r:.160}) is not in this model")
        if layer >= num_layers:
            raise fail(f"layer {layer} ({key!r:.160}) is beyond the model's {num_layers} layers")
        assert isinstance(entry, dict)
        if entry.get("dtype") not in _FLOAT_DTYPES:
            raise fail(f"tensor {key!r:.160} has dtype {entry.get('dtype')!r:.20}, not a float")
        target = targets[module]
        expected = [rank, target.in_features] if side == "A" else [target.out_features, rank]
        if entry.get("shape") != expected:
            raise fail(
                f"tensor {key!r:.160} has shape {entry.get('shape')}, the model's {module} "
                f"needs {expected}"
            )
        sides = found.setdefault((layer, module), {})
        if side in sides:
            raise fail(f"tensor {key!r:.160} appears twice")
        sides[side] = key
    if not found:
        raise fail(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    tensors: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, module), sides in sorted(found.items()):
        if set(sides) != {"A", "B"}:
            missing = "B" if "A" in sides else "A"
            raise fail(f"layer {layer} {module} has no lora_{missing} weight")
        tensors[layer, module] = (sides["A"], sides["B"])
    return tensors


class LoRAChecker:
    """The frontend's check of a request's adapter (``AsyncEngine.generate``), before its
    request is sent: adapters on (``enabled``), the request's fields, one adapter per
    ``lora_int_id``, and :func:`read_adapter` against the engine's projections (from its
    :class:`~stages.messages.EngineInfo`: ``lora_targets``, ``lora_layers``). An adapter
    that passed is not read again until its files change."""

    def __init__(self, enabled: bool, max_lora_rank: int) -> None:
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self._passed: dict[LoRARequest, tuple[object, ...] | None] = {}
        self._by_id: dict[int, LoRARequest] = {}

    def check(
        self, lora: object, targets: tuple[tuple[str, int, int], ...], num_layers: int
    ) -> LoRARequest:
        """``lora`` checked (see the class docstring).

        Raises:
            LoRAAdapterError: naming what is wrong.
        """
        if not self.enabled:
            raise LoRAAdapterError(
                "this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)",
                field="lora_request",
            )
        request = check_lora_request(lora)
        known = self._by_id.get(request.lora_int_id)
        if known is not None and known != request:
            raise LoRAAdapterError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; {request.lora_name!r} at {request.lora_path!r} needs "
                "an id of its own",
                field="lora_request",
            )
        signature = _signature(request.lora_path)
        if self._passed.get(request) != signature or signature is None:
            shapes = {name: LoRATarget(name, i, o) for name, i, o in targets}
            read_adapter(
                request.lora_path, shapes, num_layers, self.max_lora_rank,
                name=request.lora_name,
            )  # fmt: skip
            self._passed[request] = signature
            self._by_id[request.lora_int_id] = request
        return request


def _signature(path: str) -> tuple[object, ...] | None:
    """The size and modification time of an adapter's two files (None: not both there)."""
    try:
        stats = [os.stat(os.path.join(path, name)) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    except OSError:
        return None
    return tuple((stat.st_size, stat.st_mtime_ns) for stat in stats)
