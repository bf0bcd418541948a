"""The execute stage: runs the model runner's steps on the stage's worker thread.

Ports: ``in`` (SchedulerStep); ``out`` (StepResult), ``info`` (EngineInfo, once, when the model
and KV cache are ready — linked to schedule and admit).
"""

from __future__ import annotations

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.runner import ModelRunner
from stages.messages import EngineInfo, SchedulerStep
from stages.models import loading

__all__ = ["ExecuteStage"]


class ExecuteStage(Stage):
    inputs = ("in",)
    outputs = ("out", "info")

    def __init__(self, config: ExecuteConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None

    async def start(self) -> None:
        self.runner = runner = ModelRunner(self.config)

        def load() -> EngineInfo:
            with loading():
                return runner.load()

        info = await self.run_in_thread(load)
        await self.emit("info", info)

    @handles(SchedulerStep)
    async def on_step(self, step: SchedulerStep) -> None:
        assert self.runner is not None
        result = await self.run_in_thread(self.runner.execute, step)
        await self.emit("out", result)
