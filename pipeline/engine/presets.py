"""The default LLM pipeline, as an ordinary :class:`~pipeline.runtime.graph.Pipeline`.

Like vLLM V1, a frontend host (tokenize, detokenize, stop-check and the API, in the calling
process) and an engine host (admit, schedule, execute, in a spawned process) linked over ZMQ
by default::

    [requests] → tokenize ─out→ admit ─out→ schedule ─execute→ execute ─out→ schedule
                    │track        │rejected     │out    ▲abort        └info→ schedule, admit
                    ▼             ▼             ▼       │
                 detokenize ◀─────┴─────────────┘       │
                    │out                                │
                    ▼                                   │
                 stop_check ─abort──────────────────────┘  (abort also → detokenize)
                    │out
                    ▼
                  parse  (reasoning, tool calls; tokenize.track registers its requests)
                    │out
                    ▼
                [outputs]                   [aborts] → schedule.abort, detokenize

The returned pipeline can be edited before it runs: insert a stage after detokenize, replace
the scheduler stage, re-place a stage on another host.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from pipeline.engine.option_fields import fed
from pipeline.engine.options import EngineOptions
from pipeline.engine.ray_placement import (
    engine_role_pin,
    group_bundles,
    parse_shard_resources,
    placement_strategy,
)
from pipeline.runtime.graph import Pipeline
from pipeline.runtime.ray_hosts import RayHost, RayPlacementGroup, require_ray
from pipeline.runtime.running import StartOptions
from pipeline.runtime.spec import MAIN_HOST

if TYPE_CHECKING:
    from stages.execute.config import ExecuteConfig

__all__ = [
    "ENGINE_HOST",
    "ENGINE_PRELOAD",
    "REPLICA_SET",
    "TRANSFORMERS_PRELOAD",
    "check_parallelism",
    "engine_bundle",
    "engine_preload",
    "llm_pipeline",
    "options_of",
    "pipeline_parallel_host",
    "replica_suffix",
    "start_options",
    "tensor_parallel_host",
]

#: the host of admit, schedule and execute when the engine runs in its own process
ENGINE_HOST = "engine"
#: the replica set of the engine replicas, with data parallelism
REPLICA_SET = "engines"
#: what the engine host imports before anything else when it is prespawned
#: (pipeline.runtime.prespawn): its stages, torch, and the parts of transformers that loading
#: a causal LM imports lazily
ENGINE_PRELOAD = (
    "stages.execute.stage",
    "stages.execute.runner",
    "stages.schedule",
    "stages.admit",
)
#: what it imports besides when transformers' model classes will load the model (a model
#: actorline's own classes serve, stages.execute.llama, never imports them)
TRANSFORMERS_PRELOAD = (
    "transformers:AutoModelForCausalLM",
    "transformers:AutoConfig",
    "transformers.modeling_utils",
    "transformers.activations",
    "transformers.generation.utils",
)


def engine_preload(model: str, model_impl: str = "auto") -> tuple[str, ...]:
    """What a prespawned engine host of ``model`` imports first: transformers' modeling stack
    only where the model will load through it (docs/performance.md §3)."""
    from stages.execute.model_impl import native_config
    from stages.models import ModelError, resolve_model

    native = False
    if model_impl != "transformers":
        try:
            native = native_config(resolve_model(model).path) is not None
        except ModelError:
            pass  # the engine reports it when it loads
    return ENGINE_PRELOAD if native else ENGINE_PRELOAD + TRANSFORMERS_PRELOAD


#: the options each pipeline llm_pipeline built was built from (edits keep the object)
_BUILT_FROM: weakref.WeakKeyDictionary[Pipeline, EngineOptions] = weakref.WeakKeyDictionary()


def options_of(pipeline: Pipeline) -> EngineOptions | None:
    """The options :func:`llm_pipeline` built ``pipeline`` from (None: not built by it)."""
    return _BUILT_FROM.get(pipeline)


def llm_pipeline(options: EngineOptions | None = None) -> Pipeline:
    """The default LLM pipeline for ``options`` (entries ``requests`` and ``aborts``, exits
    ``outputs`` and ``engine_info``)."""
    from stages.admit import AdmitConfig, AdmitStage, TenantLimits
    from stages.detokenize import DetokenizeConfig, DetokenizeStage
    from stages.execute.config import ExecuteConfig
    from stages.execute.stage import ExecuteStage
    from stages.parse import ParseStage
    from stages.schedule import ScheduleConfig, ScheduleStage
    from stages.scheduler import SchedulerConfig
    from stages.stop_check import StopCheckStage
    from stages.structured.limits import GrammarLimits
    from stages.structured.manager import GrammarConfig
    from stages.tokenize import TokenizeConfig, TokenizeStage

    options = options or EngineOptions()
    engine = ENGINE_HOST if options.split_processes else MAIN_HOST
    admit = AdmitConfig(
        **fed(options, "admit"),
        default_limits=TenantLimits(
            options.requests_per_second, options.tokens_per_second, options.rate_limit_burst
        ),
        tenant_limits={
            name: TenantLimits(requests, tokens, options.rate_limit_burst)
            for name, (requests, tokens) in options.tenant_limits.items()
        },
    )
    schedule = ScheduleConfig(
        SchedulerConfig(**fed(options, "scheduler"), max_steps_in_flight=options.steps_in_flight),
        **fed(options, "schedule"),
        grammar=GrammarConfig(
            options.model,
            backend=options.grammar_backend,
            limits=GrammarLimits(options.grammar_max_rules, options.grammar_max_chars),
        ),
    )
    # NOTE: the plain copies come from each option's ``feeds`` (pipeline.engine.options); the
    # values built from several options (limits, the grammar config) are written here
    execute = ExecuteConfig(**fed(options, "execute"))
    pipeline = Pipeline("llm")
    pipeline.add(
        "tokenize", TokenizeStage, TokenizeConfig(options.model, **fed(options, "tokenize"))
    )
    replicas = engine_replicas(options)
    for index in range(replicas):
        suffix = replica_suffix(index)
        replica_execute = execute
        if options.prefill_decode is not None and index < options.prefill_decode[0]:
            replica_execute = dataclasses.replace(execute, kv_export=True)  # a prefill engine
        replica_schedule = schedule
        if replicas > 1:
            replica_schedule = dataclasses.replace(
                schedule, scheduler=dataclasses.replace(schedule.scheduler, replica=str(index))
            )
        host = engine + suffix
        pipeline.add(f"admit{suffix}", AdmitStage, admit, host=host)
        pipeline.add(f"schedule{suffix}", ScheduleStage, replica_schedule, host=host)
        if options.null_model:
            from stages.execute.null import NullExecuteStage

            pipeline.add(f"execute{suffix}", NullExecuteStage, execute, host=host)
        else:
            pipeline.add(f"execute{suffix}", ExecuteStage, replica_execute, host=host)
            _add_ranks(pipeline, f"execute{suffix}", execute, host)
            _add_shards(pipeline, f"execute{suffix}", execute, host)
            _add_drafter(pipeline, f"execute{suffix}", replica_execute, host, suffix)
    pipeline.add("detokenize", DetokenizeStage, DetokenizeConfig(options.model))
    pipeline.add("stop_check", StopCheckStage)
    pipeline.add("parse", ParseStage)

    if replicas == 1:
        pipeline.connect("tokenize.out", "admit.in")
    else:
        _add_router(pipeline, options)
    pipeline.connect("tokenize.track", "detokenize")
    pipeline.connect("tokenize.rejected", "detokenize")
    # with replicas, what the engines send the frontend passes through the router
    front = "detokenize" if replicas == 1 else "router.outputs"
    for index in range(replicas):
        suffix = replica_suffix(index)
        admit_stage, schedule_stage = f"admit{suffix}", f"schedule{suffix}"
        execute_stage = f"execute{suffix}"
        pipeline.connect(f"{admit_stage}.out", f"{schedule_stage}.in")
        pipeline.connect(f"{admit_stage}.rejected", front)
        pipeline.connect(f"{schedule_stage}.rejected", front)
        pipeline.connect(f"{schedule_stage}.execute", execute_stage)
        pipeline.connect(f"{execute_stage}.out", f"{schedule_stage}.result")
        pipeline.connect(f"{execute_stage}.info", f"{schedule_stage}.result")
        pipeline.connect(f"{execute_stage}.info", f"{admit_stage}.info")
        pipeline.connect(f"{schedule_stage}.stats", f"{admit_stage}.stats")
        pipeline.connect(f"{schedule_stage}.out", front)
    pipeline.connect("detokenize", "stop_check")
    # the parse stage follows the requests whose output it reads (reasoning, tool calls)
    pipeline.connect("tokenize.track", "parse")
    pipeline.connect("stop_check.out", "parse")
    # the engine sends nothing more for an aborted request, so detokenize must hear of it too
    aborts = "schedule.abort" if replicas == 1 else "router.abort"
    pipeline.connect("stop_check.abort", aborts)
    pipeline.connect("stop_check.abort", "detokenize")

    pipeline.entry("requests", "tokenize")
    pipeline.entry("aborts", aborts, "detokenize", "parse")
    pipeline.exit("outputs", "parse.out")
    engine_info = "execute.info" if replicas == 1 else "router.info"
    pipeline.exit("engine_info", engine_info)
    # tokenize refuses text too long for the model's length before tokenizing it
    pipeline.connect(engine_info, "tokenize")
    if replicas > 1:
        pipeline.replica_set(
            REPLICA_SET,
            {
                str(index): _replica_hosts(engine + replica_suffix(index), options)
                for index in range(replicas)
            },
        )
    _BUILT_FROM[pipeline] = options
    return pipeline


def engine_replicas(options: EngineOptions) -> int:
    """How many engine replicas ``options`` run: ``data_parallel_size``, or with
    ``prefill_decode=(P, D)`` P + D (replicas 0..P-1 the prefill engines)."""
    if options.prefill_decode is not None:
        return sum(options.prefill_decode)
    return options.data_parallel_size


def replica_suffix(index: int) -> str:
    """What the names of engine replica ``index``'s stages and host end with: replica 0 is
    the engine of one replica (``admit``, ``schedule``, ``execute`` on ``engine``), replica
    ``k`` has ``admit_k`` ... on ``engine_k``."""
    return "" if index == 0 else f"_{index}"


def _replica_hosts(host: str, options: EngineOptions) -> tuple[str, ...]:
    """The hosts of the engine replica on ``host``: its own and its ranks', then its later
    pipeline shards' (a shard that dies is a dead replica)."""
    return tuple(name for name, _ in _replica_shards(host, options))


