"""Typed errors survive pickle with their message and attributes: an error raised in a
benchmark's worker process reaches the parent through pickle, and one whose ``__init__`` is not
``(message,)`` used to break the pool instead (``BrokenProcessPool`` hiding an
``ExecuteConfigError`` from ``bench offline --tensor-parallel-size 2``)."""

from __future__ import annotations

import pickle

import pytest

from pipeline.engine.errors import EngineCrashLoopError, EngineDeadError
from pipeline.runtime.errors import (
    DeadlockError,
    HostDiedError,
    HostUnresponsiveError,
    StageFailedError,
)
from plugins import PluginNotFoundError
from stages.errors import InvalidRequestError
from stages.execute.allocator import OutOfBlocksError
from stages.execute.config import ExecuteConfigError
from stages.models import ModelCacheCorruptError, ModelCacheFullError

ERRORS = [
    StageFailedError("execute", "engine", "ValueError", "bad", "Traceback ..."),
    DeadlockError("main", ("a", "b"), (1, 2)),
    HostDiedError("engine", -9, "killed"),
    HostUnresponsiveError("engine", "stopped", seconds=10.0),
    EngineDeadError("engine", None, "gone", unresponsive_for=10.0),
    EngineCrashLoopError(5, 120.0, "host 'engine' died (killed by signal 9)"),
    ExecuteConfigError("tensor_parallel_size", "must divide the 3 KV heads, not 2"),
    OutOfBlocksError("r1", 4, 1),
    PluginNotFoundError("actorline.schedulers", "nope", ["fcfs", "priority"]),
    InvalidRequestError("max_tokens must be >= 1", field="max_tokens", request_id="r1"),
    ModelCacheCorruptError("/c/model.safetensors", "is missing", "actorline models prepare x"),
    ModelCacheFullError("/c/models", 541_700_000, 65_536),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_an_error_round_trips_through_pickle(error: Exception) -> None:
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is type(error)
    assert str(restored) == str(error)
    assert restored.args == error.args
    assert vars(restored) == vars(error)
