"""The KV bookkeeping of one :class:`~stages.messages.SchedulerStep`, shared by the model runner
(:mod:`stages.execute.runner`) and the null model (:mod:`stages.execute.null`), so both answer
a step with exactly the same allocation, prefix-cache and preemption decisions. Pure Python:
no torch, no asyncio.

A request's *known tokens* are its prompt plus its sampled outputs; ``num_computed`` leading
ones have K/V in the cache. A step is checked whole (:func:`validate_step`) before anything
changes; then :func:`release` frees finished and preempted requests, :func:`plan_chunks`
allocates each chunk's blocks (a chunk first takes what the prefix cache holds of its tokens;
past the chunk's end only blocks that cost no free block or that the step can spare, so the
blocks the scheduler planned are always there; the scheduler learns the longer hit from
``computed_tokens``), and after the chunks ran :func:`commit_chunk` records them and publishes
newly full blocks, and :func:`release_behind_windows` gives back the blocks that fell behind
a sliding window (docs/architecture.md §6.2). Flow after vLLM v1
(``vllm/v1/worker/gpu_model_runner.py``: ``_update_states``) and nano-vllm
(``nanovllm/engine/model_runner.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Protocol, TypeVar

from stages.execute.allocator import BlockAllocator, OutOfBlocksError
from stages.execute.windows import blocks_behind_window
from stages.messages import Logprobs, ScheduledChunk, SchedulerStep, StepResult

__all__ = [
    "PlanReport",
    "StepError",
    "TrackedRequest",
    "commit_chunk",
    "commit_drafted_chunk",
    "plan_chunk",
    "plan_chunks",
    "release",
    "release_behind_windows",
    "step_result",
    "validate_step",
]


class StepError(ValueError):
    """A :class:`SchedulerStep` is inconsistent with the runner's state (unknown or duplicate
    request, a chunk outside the request's tokens, ...): a scheduler bug."""


@dataclasses.dataclass(slots=True)
class PlanReport:
    """What planning a step's chunks decided, for its :class:`StepResult`.

    ``cached_tokens``: for each request whose prefix-cache hit started or grew, the tokens
    the cache served since its start. ``computed_tokens``: for each request the cache served
    past its chunk's end, its computed tokens now. ``preempted``: requests that got no
    blocks (freed, restarting from 0).
    """

    cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    computed_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)


