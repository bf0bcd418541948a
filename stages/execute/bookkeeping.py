"""The KV bookkeeping of one :class:`~stages.messages.SchedulerStep`, shared by the model runner
(:mod:`stages.execute.runner`) and the null model (:mod:`stages.execute.null`), so both answer
a step with exactly the same allocation, prefix-cache and preemption decisions. Pure Python:
no torch, no asyncio.

A request's *known tokens* are its prompt plus its sampled outputs; ``num_computed`` leading
ones have K/V in the cache. A step is checked whole (:func:`validate_step`) before anything
changes; then :func:`release` frees finished and preempted requests, :func:`plan_chunk`
allocates each chunk's blocks (a chunk starting at 0 first looks its tokens up in the prefix
cache), and after the chunks ran :func:`commit_chunk` records them and publishes newly full
blocks. Flow after vLLM v1 (``vllm/v1/worker/gpu_model_runner.py``: ``_update_states``) and
nano-vllm (``nanovllm/engine/model_runner.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Protocol, TypeVar

from stages.execute.allocator import BlockAllocator, OutOfBlocksError
from stages.messages import Logprobs, ScheduledChunk, SchedulerStep, StepResult

__all__ = [
    "StepError",
    "TrackedRequest",
    "commit_chunk",
    "plan_chunk",
    "release",
    "step_result",
    "validate_step",
]


class StepError(ValueError):
    """A :class:`SchedulerStep` is inconsistent with the runner's state (unknown or duplicate
    request, a chunk outside the request's tokens, ...): a scheduler bug."""


class TrackedRequest(Protocol):
    """What the bookkeeping needs of a runner's per-request state."""

    request_id: str
    num_computed: int

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]: ...


TrackedT = TypeVar("TrackedT", bound=TrackedRequest)


def validate_step(
    step: SchedulerStep, requests: Mapping[str, TrackedRequest], max_model_len: int
) -> None:
    """Check the whole step against the runner's ``requests`` before changing anything.

    Raises:
        StepError: naming the first inconsistency.
    """
    finished = set(step.finished)
    # request id -> (known tokens, computed tokens) as they will be when chunks run
    sizes = {
        request_id: (request.num_tokens, request.num_computed)
        for request_id, request in requests.items()
        if request_id not in finished
    }
    for request_id in step.preempted:
        if request_id in sizes:
            sizes[request_id] = (sizes[request_id][0], 0)
    for new_request in step.new_requests:
        if new_request.request_id in sizes:
            raise StepError(f"request {new_request.request_id!r} is already registered")
        if not new_request.prompt_token_ids:
            raise StepError(f"request {new_request.request_id!r} has an empty prompt")
        sizes[new_request.request_id] = (len(new_request.prompt_token_ids), 0)
    scheduled: set[str] = set()
    for chunk in step.chunks:
        if chunk.request_id in scheduled:
            raise StepError(f"request {chunk.request_id!r} has two chunks in one step")
        scheduled.add(chunk.request_id)
        if chunk.request_id not in sizes:
            raise StepError(f"chunk for unknown request {chunk.request_id!r}")
        num_tokens, num_computed = sizes[chunk.request_id]
        end = chunk.start + chunk.num_tokens
        if chunk.start < 0 or chunk.num_tokens < 1:
            raise StepError(f"chunk {chunk} must have start >= 0 and num_tokens >= 1")
        if end > num_tokens:
            raise StepError(f"chunk {chunk} ends past the request's {num_tokens} known tokens")
        if end > max_model_len:
            raise StepError(f"chunk {chunk} ends past max_model_len {max_model_len}")
        if chunk.start > 0 and num_computed < chunk.start:
            raise StepError(
                f"chunk {chunk} starts past the request's {num_computed} computed tokens"
            )


def release(
    allocator: BlockAllocator,
    requests: MutableMapping[str, TrackedT],
    step: SchedulerStep,
) -> None:
    """Free the blocks of the step's finished requests (forgetting them) and of its preempted
    ones (which restart from position 0, their other state kept)."""
    for request_id in step.finished:
        allocator.free(request_id)
        requests.pop(request_id, None)
    for request_id in step.preempted:
        allocator.free(request_id)
        request = requests.get(request_id)
        if request is not None:
            request.num_computed = 0


def plan_chunk(
    allocator: BlockAllocator,
    request: TrackedRequest,
    chunk: ScheduledChunk,
    cached_tokens: dict[str, int],
    preempted: list[str],
) -> int | None:
    """Look up the prefix cache for a (re)start and allocate the (validated) chunk's blocks.

    A prefix hit goes into ``cached_tokens``; a request that gets no blocks has its blocks
    freed, restarts from 0 and goes into ``preempted``.

    Returns:
        The first position to compute (the chunk ends at ``chunk.start + chunk.num_tokens``),
        or None when the prefix cache served every token or the request was preempted.
    """
    end = chunk.start + chunk.num_tokens
    if chunk.start == 0:
        # A new or resumed request: drop anything it held, reuse cached prefix blocks.
        allocator.free(request.request_id)
        cached = allocator.match_prefix(request.request_id, request.tokens())
        request.num_computed = cached
        cached_tokens[request.request_id] = cached
    start = max(chunk.start, request.num_computed)
    if start >= end:
        return None
    try:
        allocator.allocate(request.request_id, end)
    except OutOfBlocksError:
        allocator.free(request.request_id)
        request.num_computed = 0
        cached_tokens.pop(request.request_id, None)
        preempted.append(request.request_id)
        return None
    return start


def commit_chunk(allocator: BlockAllocator, request: TrackedRequest, end: int) -> None:
    """Record positions up to ``end`` as computed and publish newly full blocks to the
    prefix cache."""
    before = request.num_computed
    request.num_computed = end
    block_size = allocator.block_size
    if allocator.enable_prefix_caching and end // block_size > before // block_size:
        allocator.commit(request.request_id, request.tokens(0, end), end)


def step_result(
    step: SchedulerStep,
    allocator: BlockAllocator,
    *,
    request_ids: Sequence[str],
    token_ids: Sequence[int],
    logprob_request_ids: Sequence[str],
    logprobs: Sequence[Logprobs],
    cached_tokens: dict[str, int],
    preempted: Sequence[str],
    num_computed_tokens: int,
    forward_seconds: float,
) -> StepResult:
    """The step's :class:`StepResult`, with the allocator's free blocks and prefix-cache
    counters as they are now."""
    stats = allocator.stats
    return StepResult(
        step_id=step.step_id,
        request_ids=tuple(request_ids),
        token_ids=tuple(token_ids),
        free_blocks=allocator.num_free_blocks,
        total_blocks=allocator.num_usable_blocks,
        logprob_request_ids=tuple(logprob_request_ids),
        logprobs=tuple(logprobs),
        cached_tokens=cached_tokens,
        preempted=tuple(preempted),
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        num_computed_tokens=num_computed_tokens,
        forward_seconds=forward_seconds,
    )
