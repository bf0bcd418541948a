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
                [outputs]                   [aborts] → schedule.abort, detokenize

The returned pipeline can be edited before it runs: insert a stage after detokenize, replace
the scheduler stage, re-place a stage on another host.
"""

from __future__ import annotations

import weakref

from pipeline.engine.options import EngineOptions
from pipeline.runtime.graph import Pipeline
from pipeline.runtime.running import StartOptions
from pipeline.runtime.spec import MAIN_HOST

__all__ = ["ENGINE_HOST", "llm_pipeline", "options_of", "start_options"]

#: the host of admit, schedule and execute when the engine runs in its own process
ENGINE_HOST = "engine"

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
    from stages.schedule import ScheduleConfig, ScheduleStage
    from stages.scheduler import SchedulerConfig
    from stages.stop_check import StopCheckStage
    from stages.tokenize import TokenizeConfig, TokenizeStage

    options = options or EngineOptions()
    engine = ENGINE_HOST if options.split_processes else MAIN_HOST
    admit = AdmitConfig(
        max_queued_requests=options.max_queued_requests,
        default_limits=TenantLimits(
            options.requests_per_second, options.tokens_per_second, options.rate_limit_burst
        ),
        tenant_limits={
            name: TenantLimits(requests, tokens, options.rate_limit_burst)
            for name, (requests, tokens) in options.tenant_limits.items()
        },
    )
    schedule = ScheduleConfig(
        SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            long_prefill_chunk=options.long_prefill_chunk,
        ),
        policy=options.scheduler,
    )
    execute = ExecuteConfig(
        model=options.model,
        dtype=options.dtype,
        device=options.device,
        block_size=options.block_size,
        num_blocks=options.num_blocks,
        kv_cache_memory=options.kv_cache_memory,
        max_model_len=options.max_model_len,
        enable_prefix_caching=options.enable_prefix_caching,
        seed=options.seed,
        use_cuda_graphs=options.use_cuda_graphs,
    )
    pipeline = Pipeline("llm")
    pipeline.add("tokenize", TokenizeStage, TokenizeConfig(options.model))
    pipeline.add("admit", AdmitStage, admit, host=engine)
    pipeline.add("schedule", ScheduleStage, schedule, host=engine)
    if options.null_model:
        from stages.execute.null import NullExecuteStage

        pipeline.add("execute", NullExecuteStage, execute, host=engine)
    else:
        pipeline.add("execute", ExecuteStage, execute, host=engine)
    pipeline.add("detokenize", DetokenizeStage, DetokenizeConfig(options.model))
    pipeline.add("stop_check", StopCheckStage)

    pipeline.connect("tokenize.out", "admit.in")
    pipeline.connect("tokenize.track", "detokenize")
    pipeline.connect("tokenize.rejected", "detokenize")
    pipeline.connect("admit.out", "schedule.in")
    pipeline.connect("admit.rejected", "detokenize")
    pipeline.connect("schedule.rejected", "detokenize")
    pipeline.connect("schedule.execute", "execute")
    pipeline.connect("execute.out", "schedule.result")
    pipeline.connect("execute.info", "schedule.result")
    pipeline.connect("execute.info", "admit.info")
    pipeline.connect("schedule.stats", "admit.stats")
    pipeline.connect("schedule.out", "detokenize")
    pipeline.connect("detokenize", "stop_check")
    pipeline.connect("stop_check.abort", "schedule.abort")
    # the engine sends nothing more for an aborted request, so detokenize must hear of it too
    pipeline.connect("stop_check.abort", "detokenize")

    pipeline.entry("requests", "tokenize")
    pipeline.entry("aborts", "schedule.abort", "detokenize")
    pipeline.exit("outputs", "stop_check.out")
    pipeline.exit("engine_info", "execute.info")
    _BUILT_FROM[pipeline] = options
    return pipeline


def start_options(options: EngineOptions) -> StartOptions:
    """How to start the LLM pipeline for ``options``."""
    transport = options.transport if options.split_processes else "zmq"
    return StartOptions(
        transport=transport,
        compression=options.compression,
        start_timeout=options.start_timeout,
        log_level=options.log_level.upper() if options.log_level else None,
        tune_gc=options.tune_gc,
    )
