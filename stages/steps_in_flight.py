"""Several engine steps in flight at once: pipeline parallelism's micro-batches (pure logic:
no asyncio, zmq, grpc or torch; ``docs/architecture.md`` §8, docs/parallelism.md "Pipeline
parallelism").

With ``SchedulerConfig.max_steps_in_flight`` K > 1 the scheduler plans up to K steps before
the oldest one's result returns, so while step n runs in the later pipeline shards the first
shard already runs step n+1's layers. The shape follows vLLM's batch queue
(``vllm/v1/engine/core.py``: ``EngineCore.step_with_batch_queue``, with
``max_concurrent_batches`` the pipeline size); the rules that keep the scheduler's KV mirror
exact are actorline's own:

- **Disjoint requests.** A request is in at most one step in flight: its next chunk is
  planned only after its result returned, so its sampled token is known and execute's state
  of it is settled. Each step takes at most its fair share of the live requests
  (:func:`fair_share`), so a batch that arrives at once splits over the K steps rather than
  filling the first and leaving the others empty.
- **Frees after the result.** A request aborted while its chunk is in flight is freed in a
  step planned after its result (execute samples it first); a new request with the id of one
  still in flight waits until that one is freed.
- **No preemption with steps in flight.** A request that does not fit waits for the steps in
  flight to return (their blocks may come free); the scheduler preempts only with nothing in
  flight, as with one step. Execute never runs short, so it never preempts on its own.
- **The free-block count.** Execute reports its free blocks when it runs a step's result,
  and :attr:`~stages.messages.StepResult.prepared_through` names the last step it had
  prepared (allocated) by then. The scheduler's count is that, less what every later step in
  flight takes net of what it frees (:func:`free_after`): each planned step's allocations
  charged in full, as with one step (the :mod:`stages.scheduler` docstring). A step planned
  with others in flight credits its frees nothing: a step before it, not prepared yet, may
  take a prefix hit on the very blocks (so freeing them frees nothing), which the shared
  counts of the last result cannot show; the blocks come back through execute's count once
  it has freed them. So a planned step never needs more blocks than execute will have free
  when it prepares it.
- **No spare blocks past a chunk.** Execute's prefix cache serves a chunk past its end only
  with blocks another request holds (``SchedulerStep.spare_blocks`` False), never with free
  blocks the step's own chunks do not need: the steps planned after it count on those.

Execute runs the steps in the order they were planned on each shard (the first shard
prepares and computes them in order, the links between shards keep it), so a block freed and
reused by a later step is written by the later step only after the earlier step's layers
have read it on every shard.

:func:`bubble_fraction` is the benchmark's measure of the shards' idle time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from stages.messages import StepResult

__all__ = ["bubble_fraction", "fair_share", "free_after", "sum_shard_seconds"]


def fair_share(num_requests: int, max_steps_in_flight: int) -> int:
    """The most requests one of ``max_steps_in_flight`` steps takes of ``num_requests``
    running or waiting ones: an even share, rounded up (at least one)."""
    return max(1, -(-num_requests // max_steps_in_flight))


def free_after(result: StepResult, later: Iterable[tuple[int, int]]) -> int:
    """The free blocks the scheduler may plan with after ``result``: execute's count, less
    the net blocks of each step in flight (``later``: ``(step_id, net_blocks)``) that execute
    had not prepared when it counted (ids after ``result.prepared_through``, or after
    ``result.step_id`` where execute prepares one step at a time)."""
    through = result.prepared_through if result.prepared_through >= 0 else result.step_id
    return result.free_blocks - sum(net for step_id, net in later if step_id > through)


def sum_shard_seconds(total: Sequence[float], step: Sequence[float]) -> tuple[float, ...]:
    """``total`` plus one step's busy seconds per shard (``step``), element-wise; the longer
    of the two sets the length (a step that computed nothing reports none)."""
    if not step:
        return tuple(total)
    if not total:
        return tuple(step)
    size = max(len(total), len(step))
    padded = [*total, *[0.0] * (size - len(total))]
    for shard, seconds in enumerate(step):
        padded[shard] += seconds
    return tuple(padded)


def bubble_fraction(busy_seconds: Sequence[float], wall_seconds: float) -> float:
    """The share of the shards' time spent idle over ``wall_seconds``: one less their busy
    seconds over shards x wall time (0 with no shards or no time; busy time over the wall time
    on a loaded machine, where a shard's compute stretches, reads as no bubble).

    Raises:
        ValueError: ``wall_seconds`` is negative.
    """
    if wall_seconds < 0:
        raise ValueError(f"wall_seconds must be >= 0, got {wall_seconds!r}")
    if not busy_seconds or wall_seconds == 0:
        return 0.0
    return max(0.0, 1.0 - sum(busy_seconds) / (len(busy_seconds) * wall_seconds))
