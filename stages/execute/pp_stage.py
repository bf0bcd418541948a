"""The stages of pipeline parallelism (``docs/architecture.md`` §8, docs/parallelism.md
"Pipeline parallelism"): the shards after the first, and the first shard's side of a step.

Shard ``k`` (1 .. N-1) is a :class:`PipelineShardStage` on a host of its own (a process, or
a Ray actor on any node of the cluster: ``pipeline.engine.ray_placement``),
linked ``execute.pipeline → execute_pp1 → ... → execute_pp<N-1> → execute.in``.
It loads its layers when it starts (the engine starts when every shard has), then for each
:class:`~stages.execute.pp_messages.PipelineStep` runs its layers and sends the next shard
the hidden state, or, the last, samples the step's rows and sends what it sampled back to the
first shard (:mod:`stages.execute.pp_sampling`: tokens and logprobs, no logits).

The first shard is the execute stage; :class:`PipelineDriver` is its part of a step: run the
embeddings and its layers, send the step on with what the last shard samples it with, wait
for the sampled tokens (at most ``pipeline_parallel_timeout``), and hand them to the runner,
which records them as it records its own. A shard that dies
is a host that dies: the runtime's supervision fails the engine at once; one that hangs makes
the wait time out with :class:`~stages.execute.pp_split.PipelineParallelError`.

With ``tensor_parallel_size`` N > 1 (PP x TP) each shard is a tensor-parallel group: the
execute stage sends its ranks each step's ``ShardStep`` (port ``ranks``) before its layers run,
as without pipeline parallelism; a :class:`PipelineShardStage` is its shard's rank 0: it hosts
its ranks' rendezvous (port ``ranks``, to ``<execute>_pp<k>_tp<r>`` on hosts
``<engine>_pp<k>_tp<r>``), and hands them each step it receives before running its own part.
A rank that dies is a host that dies; one that hangs makes its shard's next all-reduce fail
after ``tensor_parallel_timeout``, which fails the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.pp_messages import PipelineSampled, PipelineSampling, PipelineStep
from stages.execute.pp_split import PipelineParallelError
from stages.messages import SchedulerStep, StepResult
from stages.models import loading
from transports.codec import Codec

if TYPE_CHECKING:
    from stages.execute.pp_sampling import FirstShardOutbox, LastShardStates
    from stages.execute.runner import ModelRunner, PreparedStep

__all__ = [
    "PipelineDriver",
    "PipelineShardConfig",
    "PipelineShardStage",
    "encoded_bytes",
    "hop_seconds",
    "shard_threads",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineShardConfig:
    """Shard ``shard`` (1 .. N-1) of the engine whose execute stage has config ``execute``.

    Raises:
        ValueError: ``shard`` is not one of the engine's shards after the first.
    """

    execute: ExecuteConfig
    shard: int

    def __post_init__(self) -> None:
        size = self.execute.pipeline_parallel_size
        if type(self.shard) is not int or not 1 <= self.shard < size:
            raise ValueError(f"shard must be an integer in [1, {size}), got {self.shard!r}")


class PipelineShardStage(Stage):
    inputs = ("in",)
    outputs = ("out", "ranks")
    optional_outputs = ("ranks",)

    def __init__(self, config: PipelineShardConfig) -> None:
        super().__init__(config)
        self.runner: ModelRunner | None = None
        self._store: object = None  # the shard's ranks' TCPStore, alive as long as the group
        self._idle_since = 0.0  # when this shard finished its last step (time.time())
        self.states: LastShardStates | None = None  # the last shard's sampling states

    @property
    def last(self) -> bool:
        return bool(self.config.shard == self.config.execute.pipeline_parallel_size - 1)

    async def start(self) -> None:
        # NOTE: imported here, not with the module: the frontend imports this class to build
        # the graph, and torch has no business on its side of the start-up. On the stage's
        # thread, so the host's loop keeps sending heartbeats meanwhile (as the execute
        # stage's start).
        from stages.execute.pp_tensor import shard_group

        rendezvous, self._store = await self.run_in_thread(shard_group, self.config.execute)
        if rendezvous is not None:
            await self.emit("ranks", rendezvous)

        def load() -> ModelRunner:
            from stages.execute.runner import ModelRunner

            execute = self.config.execute
            runner = ModelRunner(
                execute, shard=self.config.shard, rendezvous=rendezvous, store=self._store
            )
            threads = shard_threads(execute)
            if threads is not None:
                import torch

                torch.set_num_threads(threads)  # this worker thread's, where steps run
            with loading():
                runner.load()
            return runner

        self.runner = await self.run_in_thread(load)
        if self.last:
            from stages.execute.pp_sampling import LastShardStates

            self.states = LastShardStates()

    @handles(PipelineStep)
    async def on_step(self, step: PipelineStep) -> None:
        runner = self.runner
        assert runner is not None
        from stages.execute.pipeline_parallel import forward_layers, sample_step

        transfer = step.transfer_seconds + hop_seconds(step.sent_at, self._idle_since)
        began = time.perf_counter()
        if runner.group is not None:  # PP x TP: this shard's other ranks run it too
            await self.emit("ranks", step)
        if self.states is not None:  # the last shard: its layers, the LM head and sampling
            sampled = await self.run_in_thread(sample_step, runner, self.states, step)
            seconds = (*step.compute_seconds, time.perf_counter() - began)
            self._idle_since = sent_at = time.time()
            answer = dataclasses.replace(
                sampled, compute_seconds=seconds, sent_at=sent_at, transfer_seconds=transfer
            )
            await self.emit("out", answer)
            return
        output = await self.run_in_thread(forward_layers, runner, step.shard, step.hidden, None)
        seconds = (*step.compute_seconds, time.perf_counter() - began)
        self._idle_since = sent_at = time.time()
        await self.emit(
            "out",
            PipelineStep(step.shard, output, step.keep, seconds, sent_at, transfer, step.sampling),
        )


class PipelineDriver:
    """The first shard's side of pipeline-parallel steps (see the module docstring). Several
    steps may be in flight (micro-batches, :mod:`stages.steps_in_flight`): each is prepared,
    run through the first shard's layers and sent on in the order its call came (the
    shards run them in that order), its sampled tokens awaited by step id, and its result
    counted with the last step prepared by then (``StepResult.prepared_through``)."""

    def __init__(self, stage: Stage, timeout: float) -> None:
        from stages.execute.pp_sampling import FirstShardOutbox

        self._stage = stage
        self._timeout = timeout
        self._pending: dict[int, asyncio.Future[PipelineSampled]] = {}
        self._received: dict[int, float] = {}  # when each step's answer arrived
        # what the last shard samples with: noted as steps are prepared, sent with them
        self._outbox: FirstShardOutbox = FirstShardOutbox()
        # a step's prepare, first layers and send, one step at a time, in call order
        self._order = asyncio.Lock()
        self._prepared_through = -1  # set on the stage's worker thread

    @property
    def idle(self) -> bool:
        return not self._pending and not self._order.locked()

    def answer(self, sampled: PipelineSampled) -> None:
        """The last shard's answer arrived (late ones, of a step given up on, are dropped)."""
        future = self._pending.get(sampled.step_id)
        if future is not None and not future.done():
            self._received[sampled.step_id] = time.time()
            future.set_result(sampled)

    async def execute(self, runner: ModelRunner, step: SchedulerStep) -> StepResult:
        """Run ``step`` over the shards: bookkeeping and the first layers here, the rest on
        the other shards, sampling on the last. The result's ``communication_seconds`` is the
        step's transfer: over each hop, the seconds its receiver sat waiting for the message
        (:func:`hop_seconds`); ``pipeline_answer_bytes`` the bytes the last shard's answer
        takes on the wire; ``shard_seconds`` each shard's busy seconds in the step (the
        first's bookkeeping included, the last's sampling).

        Raises:
            PipelineParallelError: the answer did not come back within the timeout.
            StepError: the step does not match the runner's state, or pools embeddings.
        """
        from stages.execute.pipeline_parallel import forward_layers

        stage = self._stage
        clock = time.perf_counter
        async with self._order:
            began = clock()
            (prepared, keep, sampling), first = await stage.run_in_thread(
                _timed, self._prepare, runner, step
            )
            shard = prepared.shard
            if shard is not None:
                assert keep is not None and sampling is not None
                if runner.group is not None:  # PP x TP: shard 0's other ranks run its layers too
                    await stage.emit("ranks", shard)
                hidden, seconds = await stage.run_in_thread(
                    _timed, forward_layers, runner, shard, None, None
                )
                first += seconds
                future: asyncio.Future[PipelineSampled] = asyncio.get_running_loop().create_future()
                self._pending[shard.step_id] = future
                try:
                    sent = PipelineStep(shard, hidden, keep, (first,), time.time(), 0.0, sampling)
                    await stage.emit("pipeline", sent)
                except BaseException:
                    self._pending.pop(shard.step_id, None)
                    raise
        if shard is None:  # nothing computes: frees and preemptions only
            return await stage.run_in_thread(self._run, runner, prepared)
        try:
            answer = await asyncio.wait_for(future, self._timeout)
        except TimeoutError:
            raise PipelineParallelError(
                f"pipeline-parallel step {shard.step_id}: the last shard sent no answer "
                f"within pipeline_parallel_timeout ({self._timeout:g} s); a shard hangs"
            ) from None
        finally:
            self._pending.pop(shard.step_id, None)
            received = self._received.pop(shard.step_id, 0.0)
        round_trip = clock() - began
        result, recording = await stage.run_in_thread(
            _timed, self._record, runner, prepared, answer
        )
        compute = answer.compute_seconds
        # NOTE: the first shard's loop takes the answer in at once (its compute is on its
        # worker thread), so the last hop is all transfer
        transfer = answer.transfer_seconds + hop_seconds(answer.sent_at, 0.0, received)
        return dataclasses.replace(
            result,
            forward_seconds=result.forward_seconds + round_trip,
            communication_seconds=transfer,
            pipeline_answer_bytes=encoded_bytes(answer),
            shard_seconds=(compute[0] + recording, *compute[1:]) if compute else (),
        )

    def _prepare(
        self, runner: ModelRunner, step: SchedulerStep
    ) -> tuple[PreparedStep, np.ndarray | None, PipelineSampling | None]:
        """:meth:`ModelRunner.prepare` on the worker thread, noting the step prepared; the
        rows the last shard runs the LM head over and what it samples them with (None:
        nothing computes, nothing is sent).

        Raises:
            StepError: as :meth:`ModelRunner.prepare`, or the step pools embeddings (what was
                noted then goes with the next step sent).
        """
        from stages.execute.pipeline_parallel import pipeline_keep

        prepared = runner.prepare(step)
        self._prepared_through = step.step_id
        self._outbox.note(step)
        if prepared.shard is None:
            return prepared, None, None
        keep = np.asarray(pipeline_keep(prepared), dtype=np.int64)
        return prepared, keep, self._outbox.sampling(prepared)

    def _record(
        self, runner: ModelRunner, prepared: PreparedStep, answer: PipelineSampled
    ) -> StepResult:
        """The step's sampled tokens recorded (:meth:`_run`)."""
        from stages.execute.pp_sampling import take_sampled

        prepared.sampled = take_sampled(answer)
        return self._run(runner, prepared)

    def _run(self, runner: ModelRunner, prepared: PreparedStep) -> StepResult:
        """:meth:`ModelRunner.run` on the worker thread; its free-block count is with the
        steps up to ``prepared_through`` allocated (the worker thread runs one at a time)."""
        result = runner.run(prepared)
        return dataclasses.replace(result, prepared_through=self._prepared_through)