def _replica_shards(host: str, options: EngineOptions) -> tuple[tuple[str, int], ...]:
    """:func:`_replica_hosts`, each with the pipeline shard it computes (0: the first): each
    shard's host, then its tensor-parallel ranks' (PP x TP: every shard a TP group)."""
    ranks = 1 if options.null_model else options.tensor_parallel_size
    shards = 1 if options.null_model else options.pipeline_parallel_size
    return tuple(
        (tensor_parallel_host(leader, rank) if rank else leader, shard)
        for shard, leader in enumerate(
            (host, *(pipeline_parallel_host(host, shard) for shard in range(1, shards)))
        )
        for rank in range(ranks)
    )


def _add_router(pipeline: Pipeline, options: EngineOptions) -> None:
    """The router stage in front of the replicas (``docs/architecture.md`` §8)."""
    from stages.route import ReplicaRoute, RouterConfig, RouterStage

    suffixes = [replica_suffix(index) for index in range(engine_replicas(options))]
    routes = tuple(
        ReplicaRoute(str(index), f"admit{suffix}", f"schedule{suffix}")
        for index, suffix in enumerate(suffixes)
    )
    config = RouterConfig(routes, replica_set=REPLICA_SET, **fed(options, "router"))
    if options.prefill_decode is None:
        pipeline.add("router", RouterStage, config)
    else:
        from stages.disaggregate import PrefillDecodeConfig, PrefillDecodeRouterStage

        prefill = tuple(route.name for route in routes[: options.prefill_decode[0]])
        config = PrefillDecodeConfig(
            **_fields_of(config),
            prefill=prefill,
            execute=tuple(f"execute{suffix}" for suffix in suffixes),
            transfer_timeout=options.prefill_decode_timeout,
        )
        pipeline.add("router", PrefillDecodeRouterStage, config)
        # one hop: each prefill engine's blocks go straight to the decode engine the router
        # chose (stages/disaggregate.py); the decode engines tell the router they came, and
        # the router tells them which to drop
        for decode in suffixes[len(prefill) :]:
            for source in suffixes[: len(prefill)]:
                pipeline.connect(f"execute{source}.kv", f"execute{decode}")
            pipeline.connect(f"execute{decode}.kv_arrived", "router.kv")
            pipeline.connect("router.kv_release", f"execute{decode}")
    pipeline.connect("tokenize.out", "router.in")
    pipeline.connect("router.out", "detokenize")
    for route, suffix in zip(routes, suffixes):
        pipeline.connect("router.requests", f"{route.admit}.in")
        pipeline.connect("router.aborts", f"{route.schedule}.abort")
        pipeline.connect(f"execute{suffix}.info", "router.info")