class TrackedRequest(Protocol):
    """What the bookkeeping needs of a runner's per-request state."""

    request_id: str
    num_computed: int
    num_cached: int  # of num_computed, tokens served by the prefix cache since its start
    #: mixed into its block hashes: what else its K/V depends on (its LoRA adapter; b"": none)
    cache_key: bytes

    @property
    def num_tokens(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool:
        """False while the request must compute every position itself (its prompt is being
        scored: stages/execute/prompt_scores.py; it pools mean or CLS rows:
        stages/execute/pooling.py); it still publishes its blocks."""
        ...

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
        if chunk.draft_token_ids:
            # a draft follows the known tokens: the chunk is the last known token and it
            num_tokens += len(chunk.draft_token_ids)
            if end != num_tokens or chunk.num_tokens != 1 + len(chunk.draft_token_ids):
                raise StepError(
                    f"chunk {chunk} must be the request's last known token and its draft"
                )
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
            request.num_computed = request.num_cached = 0


def plan_chunks(
    allocator: BlockAllocator,
    requests: Mapping[str, TrackedT],
    chunks: Sequence[ScheduledChunk],
    report: PlanReport,
    use_spare: bool = True,
) -> list[tuple[TrackedT, int, int]]:
    """:func:`plan_chunk` for each of a (validated, released) step's chunks in order, each
    told how many free blocks it may take past its end: those that no chunk of the step
    needs (each chunk counted at most ``ceil(end / block_size)`` less what it holds); none
    without ``use_spare`` (the step's ``spare_blocks``: steps planned after it count on them).

    Returns:
        ``(request, first position to compute, end)`` for each chunk with tokens to compute.
    """
    size = allocator.block_size
    needs: list[int] = []
    if allocator.enable_prefix_caching and use_spare:
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            if chunk.start == 0:  # a (re)start: what it holds is freed first
                needs.append(-(-end // size))
            else:
                needs.append(allocator.blocks_needed(chunk.request_id, end))
    reserved = sum(needs)
    planned: list[tuple[TrackedT, int, int]] = []
    for index, chunk in enumerate(chunks):
        request = requests[chunk.request_id]
        spare = 0
        if needs:
            spare = allocator.num_free_blocks - reserved
            reserved -= needs[index]
        start = plan_chunk(allocator, request, chunk, report, spare)
        if start is not None:
            planned.append((request, start, chunk.start + chunk.num_tokens))
    return planned


def plan_chunk(
    allocator: BlockAllocator,
    request: TrackedRequest,
    chunk: ScheduledChunk,
    report: PlanReport,
    spare_blocks: int = 0,
) -> int | None:
    """Take the chunk's cached blocks from the prefix cache and allocate the rest of the
    (validated) chunk's blocks.

    The prefix cache serves a (re)start's leading blocks and, while the request's blocks so
    far are all full (computed or served), the next chunk's too. Within the chunk any cached
    block is taken (each costs at most the free block the chunk's allocation would); past
    its end only blocks another request holds, or up to ``spare_blocks`` free ones. What it
    decides goes into ``report`` (see :class:`PlanReport`).

    Returns:
        The first position to compute (the chunk ends at ``chunk.start + chunk.num_tokens``),
        or None when the prefix cache served every token or the request was preempted.
    """
    request_id = request.request_id
    end = chunk.start + chunk.num_tokens
    if chunk.start == 0:
        # A new or resumed request: drop anything it held, count one prefix-cache query.
        allocator.free(request_id)
        request.num_computed = request.num_cached = 0
    size = allocator.block_size
    # NOTE: the cache can serve more only where the request's blocks so far are all full
    # (the chunk starts on a block boundary, everything before it computed or served), and
    # only if a full block fits before the request's last token; checked here so a decode
    # step never builds a token list.
    continues_hits = (
        chunk.start % size == 0
        and request.num_computed == chunk.start
        and (request.num_tokens - 1) // size > chunk.start // size
    )
    # NOTE: a drafted chunk computes every row (each is verified), so the cache serves none
    if (
        allocator.enable_prefix_caching
        and (chunk.start == 0 or continues_hits)
        and request.reads_prefix_cache
        and not chunk.draft_token_ids
    ):
        hit = allocator.match_prefix(
            request_id, request.tokens(), end, spare_blocks, cache_key=request.cache_key
        )
        request.num_computed += hit
        request.num_cached += hit
        if chunk.start == 0 or hit:
            report.cached_tokens[request_id] = request.num_cached
        if request.num_computed > end:
            report.computed_tokens[request_id] = request.num_computed
    start = max(chunk.start, request.num_computed)
    if start >= end:
        return None
    try:
        allocator.allocate(request_id, end)
    except OutOfBlocksError:
        allocator.free(request_id)
        request.num_computed = request.num_cached = 0
        report.cached_tokens.pop(request_id, None)
        report.preempted.append(request_id)
        return None
    return start


def commit_chunk(allocator: BlockAllocator, request: TrackedRequest, end: int) -> None:
    """Record positions up to ``end`` as computed and publish newly full blocks to the
    prefix cache."""
    before = request.num_computed
    request.num_computed = end
    block_size = allocator.block_size
    if allocator.enable_prefix_caching and end // block_size > before // block_size:
        allocator.commit(request.request_id, request.tokens(0, end), end, request.cache_key)


def commit_drafted_chunk(
    allocator: BlockAllocator, request: TrackedRequest, end: int, num_rejected: int
) -> None:
    """:func:`commit_chunk` for a chunk ending at ``end`` whose last ``num_rejected`` (drafted)
    tokens were rejected, their tokens already dropped from ``request``: only the accepted
    positions count as computed and are published, and the blocks past them are given back
    (speculative decoding's roll-back, docs/speculative.md)."""
    computed = end - num_rejected
    commit_chunk(allocator, request, computed)
    allocator.truncate(request.request_id, computed)


def release_behind_windows(
    allocator: BlockAllocator,
    requests: Mapping[str, TrackedRequest],
    step: SchedulerStep,
    report: PlanReport,
    window: int | None,
) -> None:
    """After a step's chunks ran (and were committed): give back, for every request the step
    scheduled and did not preempt, the leading blocks wholly behind ``window`` at its computed
    tokens (:func:`~stages.execute.windows.blocks_behind_window`); the scheduler's mirror
    counts the same. No-op without a window."""
    if window is None:
        return
    preempted = set(report.preempted)
    for chunk in step.chunks:
        request = requests.get(chunk.request_id)
        if request is None or chunk.request_id in preempted:
            continue
        behind = blocks_behind_window(request.num_computed, window, allocator.block_size)
        if behind:
            allocator.release_leading(chunk.request_id, behind)


def step_result(
    step: SchedulerStep,
    allocator: BlockAllocator,
    *,
    request_ids: Sequence[str],
    token_ids: Sequence[int],
    logprob_request_ids: Sequence[str],
    logprobs: Sequence[Logprobs],
    report: PlanReport,
    num_computed_tokens: int,
    forward_seconds: float,
    prompt_logprobs: dict[str, tuple[Logprobs, ...]] | None = None,
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
        cached_tokens=report.cached_tokens,
        computed_tokens=report.computed_tokens,
        preempted=tuple(report.preempted),
        shared_blocks=allocator.shared_block_counts(),
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        num_computed_tokens=num_computed_tokens,
        forward_seconds=forward_seconds,
        prompt_logprobs=prompt_logprobs or {},
    )
