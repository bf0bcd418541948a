"""actorline's actor runtime and user-facing API.

The runtime (stages, pipelines, hosts, supervision) is imported eagerly and is light. The LLM
façade (``LLM``, ``AsyncEngine``, ``SamplingParams``, ...) imports the stages, which import the
runtime, so its names are resolved lazily on first access (DESIGN §1).
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.caller import Caller
from pipeline.errors import (
    CallOverflowError,
    DeadlockError,
    EngineDeadError,
    GraphError,
    HostDiedError,
    HostUnresponsiveError,
    PeerLostError,
    PipelineClosedError,
    PipelineError,
    StageFailedError,
    UnhandledMessageError,
)
from pipeline.graph import BOUNDARY, MAIN_HOST, Endpoint, Link, Pipeline, StageSpec
from pipeline.runtime import RunningPipeline, StartOptions
from pipeline.stage import Stage, handles

# façade name -> module that defines it (imported on first access)
_LAZY = {
    "AsyncEngine": "pipeline.engine",
    "LLM": "pipeline.llm",
    "EngineOptions": "pipeline.options",
    "SamplingParams": "stages.params",
    "ChatMessage": "stages.messages",
    "Logprobs": "stages.messages",
    "RequestError": "stages.errors",
    "InvalidRequestError": "stages.errors",
    "PromptTooLongError": "stages.errors",
    "RateLimitedError": "stages.errors",
    "OverloadedError": "stages.errors",
    "llm_pipeline": "pipeline.presets",
    "Client": "pipeline.client",
    "EngineMetrics": "pipeline.metrics",
    "EngineObserver": "pipeline.engine",
    "AsyncClient": "pipeline.client",
}

__all__ = [
    "BOUNDARY",
    "MAIN_HOST",
    "CallOverflowError",
    "Caller",
    "DeadlockError",
    "EngineDeadError",
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