def _fields_of(config: Any) -> dict[str, Any]:
    """A dataclass instance's fields, by name (``dataclasses.asdict`` without its deep copy)."""
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


def tensor_parallel_host(engine_host: str, rank: int) -> str:
    """The host of tensor-parallel rank ``rank`` (>= 1) of the engine on ``engine_host``."""
    return f"{engine_host}_tp{rank}"


def _add_ranks(
    pipeline: Pipeline, execute: str, config: ExecuteConfig, engine_host: str, shard: int = 0
) -> None:
    """The other tensor-parallel ranks of the execute stage ``execute`` (or of pipeline shard
    ``shard``'s stage), each on its own host, fed by its ``ranks`` port
    (``docs/architecture.md`` §8)."""
    if config.tensor_parallel_size == 1:
        return  # NOTE: before the import: the rank stage's module imports torch
    from stages.execute.rank import RankConfig, TensorParallelRankStage

    for rank in range(1, config.tensor_parallel_size):
        name = f"{execute}_tp{rank}"
        host = tensor_parallel_host(engine_host, rank)
        pipeline.add(name, TensorParallelRankStage, RankConfig(config, rank, shard), host=host)
        pipeline.connect(f"{execute}.ranks", name)


def _draft_hosts(engine_host: str, options: EngineOptions) -> tuple[str, ...]:
    """The draft stage's host beside the engine on ``engine_host``, where the draft model
    is placed apart (``speculative_config`` ``"placement": "host"``)."""
    spec = options.speculative_config
    if spec is None or not spec.drafts_apart or options.null_model:
        return ()
    from stages.execute.draft_stage import draft_host

    return (draft_host(engine_host),)


