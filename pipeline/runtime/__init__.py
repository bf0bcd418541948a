"""The generic actor runtime: stages, pipeline graphs, hosts, supervision, shutdown.

Nothing here knows about LLMs; :mod:`pipeline.engine` builds the LLM engine on it.
"""

from __future__ import annotations

from pipeline.runtime.caller import Caller
from pipeline.runtime.errors import (
    CallOverflowError,
    DeadlockError,
    GraphError,
    HostDiedError,
    HostUnresponsiveError,
    PeerLostError,
    PipelineClosedError,
    PipelineError,
    StageFailedError,
    UnhandledMessageError,
)
from pipeline.runtime.graph import Pipeline
from pipeline.runtime.replicas import ReplicaLost, ReplicaSet, ReplicaStatus
from pipeline.runtime.running import RunningPipeline, StartOptions
from pipeline.runtime.spec import BOUNDARY, MAIN_HOST, Endpoint, Link, StageSpec
from pipeline.runtime.stage import Stage, handles

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
    "ReplicaLost",
    "ReplicaSet",
    "ReplicaStatus",
    "RunningPipeline",
    "Stage",
    "StageFailedError",
    "StageSpec",
    "StartOptions",
    "UnhandledMessageError",
    "handles",
]
