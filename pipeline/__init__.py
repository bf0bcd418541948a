"""actorline: LLM inference as a pipeline of asyncio actors. The names users import.

The runtime (:mod:`pipeline.runtime`: stages, pipelines, hosts, supervision) is imported
eagerly and is light. The LLM façade (``LLM``, ``AsyncEngine``, ``SamplingParams``, ...)
imports the stages, which import the runtime, so its names are resolved lazily on first
access (docs/architecture.md §1.2).
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.runtime import (
    BOUNDARY,
    MAIN_HOST,
    Caller,
    CallOverflowError,
    DeadlockError,
    Endpoint,
    GraphError,
    HostDiedError,
    HostUnresponsiveError,
    Link,
    PeerLostError,
    Pipeline,
    PipelineClosedError,
    PipelineError,
    RunningPipeline,
    Stage,
    StageFailedError,
    StageSpec,
    StartOptions,
    UnhandledMessageError,
    handles,
)

# façade name -> module that defines it (imported on first access)
_LAZY = {
    "AsyncEngine": "pipeline.engine",
    "LLM": "pipeline.engine",
    "EngineOptions": "pipeline.engine",
    "EngineDeadError": "pipeline.engine",
    "EngineCrashLoopError": "pipeline.engine",
    "WrongEventLoopError": "pipeline.engine",
    "SamplingParams": "stages.params",
    "StructuredOutputsParams": "stages.structured.params",
    "PoolingParams": "stages.pooling",
    "LoRARequest": "stages.lora",
    "LoRAAdapterError": "stages.lora",
    "EmbeddingRequestOutput": "pipeline.engine.embeddings",
    "ChatMessage": "stages.messages",
    "Logprobs": "stages.messages",
    "RequestError": "stages.errors",
    "RequestFailedError": "stages.errors",
    "InvalidRequestError": "stages.errors",
    "PromptTooLongError": "stages.errors",
    "RateLimitedError": "stages.errors",
    "OverloadedError": "stages.errors",
    "llm_pipeline": "pipeline.engine",
    "Client": "pipeline.server.client",
    "EngineMetrics": "pipeline.engine.metrics",
    "EngineObserver": "pipeline.engine",
    "AsyncClient": "pipeline.server.client",
}

__all__ = [
    "BOUNDARY",
    "MAIN_HOST",
    "CallOverflowError",
    "Caller",
    "DeadlockError",
    "Endpoint",
    "GraphError",
    "HostDiedError",
    "HostUnresponsiveError",
    "Link",
    "PeerLostError",
    "Pipeline",
    "PipelineClosedError",
    "PipelineError",
    "RunningPipeline",
    "Stage",
    "StageFailedError",
    "StageSpec",
    "StartOptions",
    "UnhandledMessageError",
    "handles",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