def _add_drafter(
    pipeline: Pipeline, execute: str, config: ExecuteConfig, engine_host: str, suffix: str
) -> None:
    """The draft stage of the execute stage ``execute`` where the draft model is placed
    apart (docs/speculative.md "Where the draft model runs"): on a host of its own, fed by
    execute's ``draft`` port (the target's info, then the feeds), answering on execute's
    ``in``; the host an expendable replica set, so its loss costs drafts, never the
    pipeline."""
    spec = config.speculative_config
    if spec is None or not spec.drafts_apart or engine_host == MAIN_HOST:
        return  # NOTE: before the import, as _add_ranks
    from stages.execute.draft_stage import DraftStage, draft_host

    name = f"draft{suffix}"
    host = draft_host(engine_host)
    pipeline.add(name, DraftStage, config, host=host)
    pipeline.connect(f"{execute}.draft", name)
    pipeline.connect(f"{name}.out", f"{execute}.in")
    pipeline.replica_set(name, {"0": (host,)}, expendable=True)


def pipeline_parallel_host(engine_host: str, shard: int) -> str:
    """The host of pipeline shard ``shard`` (>= 1) of the engine on ``engine_host``."""
    return f"{engine_host}_pp{shard}"


def _add_shards(pipeline: Pipeline, execute: str, config: ExecuteConfig, engine_host: str) -> None:
    """The pipeline shards after the execute stage ``execute`` (its first), each on its own
    host, chained ``execute.pipeline → _pp1 → ... → execute.in``
    (``docs/architecture.md`` §8)."""
    size = config.pipeline_parallel_size
    if size == 1:
        return  # NOTE: before the import, as _add_ranks
    from stages.execute.pp_stage import PipelineShardConfig, PipelineShardStage

    previous = f"{execute}.pipeline"
    for shard in range(1, size):
        name = f"{execute}_pp{shard}"
        host = pipeline_parallel_host(engine_host, shard)
        pipeline.add(name, PipelineShardStage, PipelineShardConfig(config, shard), host=host)
        pipeline.connect(previous, name)
        _add_ranks(pipeline, name, config, host, shard)  # PP x TP: each shard a TP group
        previous = f"{name}.out"
    pipeline.connect(previous, f"{execute}.in")