def shard_threads(config: ExecuteConfig) -> int | None:
    """The torch threads of each shard's worker thread: with several steps in flight the
    shards compute at once, so each takes an even share of this machine's cores (as tensor
    parallelism's ranks do); None (torch's default, every core) with one step in flight,
    where they compute in turn, or without pipeline parallelism."""
    size = config.pipeline_parallel_size
    steps = config.pipeline_parallel_micro_batches or size
    if size == 1 or steps == 1:
        return None
    from stages.execute.tensor_parallel import threads_per_rank

    return threads_per_rank(size)


def hop_seconds(sent_at: float, idle_since: float, received: float | None = None) -> float:
    """The part of one hop between shards that kept the receiver waiting: from when the
    message was sent, or when the receiver finished its previous step if later (until then
    it was busy: the message's transfer overlapped its compute), to when it was taken in
    (``received``, by default now). Wall-clock stamps of two processes: on one host the same
    clock; across hosts their skew shows too (a negative hop counts 0)."""
    now = time.time() if received is None else received
    return max(0.0, now - max(sent_at, idle_since))


def _timed(function: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``function(*args)`` and the seconds it took (on the worker thread: its own time, not
    the wait for the thread)."""
    began = time.perf_counter()
    return function(*args), time.perf_counter() - began


def encoded_bytes(message: object) -> int:
    """The bytes ``message`` takes on the wire (the codec's payload and out-of-band
    buffers; a small answer is encoded again here, in microseconds)."""
    payload, buffers = Codec().encode(message)
    return len(payload) + sum(memoryview(buffer).nbytes for buffer in buffers)
