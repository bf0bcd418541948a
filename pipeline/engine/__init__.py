"""The LLM engine built on the runtime and the stages: :class:`AsyncEngine` (the async API),
:class:`LLM` (its synchronous offline wrapper), the options, the default pipeline and its
metrics."""

from __future__ import annotations

from pipeline.engine.async_engine import AsyncEngine, EngineObserver
from pipeline.engine.errors import EngineCrashLoopError, EngineDeadError, WrongEventLoopError
from pipeline.engine.llm import LLM
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import ENGINE_HOST, llm_pipeline
from pipeline.engine.prompts import Prompt

__all__ = [
    "ENGINE_HOST",
    "LLM",
    "AsyncEngine",
    "EngineCrashLoopError",
    "EngineDeadError",
    "EngineObserver",
    "EngineOptions",
    "Prompt",
    "WrongEventLoopError",
    "llm_pipeline",
]