def check_parallelism(options: EngineOptions) -> None:
    """Check, without loading the model, what data and tensor parallelism need of it: the
    routing policy constructs, the model's heads divide by ``tensor_parallel_size`` (read
    from its config).

    Raises:
        stages.models.ModelError: the model cannot be found or read.
        plugins.PluginError: the routing policy is missing, broken or invalid.
        ExecuteConfigError: the model cannot be split into that many ranks.
        RayUnavailableError: the engine is to run on Ray, which is not installed.
    """
    if options.on_ray:
        require_ray()
    if engine_replicas(options) > 1:
        from stages.router import load_router

        load_router(options.router)
    if options.tensor_parallel_size > 1:
        from stages.execute.model_impl import model_config
        from stages.execute.tensor_parallel import check_tensor_parallel
        from stages.models import resolve_model

        resolved = resolve_model(options.model)
        config = model_config(resolved.path, options.model_impl)  # as the engine will read it
        check_tensor_parallel(config, options.tensor_parallel_size, resolved.name)
    if options.pipeline_parallel_size > 1:
        from stages.execute.model_impl import model_config
        from stages.execute.pp_split import check_pipeline_parallel
        from stages.models import resolve_model

        resolved = resolve_model(options.model)
        config = model_config(resolved.path, options.model_impl)
        check_pipeline_parallel(
            config, options.pipeline_parallel_size, options.pipeline_parallel_split, resolved.name
        )


def engine_bundle(options: EngineOptions) -> dict[str, float]:
    """The resources one engine host (a replica's engine, or one of its tensor-parallel
    ranks) reserves in its replica's placement group: ``ray_num_cpus`` CPUs, and
    ``ray_num_gpus`` GPUs when there are any (a Ray bundle names only what it reserves)."""
    bundle = {"CPU": float(options.ray_num_cpus)}
    if options.ray_num_gpus > 0:
        bundle["GPU"] = float(options.ray_num_gpus)
    return bundle


def start_options(options: EngineOptions) -> StartOptions:
    """How to start the LLM pipeline for ``options`` (with ``options.on_ray``: every engine
    host a Ray actor, each replica's hosts in one placement group (``ray_placement_strategy``:
    ``STRICT_PACK`` by default, ``PACK`` with pipeline shards), pipeline shard k of the replica
    (its host and its tensor-parallel ranks) in bundle k, :func:`engine_bundle` per host and
    the shard's ``ray_shard_resources`` entry, a draft host placed apart a bundle of its own
    last (pinned as the first shard); :mod:`pipeline.engine.ray_placement`)."""
    transport = options.transport if options.split_processes else "zmq"
    hosts: dict[str, RayHost] = {}
    groups: dict[str, RayPlacementGroup] = {}
    if options.on_ray:
        engine = ENGINE_HOST
        cpus, gpus = options.ray_num_cpus, options.ray_num_gpus
        strategy = placement_strategy(
            options.ray_placement_strategy, options.pipeline_parallel_size
        )
        pins = parse_shard_resources(options.ray_shard_resources) or ("",) * (
            options.pipeline_parallel_size
        )
        for index in range(engine_replicas(options)):
            host = engine + replica_suffix(index)
            bundles, where = group_bundles(
                _replica_shards(host, options), _draft_hosts(host, options),
                engine_bundle(options), pins, engine_role_pin(options, index),
            )  # fmt: skip
            group = f"replica{index}"
            groups[group] = RayPlacementGroup(bundles, strategy)
            for host, bundle in where.items():
                hosts[host] = RayHost(
                    num_cpus=cpus, num_gpus=gpus, placement_group=group, bundle_index=bundle
                )
    return StartOptions(
        **fed(options, "start"),
        transport=transport,
        log_level=options.log_level.upper() if options.log_level else None,
        # NOTE: an idle sender beats five times per timeout (at most every second, the
        # runtime's default), so one late beat is no silence
        heartbeat_interval=min(1.0, options.heartbeat_timeout / 5),
        hosts=hosts,
        placement_groups=groups,
    )
