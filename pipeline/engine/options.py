"""Engine options: one frozen dataclass, each field declared once with :func:`option` (its
help, check, CLI flag and the stage configs it is copied into; see
:mod:`pipeline.engine.option_fields` and docs/options.md), validated on construction, split
into each stage's own config by :mod:`pipeline.engine.presets`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.engine.option_fields import check_options, fed, option, refuse_clashes
from pipeline.engine.prefill_decode import (
    PrefillDecode,
    check_prefill_decode,
    parse_prefill_decode,
)
from pipeline.engine.ray_placement import PLACEMENT_STRATEGIES, check_ray_placement
from stages.execute.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    MODEL_IMPLS,
    OMP_WAIT_POLICIES,
    QUANT_ACTIVATIONS,
    QUANTIZATIONS,
    ExecuteConfig,
)
from stages.pooling import POOLING_TYPES
from stages.speculative import SpeculativeConfig, parse_speculative_config

__all__ = ["MAX_RESTART_BACKOFF", "TRANSPORTS", "EngineOptions"]

#: ``transport`` values: "memory" runs every stage in the calling process; the others run
#: admit, schedule and execute in a spawned engine process linked by that transport.
TRANSPORTS = ("zmq", "grpc", "memory")

#: the longest wait before a restart, however often the engine died (seconds)
MAX_RESTART_BACKOFF = 30.0

#: ``log_level`` values (any case)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: the help groups of the flags
_PARALLEL = "parallelism (docs/parallelism.md)"
_LIMITS = "rate limits (each API key; docs/serving.md)"
_SUPERVISION = "engine supervision (docs/serving.md, Health)"
_LORA = "LoRA adapters (docs/lora.md)"
#: the commands that run an engine and take its flags; serve's own; none
_ENGINE = ("generate", "serve")
_SERVE = ("serve",)
_NO_FLAG: tuple[str, ...] = ()


def _ray_flag(address: str | None) -> dict[str, Any]:
    """``--ray [ADDRESS]``: absent, no Ray; bare, Ray at RAY_ADDRESS or a new cluster."""
    return {"ray": address is not None, "ray_address": address or None}


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOptions:
    """Everything ``AsyncEngine(model, **options)`` and ``LLM(model, **options)`` accept; each
    field's help says what it means (docs/options.md has them all in one table).

    Raises (from the constructor): ValueError naming the first invalid field.
    """

    # -- model (docs/models.md)
    model: str = option(
        "smollm2-135m", help="alias, HF directory or .gguf file", kind="name",
        phrase="a non-empty alias or path", feeds=("execute",),
    )  # fmt: skip
    dtype: str = option(
        "float32", choices=DTYPES, feeds=("execute",),
        help="the weights' dtype (auto: bfloat16 on a CPU that multiplies it natively, else "
        "float32; the checkpoint's on CUDA)",
    )  # fmt: skip
    device: str = option("cpu", help="cpu, cuda, cuda:N or auto", feeds=("execute",))
    quantization: str | None = option(
        None, choices=QUANTIZATIONS, feeds=("execute",),
        help="weight-only 4/8-bit weights on CPU: a GGUF model's own (gguf) or int8 at load "
        "(docs/models.md)",
    )  # fmt: skip
    quant_activations: str = option(
        "auto", choices=QUANT_ACTIVATIONS, feeds=("execute",),
        help="the quantized linears' inputs: int8 (Q8_0 blocks, integer dot products, as "
        "llama.cpp), fp32 (weight-only, exact) or auto (int8 where the CPU has VNNI or AVX2; "
        "docs/models.md)",
    )  # fmt: skip
    model_impl: str = option(
        "auto", choices=MODEL_IMPLS, feeds=("execute",),
        help="actorline's own model class (native; auto: where it serves the model) or "
        "transformers' (docs/models.md)",
    )  # fmt: skip
    # -- KV cache
    block_size: int = option(16, help="tokens per KV cache block", kind="int>=1",
                             feeds=("execute", "router"), commands=_NO_FLAG)  # fmt: skip
    num_blocks: int | None = option(
        None, help="KV cache blocks, an exact count (None: sized from kv_cache_memory)",
        feeds=("execute",),
    )  # fmt: skip
    kv_cache_memory: int | None = option(
        None, help="KV cache bytes (None: the execute stage's default)", feeds=("execute",)
    )
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES, feeds=("execute",),
        help="what the KV cache stores (auto: the model's dtype, bf16 for bf16 weights; bf16 "
        "halves its bytes, doubling the blocks a kv_cache_memory holds)",
    )  # fmt: skip
    enable_prefix_caching: bool = option(
        True, kind="bool", flag="--no-prefix-caching", feeds=("execute",),
        help="reuse the KV blocks of a prompt's cached prefix (the flag turns it off)",
    )  # fmt: skip
    max_model_len: int | None = option(
        None, help="the longest sequence, prompt and answer (None: the model's)",
        feeds=("execute",),
    )  # fmt: skip
    # -- batching
    max_num_seqs: int = option(256, help="sequences in one batch", kind="int>=1",
                               feeds=("scheduler",))  # fmt: skip
    max_num_batched_tokens: int = option(2048, help="tokens in one batch", kind="int>=1",
                                         feeds=("scheduler",))  # fmt: skip
    long_prefill_chunk: int | None = option(
        None, help="prefill chunk of a long prompt (None: the batch's token budget)",
        feeds=("scheduler",), commands=_NO_FLAG,
    )  # fmt: skip
    #: a SpeculativeConfig, vLLM's keys as a mapping, or their JSON text (the flag's)
    speculative_config: SpeculativeConfig | None = option(  # noqa: RUF009 (frozen)
        None, feeds=("scheduler", "execute"), metavar="JSON",
        help="speculative decoding, vLLM's keys: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, \"prompt_lookup_min\": m} "
        "or {\"method\": \"draft_model\", \"model\": ..., \"num_speculative_tokens\": k} "
        "(docs/speculative.md)",
    )  # fmt: skip
    scheduler: str = option("fcfs", help="scheduling policy plugin name (actorline.schedulers)",
                            kind="name", phrase="a policy name",
                            feeds=("schedule.policy",))  # fmt: skip
    # -- structured outputs (docs/structured-outputs.md, "Bounds")
    grammar_backend: str = option(
        "llguidance", help="grammar backend plugin name (actorline.grammars)", kind="name",
        phrase="a grammar backend name", commands=_NO_FLAG,
    )  # fmt: skip
    #: stages.structured.limits.DEFAULT_MAX_RULES (not imported: this module stays light)
    grammar_max_rules: int = option(
        4000, help="the most rules of a request's Lark/GBNF grammar or objects of its JSON "
        "schema (the compile thread's stack is sized from it)",
    )  # fmt: skip
    #: stages.structured.params.MAX_SPEC_CHARS
    grammar_max_chars: int = option(
        256 * 1024, help="the longest schema, regex or grammar text of a request (at most "
        "262144)",
    )  # fmt: skip
    # -- tool calling and reasoning (docs/serving.md, "Tool calling")
    tool_call_parser: str = option(
        "", help="tool-call parser plugin (actorline.tool_parsers: hermes, llama3_json, "
        "mistral, generic); empty: the one the chat template suggests", feeds=("tokenize",),
        metavar="NAME",
    )  # fmt: skip
    reasoning_parser: str = option(
        "", help="reasoning parser plugin (actorline.reasoning_parsers: deepseek_r1, qwen3) "
        "that moves <think> text into reasoning_content; empty: none", feeds=("tokenize",),
        metavar="NAME",
    )  # fmt: skip
    # -- embeddings (docs/serving.md, "Embeddings")
    pooling_type: str = option(
        "last", choices=POOLING_TYPES, feeds=("execute",),
        help="how an embedding pools the prompt's final hidden states: the last token's "
        "(causal embedding models), their mean, or the first token's (cls)",
    )  # fmt: skip
    pooling_normalize: bool = option(
        True, kind="bool", feeds=("execute",),
        help="L2-normalize embeddings (a request's normalize field overrides it)",
    )  # fmt: skip
    # -- LoRA adapters (docs/lora.md)
    enable_lora: bool = option(
        False, kind="bool", feeds=("execute",), group=_LORA,
        help="serve requests with LoRA adapters (a request's lora_request; serve: "
        "--lora-modules)",
    )  # fmt: skip
    max_loras: int = option(
        1, kind="int>=1", feeds=("execute", "scheduler", "router"), group=_LORA,
        help="distinct adapters among the running requests (so in one batch); others wait",
    )  # fmt: skip
    max_lora_rank: int = option(16, kind="int>=1", feeds=("execute",), group=_LORA,
                                help="the highest adapter rank accepted")  # fmt: skip
    max_cpu_loras: int | None = option(
        None, feeds=("execute", "router"), group=_LORA,
        help="adapters kept loaded, the least recently used unloaded past it (None: "
        "max_loras; those of running requests always stay)",
    )  # fmt: skip
    enable_lora_runtime_updates: bool = option(
        False, kind="bool", commands=_SERVE, group=_LORA,
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
        "--enable-lora; also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    )  # fmt: skip
    # -- topology
    transport: str = option(
        "zmq", choices=TRANSPORTS,
        help="memory: every stage in this process; zmq or grpc: admit, schedule and execute "
        "in an engine process linked by it",
    )  # fmt: skip
    compression: str | None = option(None, help="compress what the links carry",
                                     choices=("zstd",), feeds=("start",))  # fmt: skip
    # -- admission (docs/serving.md, "Rate limits")
    max_queued_requests: int = option(4096, help="requests that may wait for the scheduler",
                                      kind="int>=1", feeds=("admit",),
                                      commands=_NO_FLAG)  # fmt: skip
    requests_per_second: float | None = option(
        None, help="default limit per API key (per server without keys)", commands=_SERVE,
        group=_LIMITS,
    )  # fmt: skip
    tokens_per_second: float | None = option(
        None, help="default limit per API key (prompt plus max_tokens)", commands=_SERVE,
        group=_LIMITS,
    )  # fmt: skip
    tenant_limits: Mapping[str, tuple[float | None, float | None]] = option(
        default_factory=dict, commands=_NO_FLAG,
        help="tenant name → (requests/s, tokens/s) (serve: from --api-key-file)",
    )  # fmt: skip
    rate_limit_burst: float = option(
        1.0, kind="seconds>0", commands=_SERVE, group=_LIMITS, metavar="SECONDS",
        help="seconds of its rate a key may spend at once; under a tokens/s limit also the "
        "largest request",
    )  # fmt: skip
    #: no flag: generate's --seed is the request's sampling seed
    seed: int = option(0, help="the engine's random seed", feeds=("execute",), commands=_NO_FLAG,
                       flag="--engine-seed")  # fmt: skip
    use_cuda_graphs: bool = option(
        True, kind="bool", feeds=("execute",), commands=_NO_FLAG,
        help="capture decode steps as CUDA graphs (on CPU: small decode steps as one native "
        "call, the step graph of stages.execute.step_graph)",
    )  # fmt: skip
    cuda_graph_max_batch_size: int = option(
        128, kind="int>=1", feeds=("execute",), commands=_NO_FLAG,
        help="largest decode batch captured as a CUDA graph (on CPU: run as one step-graph "
        "call where the weights are fp32 or bf16 panels; 16 for 4/8-bit weights)",
    )  # fmt: skip
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS, feeds=("execute",),
        help="how attention reads the paged KV cache: gather + SDPA (auto) or FlexAttention "
        "in place (flex; docs/architecture.md §6.4)",
    )  # fmt: skip
    omp_wait_policy: str = option(
        "auto", choices=OMP_WAIT_POLICIES, feeds=("execute", "start"),
        help="how the engine's OpenMP threads wait between parallel regions: a short spin, "
        "and one thread while the machine is oversubscribed (auto), spin (active) or sleep "
        "(passive); OMP_WAIT_POLICY or GOMP_SPINCOUNT set by you win (docs/performance.md §13)",
    )  # fmt: skip
    start_timeout: float = option(600.0, help="seconds the engine may take to start",
                                  feeds=("start",), commands=_NO_FLAG)  # fmt: skip
    log_level: str | None = option(
        None, help="the engine's log level (any case)", choices=LOG_LEVELS, upper=True,
        commands=_SERVE,
    )  # fmt: skip
    null_model: bool = option(
        False, kind="bool", commands=_NO_FLAG,
        help="random tokens at once instead of a model (stages.execute.null), real KV "
        "bookkeeping: the framework alone",
    )  # fmt: skip
    tune_gc: bool = option(
        True, kind="bool", feeds=("start",), commands=_NO_FLAG, flag="--no-tune-gc",
        help="raise the young-generation GC threshold while the engine runs, freeze the "
        "engine process's start-up heap (pipeline.runtime.gc_policy; the flag, of `bench "
        "ceiling`, leaves CPython's defaults: docs/performance.md §5)",
    )  # fmt: skip
    # -- parallelism (docs/parallelism.md)
    tensor_parallel_size: int = option(
        1, help="split the model over this many ranks, each a process", kind="int>=1",
        feeds=("execute",), group=_PARALLEL,
    )  # fmt: skip
    tensor_parallel_timeout: float = option(
        30.0, help="seconds a collective waits for a rank that hangs", kind="seconds>0",
        feeds=("execute",), commands=_NO_FLAG,
    )  # fmt: skip
    pipeline_parallel_size: int = option(
        1, help="split the model's layers over this many shards, each a process",
        kind="int>=1", feeds=("execute",), group=_PARALLEL,
    )  # fmt: skip
    pipeline_parallel_split: str | None = option(
        None, help="layers of each pipeline shard, comma-separated (e.g. 10,20; default: an "
        "even split)", feeds=("execute",), group=_PARALLEL, metavar="N,N,...",
    )  # fmt: skip
    pipeline_parallel_timeout: float = option(
        60.0, help="seconds a step waits for a pipeline shard that hangs", kind="seconds>0",
        feeds=("execute",), commands=_NO_FLAG,
    )  # fmt: skip
    pipeline_parallel_micro_batches: int | None = option(
        None, help="pipeline steps in flight at once, over disjoint requests, so the shards "
        "compute together (None: pipeline_parallel_size; 1: one step at a time)",
        kind="int>=1", feeds=("execute",), group=_PARALLEL,
    )  # fmt: skip
    data_parallel_size: int = option(
        1, help="run this many engine replicas behind a router stage", kind="int>=1",
        group=_PARALLEL,
    )  # fmt: skip
    prefill_decode: PrefillDecode | None = option(  # noqa: RUF009 (a tuple)
        None, group=_PARALLEL, metavar="P:D",
        help="disaggregated prefill and decode: P prefill and D decode engines behind the "
        "router, each prompt's KV blocks moved from one to the other (e.g. 1:1; not with "
        "data_parallel_size > 1)",
    )  # fmt: skip
    prefill_decode_timeout: float = option(
        30.0, kind="seconds>0", commands=_NO_FLAG,
        help="seconds a late KV transfer is waited for (after its prefill, or since its "
        "prefill engine's last step) before the request runs whole on a decode engine",
    )  # fmt: skip
    router: str = option(
        "least-loaded", help="routing policy plugin of the replicas (actorline.routers)",
        kind="name", phrase="a routing policy name", feeds=("router.policy",), group=_PARALLEL,
    )  # fmt: skip
    ray: bool = option(
        False, kind="bool", group=_PARALLEL, nargs="?", const="", cli_default=None,
        metavar="ADDRESS", from_flag=_ray_flag,
        help="run the engine's hosts as Ray actors, one placement group per replica "
        "(ray_placement_strategy), on the cluster at ADDRESS ('auto': the one running here; "
        "none: RAY_ADDRESS, else a new local cluster); needs actorline[ray]",
    )  # fmt: skip
    ray_address: str | None = option(
        None, kind="name", feeds=("start",), commands=_NO_FLAG,
        help="the Ray cluster (implies ray; None: RAY_ADDRESS, else a new local one; the CLI's "
        "--ray ADDRESS)",
    )  # fmt: skip
    ray_auth_token_file: str | None = option(
        None, kind="name", phrase="a file name", feeds=("start",), group=_PARALLEL,
        metavar="FILE",
        help="file holding the Ray cluster's token, where the cluster authenticates (default: "
        "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token, as Ray's CLI finds it)",
    )  # fmt: skip
    ray_placement_strategy: str = option(
        "auto", choices=("auto", *PLACEMENT_STRATEGIES), group=_PARALLEL,
        help="how each replica's placement group puts its hosts on Ray's nodes: auto is "
        "STRICT_PACK (one node) without pipeline parallelism, PACK with it (one node where "
        "the shards fit, else several); SPREAD or STRICT_SPREAD put the shards on different "
        "nodes",
    )  # fmt: skip
    ray_shard_resources: str | None = option(
        None, group=_PARALLEL, metavar="NAME,NAME,...",
        help="one Ray resource per pipeline shard, comma-separated, that the shard's node must "
        "have (one of `ray start --resources`, or node:IP; empty: any node): pins each shard "
        "to a node",
    )  # fmt: skip
    ray_prefill_decode_resources: str | None = option(
        None, group=_PARALLEL, metavar="PREFILL,DECODE",
        help="with prefill_decode on Ray: the Ray resource the prefill engines' nodes must "
        "have, then the decode engines' (empty: any node), such as 'node:10.0.0.5,decode_box'",
    )  # fmt: skip
    ray_num_cpus: float = option(1.0, help="CPUs each engine host takes on Ray",
                                 kind="number>=0", group=_PARALLEL)  # fmt: skip
    ray_num_gpus: float = option(
        0.0, kind="number>=0", group=_PARALLEL,
        help="GPUs each engine host takes on Ray (with --device cuda: each computes on the "
        "GPU Ray assigned it)",
    )  # fmt: skip
    # -- supervision (docs/serving.md, "Health")
    heartbeat_timeout: float = option(
        10.0, help="seconds an engine host may stay silent before it counts as frozen and is "
        "ended", kind="seconds>0", feeds=("start",), commands=_SERVE, group=_SUPERVISION,
        metavar="SECONDS",
    )  # fmt: skip
    restart_engine: bool = option(
        False, kind="bool", commands=_SERVE, group=_SUPERVISION, cli_default=True,
        help="start a fresh engine when it dies or freezes (off: health stays NOT_SERVING / "
        "503 until the command is restarted)",
    )  # fmt: skip
    restart_backoff: float = option(
        0.5, kind="seconds>=0", commands=_SERVE, group=_SUPERVISION, metavar="SECONDS",
        help="wait before a restart, doubled for each further death within the window, at "
        f"most {MAX_RESTART_BACKOFF:g} s",
    )  # fmt: skip
    restart_limit: int = option(
        5, kind="int>=1", commands=_SERVE, group=_SUPERVISION,
        help="this many deaths within --restart-window is a crash loop: exit with status 1",
    )  # fmt: skip
    restart_window: float = option(120.0, help="the crash loop's window", kind="seconds>0",
                                   commands=_SERVE, group=_SUPERVISION,
                                   metavar="SECONDS")  # fmt: skip

    def __post_init__(self) -> None:
        # NOTE: read first (a mapping or JSON text becomes its config; errors name the key)
        object.__setattr__(
            self, "speculative_config", parse_speculative_config(self.speculative_config)
        )
        object.__setattr__(self, "prefill_decode", parse_prefill_decode(self.prefill_decode))
        check_options(self)
        check_prefill_decode(self)
        # the rules across fields, and the checks of a value built from several fields
        from stages.structured.limits import GrammarLimits

        try:
            GrammarLimits(self.grammar_max_rules, self.grammar_max_chars)
        except ValueError as exc:
            raise ValueError(f"grammar_{exc}") from None
        import plugins
        from stages.tools import load_parser

        for name, group in (("tool_call_parser", plugins.TOOL_PARSERS),
                            ("reasoning_parser", plugins.REASONING_PARSERS)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a parser name, got {value!r}")
            if value:
                try:
                    load_parser(group, value)
                except plugins.PluginError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.quantization is None and self.quant_activations != "auto":
            raise ValueError(
                f"quant_activations {self.quant_activations!r} applies to quantized weights: "
                "set quantization ('gguf' or 'int8') or leave it 'auto'"
            )
        if self.ray_num_gpus > 0 and self.device == "cpu":
            raise ValueError(
                f"ray_num_gpus {self.ray_num_gpus:g} reserves GPUs for the engine's hosts, but "
                "device is 'cpu': give device 'cuda' (or 'auto') to compute on them"
            )
        if self.ray_auth_token_file is not None and not self.on_ray:
            raise ValueError(
                "ray_auth_token_file is the token of a Ray cluster, but the engine's hosts are "
                "not on Ray: give ray (--ray [ADDRESS]) or ray_address too"
            )
        check_ray_placement(self)
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
        if self.max_cpu_loras is not None and (
            type(self.max_cpu_loras) is not int or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be None or an integer >= max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras!r}"
            )
        if self.enable_lora_runtime_updates and not self.enable_lora:
            raise ValueError("enable_lora_runtime_updates loads LoRA adapters: needs enable_lora")
        if self.enable_lora and self.null_model:
            raise ValueError("enable_lora needs a model: null_model runs none")
        if self.speculative_config is not None and self.null_model:
            raise ValueError(
                "speculative_config needs a model to verify the drafts: null_model runs none "
                "(docs/speculative.md)"
            )
        if (
            self.speculative_config is not None
            and self.speculative_config.drafts_apart
            and not self.split_processes
        ):
            raise ValueError(
                "speculative_config placement 'host' runs the draft model in a process of its "
                "own; transport 'memory' keeps every stage in the calling process (use 'zmq' "
                "or 'grpc', or placement 'engine')"
            )
        if self.speculative_config is not None and self.speculative_config.drafts_in_execute:
            # the draft model's own options are execute options: checked as those now
            ExecuteConfig(**fed(self, "execute")).draft_config()
        if self.speculative_config is not None and self.enable_lora:
            raise ValueError(
                "speculative_config with enable_lora is not built yet: drafts are verified "
                "against the base model's rows only (docs/speculative.md, docs/lora.md)"
            )
        self._check_pipeline_parallel()
        if self.pipeline_parallel_size > 1 and (
            self.speculative_config is not None or self.enable_lora
        ):
            raise ValueError(
                "pipeline_parallel_size > 1 runs without speculative_config and enable_lora yet: "
                "the last shard samples each request's next token only, and the shards load no "
                "adapters (docs/parallelism.md)"
            )
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "give num_blocks (an exact block count) or kv_cache_memory (bytes), not both"
            )

    def _check_pipeline_parallel(self) -> None:
        """What pipeline parallelism combines with so far (docs/parallelism.md)."""
        if self.pipeline_parallel_split is not None:
            from stages.execute.config import parse_split

            try:
                counts = parse_split(self.pipeline_parallel_split)
            except ValueError:
                raise ValueError(
                    "pipeline_parallel_split must be comma-separated positive layer counts "
                    f"such as '10,20', got {self.pipeline_parallel_split!r}"
                ) from None
            assert counts is not None
            if len(counts) != self.pipeline_parallel_size:
                raise ValueError(
                    f"pipeline_parallel_split names {len(counts)} shards "
                    f"({self.pipeline_parallel_split}), but pipeline_parallel_size is "
                    f"{self.pipeline_parallel_size}"
                )
        size = self.pipeline_parallel_size
        micro_batches = self.pipeline_parallel_micro_batches
        if size == 1 and micro_batches is not None and micro_batches > 1:
            raise ValueError(
                f"pipeline_parallel_micro_batches {micro_batches} needs pipeline_parallel_size "
                "> 1: several steps in flight keep pipeline shards busy at once; one engine "
                "runs one step at a time"
            )
        if size == 1:
            return
        clashes = (
            ("null_model (no model to split)", self.null_model),
            ("transport 'memory' (every stage in the calling process; use 'zmq' or 'grpc')",
             not self.split_processes),
        )  # fmt: skip
        refuse_clashes(f"pipeline_parallel_size {size}", clashes, "Pipeline parallelism")

    @property
    def steps_in_flight(self) -> int:
        """The scheduler's ``max_steps_in_flight``: ``pipeline_parallel_micro_batches``, by
        default the pipeline size (one without pipeline parallelism)."""
        return self.pipeline_parallel_micro_batches or self.pipeline_parallel_size

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
