"""Engine options: one frozen dataclass, validated on construction, split into each stage's
own config by :mod:`pipeline.engine.presets`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from stages.execute.config import ATTENTION_BACKENDS

__all__ = ["MAX_RESTART_BACKOFF", "TRANSPORTS", "EngineOptions"]

#: ``transport`` values: "memory" runs every stage in the calling process; the others run
#: admit, schedule and execute in a spawned engine process linked by that transport.
TRANSPORTS = ("zmq", "grpc", "memory")

#: the longest wait before a restart, however often the engine died (seconds)
MAX_RESTART_BACKOFF = 30.0

#: ``log_level`` values (any case)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOptions:
    """Everything ``AsyncEngine(model, **options)`` and ``LLM(model, **options)`` accept.

    Model: ``model`` (alias, HF directory or .gguf), ``dtype`` ("float32", "bfloat16",
    "auto"), ``device`` ("cpu", "cuda", "auto"), ``quantization`` (None; "gguf": a GGUF
    model's own 4/8-bit weights as they are; "int8": any checkpoint's linears quantized at
    load; weight-only with fp32 activations, on CPU: docs/models.md), ``model_impl`` ("auto":
    actorline's own model class where it serves the checkpoint, else transformers'; "native";
    "transformers"; as vLLM's ``--model-impl``, docs/models.md), ``attention_backend`` ("auto":
    gather + SDPA; "flex": FlexAttention reading the block tables in place;
    docs/architecture.md §6.4). KV cache:
    ``block_size``, ``num_blocks`` (an exact count) or ``kv_cache_memory`` (bytes),
    ``enable_prefix_caching``, ``max_model_len``.
    Batching: ``max_num_seqs``, ``max_num_batched_tokens``, ``long_prefill_chunk``,
    ``scheduler`` (a policy name in ``actorline.schedulers``). Structured outputs:
    ``grammar_backend`` (a name in ``actorline.grammars``; "llguidance" built in),
    ``grammar_max_rules`` (the most rules of a Lark/GBNF grammar or objects of a JSON schema
    a request may bring; the compile thread's stack is sized from it) and
    ``grammar_max_chars`` (the longest schema, regex or grammar text; at most 256 KiB):
    ``stages/structured/limits.py``, docs/structured-outputs.md "Bounds".
    Topology: ``transport`` ("zmq", "grpc", "memory"), ``compression`` ("zstd" or None).
    Admission:
    ``max_queued_requests``, ``requests_per_second`` / ``tokens_per_second`` (default limits
    per tenant), ``tenant_limits`` (name → (requests/s, tokens/s)), ``rate_limit_burst``
    (seconds of its rate each tenant's buckets hold: the largest burst a tenant may send at
    once, and so also the largest request, prompt plus ``max_tokens``, under a tokens/s
    limit). Benchmarking:
    ``null_model`` replaces the model with :mod:`stages.execute.null` (random tokens at once,
    real KV bookkeeping) to measure the framework alone. Process: ``tune_gc`` (default on)
    raises the garbage collector's young-generation threshold while the engine runs and
    freezes the engine process's start-up heap (see :mod:`pipeline.runtime.gc_policy`).
    Parallelism (``docs/parallelism.md``): ``tensor_parallel_size`` splits the model over that
    many ranks, each a process (``tensor_parallel_timeout``: seconds a collective waits for a
    rank that hangs); ``data_parallel_size`` runs that many engine replicas behind a router
    stage (``router``: a policy name in ``actorline.routers``). Ray: ``ray`` runs every engine
    host (each replica's, each rank's) as a Ray actor, one placement group per replica
    (``STRICT_PACK``: a replica's ranks share a node), ``ray_num_cpus`` CPUs and
    ``ray_num_gpus`` GPUs per host (each rank then computes on the GPU Ray assigned it), on the
    cluster at ``ray_address`` (which implies ``ray``; None: ``RAY_ADDRESS``, else a new local
    cluster).
    Supervision (docs/serving.md, "Health"): ``heartbeat_timeout`` (seconds an engine host may
    stay silent before it counts as frozen and is ended, 10); ``restart_engine`` (default off;
    on under ``actorline serve``) starts a fresh engine when it dies or freezes, after
    ``restart_backoff`` seconds (doubled for each further death within the window, at most
    :data:`MAX_RESTART_BACKOFF`), and gives up once it died ``restart_limit`` times within
    ``restart_window`` seconds.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str | None = None
    model_impl: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int | None = None
    scheduler: str = "fcfs"
    grammar_backend: str = "llguidance"
    #: stages.structured.limits.DEFAULT_MAX_RULES (not imported: this module stays light)
    grammar_max_rules: int = 4000
    #: stages.structured.params.MAX_SPEC_CHARS
    grammar_max_chars: int = 256 * 1024
    transport: str = "zmq"
    compression: str | None = None
    max_queued_requests: int = 4096
    requests_per_second: float | None = None
    tokens_per_second: float | None = None
    tenant_limits: Mapping[str, tuple[float | None, float | None]] = dataclasses.field(
        default_factory=dict
    )
    rate_limit_burst: float = 1.0
    seed: int = 0
    use_cuda_graphs: bool = True
    attention_backend: str = "auto"
    start_timeout: float = 600.0
    log_level: str | None = None
    null_model: bool = False
    tune_gc: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 30.0
    data_parallel_size: int = 1
    router: str = "least-loaded"
    ray: bool = False
    ray_address: str | None = None
    ray_num_cpus: float = 1.0
    ray_num_gpus: float = 0.0
    heartbeat_timeout: float = 10.0
    restart_engine: bool = False
    restart_backoff: float = 0.5
    restart_limit: int = 5
    restart_window: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty alias or path")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queued_requests",
            "tensor_parallel_size",
            "data_parallel_size",
            "restart_limit",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("null_model", "tune_gc", "ray", "restart_engine"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if not isinstance(self.scheduler, str) or not self.scheduler:
            raise ValueError(f"scheduler must be a policy name, got {self.scheduler!r}")
        if not isinstance(self.grammar_backend, str) or not self.grammar_backend:
            raise ValueError(
                f"grammar_backend must be a grammar backend name, got {self.grammar_backend!r}"
            )
        from stages.structured.limits import GrammarLimits

        try:
            GrammarLimits(self.grammar_max_rules, self.grammar_max_chars)
        except ValueError as exc:
            raise ValueError(f"grammar_{exc}") from None
        if not isinstance(self.router, str) or not self.router:
            raise ValueError(f"router must be a routing policy name, got {self.router!r}")
        timeout = self.tensor_parallel_timeout
        if type(timeout) not in (int, float) or not 0 < timeout < math.inf:
            raise ValueError(
                f"tensor_parallel_timeout must be a number of seconds > 0, got {timeout!r}"
            )
        if self.ray_address is not None and (
            not isinstance(self.ray_address, str) or not self.ray_address
        ):
            raise ValueError(f"ray_address must be a non-empty string, got {self.ray_address!r}")
        for name in ("ray_num_cpus", "ray_num_gpus"):
            amount = getattr(self, name)
            if type(amount) not in (int, float) or not 0 <= amount < math.inf:
                raise ValueError(f"{name} must be a number >= 0, got {amount!r}")
        if self.ray_num_gpus > 0 and self.device == "cpu":
            raise ValueError(
                f"ray_num_gpus {self.ray_num_gpus:g} reserves GPUs for the engine's hosts, but "
                "device is 'cpu': give device 'cuda' (or 'auto') to compute on them"
            )
        if self.on_ray and not self.split_processes:
            raise ValueError(
                "ray places the engine's hosts on Ray; transport 'memory' keeps every stage in "
                "the calling process (use 'zmq' or 'grpc')"
            )
        if self.null_model and self.tensor_parallel_size > 1:
            raise ValueError(
                "null_model runs no model, so there is nothing to split: tensor_parallel_size "
                "must be 1 with it"
            )
        if not self.split_processes and (
            self.tensor_parallel_size > 1 or self.data_parallel_size > 1
        ):
            raise ValueError(
                "tensor_parallel_size and data_parallel_size > 1 run the engine in processes "
                "of its own; transport 'memory' keeps every stage in the calling process "
                "(use 'zmq' or 'grpc')"
            )
        for name in ("heartbeat_timeout", "restart_window"):
            seconds = getattr(self, name)
            if type(seconds) not in (int, float) or not 0 < seconds < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0, got {seconds!r}")
        backoff = self.restart_backoff
        if type(backoff) not in (int, float) or not 0 <= backoff < math.inf:
            raise ValueError(f"restart_backoff must be a number of seconds >= 0, got {backoff!r}")
        burst = self.rate_limit_burst
        if type(burst) not in (int, float) or not 0 < burst < math.inf:
            raise ValueError(f"rate_limit_burst must be a number of seconds > 0, got {burst!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "give num_blocks (an exact block count) or kv_cache_memory (bytes), not both"
            )
        if self.log_level is not None and (
            not isinstance(self.log_level, str) or self.log_level.upper() not in LOG_LEVELS
        ):
            raise ValueError(
                f"log_level must be one of {LOG_LEVELS} or None, got {self.log_level!r}"
            )

    @classmethod
    def create(cls, model: str | None = None, **options: Any) -> EngineOptions:
        """Build options from keyword arguments.

        Raises:
            TypeError: an unknown option name (the error lists the known ones).
            ValueError: an invalid value.
        """
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if model is not None:
            options["model"] = model
        return cls(**options)

    @property
    def on_ray(self) -> bool:
        """Whether the engine's hosts run on Ray."""
        return self.ray or self.ray_address is not None

    @property
    def split_processes(self) -> bool:
        """Whether the engine stages run in their own process."""
        return self.transport != "memory"
