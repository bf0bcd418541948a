"""Continuous-batching scheduler bookkeeping (pure logic: no asyncio, zmq, grpc or torch).

Follows vLLM v1 (``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/core/sched/utils.py``) and
nano-vllm (``nanovllm/engine/scheduler.py``): every step packs the decode tokens of running
requests and chunks of prompts (chunked prefill) under a token budget and a sequence limit;
when KV blocks run out a running request is preempted by recompute. The schedule stage wraps
a :class:`Scheduler` and talks to execute; this module only plans and keeps accounts.

The execute stage owns the real block allocator. The scheduler keeps a *mirror*: each request
holds ``ceil(num_computed_tokens / block_size)`` blocks (less, under a model-wide sliding
window, the leading ones wholly behind it, which execute gives back after each step:
docs/architecture.md §6.2), and free blocks are what execute last reported plus what this plan
frees, minus what it allocates. Execute's prefix cache may serve a
chunk's request past the chunk's end, but only with blocks that cost no free block or that no
chunk of the step needs; the request's computed tokens then come back in
``StepResult.computed_tokens`` and the mirror takes them (the next chunk starts there). A
planned step never needs more blocks than are free, so execute never runs short:

- an allocation is charged every block it may take, though a prefix hit on a block another
  request holds takes none;
- finishing or preempting a request credits only the blocks no other request held at the last
  step (:attr:`StepResult.shared_blocks`). That is a lower bound: a block two preempted
  requests shared comes free too, uncounted. So a request that does not fit after such
  credits does not preempt itself on that estimate; it sits the step out and sees the exact
  count in the next one. (Preempting itself instead would let every request be
  re-admitted into the same shortage, for ever.)

Execute stays authoritative all the same: if it ever ran short it would preempt on its own and
say so in :class:`~stages.messages.StepResult`, which the scheduler treats like its own
preemption.

Token-level stops are decided in :meth:`Scheduler.update` as soon as a token arrives, so no
step is wasted: EOS and stop token ids ("stop", never before ``min_tokens``), ``max_tokens``
and the model length ("length"). The model length is capped by the KV cache (blocks x block
size): a longer request could never hold its blocks even alone. Aborted requests produce no
output (the caller that aborted them already knows); their state is freed in the next step.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Iterable
from typing import Any

from stages.errors import InvalidRequestError
from stages.execute.windows import blocks_behind_window, window_blocks_needed
from stages.lora import running_adapters
from stages.messages import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    Logprobs,
    ScheduledChunk,
    SchedulerStep,
    StepResult,
)
from stages.policies import SchedulingPolicy, StepObservation
from stages.speculative import (
    SpeculativeConfig,
    Speculator,
    accepted_drafts,
    draft_room,
    may_draft,
)
from stages.steps_in_flight import fair_share, free_after, sum_shard_seconds
from stages.validation import resolve_max_tokens

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerError"]

_FINISH_STOP = "stop"
_FINISH_LENGTH = "length"
_FINISH_ERROR = "error"


class SchedulerError(RuntimeError):
    """A message broke the schedule ⇄ execute contract, or a policy returned a bad answer."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step.

    ``max_num_seqs``: requests running at once. ``max_num_batched_tokens``: tokens computed
    in one step (decode tokens + prefill chunks). ``long_prefill_chunk``: the most prompt
    tokens of one request in one step (None: up to the whole budget), which lets several
    prompts share a step and keeps decode latency steady. ``replica``: the name of the engine
    replica this scheduler serves, reported in its stats ("" without data parallelism).
    ``max_loras``: distinct LoRA adapters among the running requests (so in any one step); a
    waiting request of another adapter waits until one is free (docs/lora.md; None: no bound).
    ``speculative_config``: draft tokens for decoding requests (None: no speculative decoding;
    docs/speculative.md). ``max_steps_in_flight``: steps planned before the oldest one's
    result returns, over disjoint requests (pipeline parallelism's micro-batches:
    docs/parallelism.md; 1: plan, wait for the result, plan again).

    Raises:
        ValueError: a limit is not a positive integer.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int | None = None
    replica: str = ""
    max_loras: int | None = None
    speculative_config: SpeculativeConfig | None = None
    max_steps_in_flight: int = 1

    def __post_init__(self) -> None:
        for field in ("max_num_seqs", "max_num_batched_tokens", "max_steps_in_flight"):
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        chunk = self.long_prefill_chunk
        if chunk is not None and (type(chunk) is not int or chunk < 1):
            raise ValueError(f"long_prefill_chunk must be None or an integer >= 1, got {chunk!r}")
        loras = self.max_loras
        if loras is not None and (type(loras) is not int or loras < 1):
            raise ValueError(f"max_loras must be None or an integer >= 1, got {loras!r}")


class _Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclasses.dataclass(slots=True, eq=False)
class _RequestState:
    """The scheduler's record of one request; implements :class:`RequestView`."""

    request: EngineRequest
    arrival_time: float
    arrival_index: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_blocks: int = 0  # blocks held in the mirror (those behind a window not counted)
    num_preemptions: int = 0
    status: _Status = _Status.WAITING
    sent_to_execute: bool = False
    num_cached_tokens: int = 0
    cached_tokens_reported: bool = False
    scheduled_time: float | None = None  # when its first chunk was scheduled (the clock's)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def priority(self) -> int:
        return self.request.params.priority

    @property
    def max_tokens(self) -> int:
        limit = self.request.params.max_tokens
        assert limit is not None  # resolved by add_request
        return limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)


@dataclasses.dataclass(slots=True)
class _InFlight:
    """A step sent to execute and not yet answered."""

    step: SchedulerStep
    started: float
    states: dict[str, _RequestState]  # every request with a chunk in the step
    sampling: set[str]  # requests whose chunk reaches the end of their known tokens
    decoding: set[str]  # requests whose chunk is a single decode token (and its draft)
    #: the free blocks its plan took, net of the blocks its frees credited (may be < 0)
    net_blocks: int = 0


@dataclasses.dataclass(slots=True)
class _Plan:
    """Accumulates one step while :meth:`Scheduler.schedule` builds it."""

    budget: int
    free_blocks: int
    chunks: dict[str, ScheduledChunk] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)
    # Blocks freed in this plan were credited below what comes free (shared ones).
    free_is_lower_bound: bool = False
    # Requests the step may still take (its share of them with several steps in flight).
    seqs_left: int = 1 << 62


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    """Plans engine steps and applies their results; see the module docstring.

    Use: :meth:`set_engine_info` once execute is ready, :meth:`add_request` /
    :meth:`abort` as messages arrive, then alternate :meth:`schedule` (send the step to
    execute) and :meth:`update` (with execute's :class:`StepResult`). At most
    ``config.max_steps_in_flight`` steps are in flight (one by default); with more, see
    :mod:`stages.steps_in_flight` for the rules that keep the mirror exact. ``clock``
    (seconds, monotonic) stamps arrivals and times steps.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        policy: SchedulingPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = policy
        self._clock = clock
        self._info: EngineInfo | None = None
        self._total_blocks = 0
        self._free_blocks = 0  # as execute last reported
        self._shared_blocks: dict[str, int] = {}  # as execute last reported
        # Insertion-ordered: running in the order they were admitted.
        self._waiting: dict[str, _RequestState] = {}
        self._running: dict[str, _RequestState] = {}
        # Done or aborted requests whose state execute still holds: sent in the next step's
        # `finished` (their mirror blocks become free in that plan).
        self._pending_finish: list[_RequestState] = []
        # Requests that ended without ever reaching execute (prompt does not fit): reported
        # in the next update().
        self._unrunnable: list[_RequestState] = []
        # the steps in flight, oldest first, and the step each in-flight request's chunk is in
        self._in_flight: dict[int, _InFlight] = {}
        self._busy: dict[str, int] = {}
        self._next_step_id = 0
        self._arrivals = 0
        self._num_preemptions = 0
        self._num_steps = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._last_step_seconds = 0.0
        self._last_forward_seconds = 0.0
        self._last_step_tokens = 0
        self._communication_seconds = 0.0
        self._shard_busy_seconds: tuple[float, ...] = ()
        self._pipeline_answer_bytes = 0
        self._execute_threads = 0
        speculative = config.speculative_config
        self._speculator = None if speculative is None else Speculator(speculative)

    # ------------------------------------------------------------------ inputs

    def set_engine_info(self, info: EngineInfo) -> None:
        """Record execute's capacity (KV blocks, block size, model length, EOS ids).

        Raises:
            ValueError: ``num_blocks``, ``block_size`` or ``max_model_len`` is not >= 1.
        """
        for field in ("num_blocks", "block_size", "max_model_len"):
            if getattr(info, field) < 1:
                raise ValueError(f"EngineInfo.{field} must be >= 1, got {getattr(info, field)}")
        first = self._info is None
        self._info = info
        if first:
            self._total_blocks = info.num_blocks
            self._free_blocks = info.num_blocks

    def add_request(self, request: EngineRequest) -> None:
        """Queue a tokenized request.

        Raises:
            InvalidRequestError: a live request already has this id, or the prompt is empty;
                without ``max_tokens`` (a pipeline without admit), ``min_tokens`` more than
                the model's length leaves (:func:`stages.validation.resolve_max_tokens`).
            PromptTooLongError: without ``max_tokens``, the prompt leaves no room in the
                model's length.
        """
        request_id = request.request_id
        if request_id in self._waiting or request_id in self._running:
            raise InvalidRequestError(
                f"request id {request_id!r} is already scheduled",
                field="request_id",
                request_id=request_id,
            )
        if not request.prompt_token_ids:
            raise InvalidRequestError(
                "prompt_token_ids must not be empty", field="prompt", request_id=request_id
            )
        if request.params.max_tokens is None:  # admit resolves it; a pipeline without admit
            assert self._info is not None, "the engine's info comes before any request"
            # NOTE: the one rule (docs/architecture.md §7.1), as admit applies it
            max_tokens = resolve_max_tokens(
                request.params,
                prompt_tokens=len(request.prompt_token_ids),
                max_model_len=self._info.max_model_len,
                request_id=request_id,
            )
            request = dataclasses.replace(
                request, params=request.params.replace(max_tokens=max_tokens)
            )
        state = _RequestState(request, arrival_time=self._clock(), arrival_index=self._arrivals)
        self._arrivals += 1
        self._waiting[request_id] = state
        self.policy.on_arrival(state)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is waiting or running."""
        return request_id in self._waiting or request_id in self._running

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop these requests. Execute frees their state in the next step (a free-only step
        if nothing else runs). Unknown or already finished ids are ignored; tokens a request
        sampled in the step in flight are dropped."""
        for request_id in request_ids:
            state = self._waiting.pop(request_id, None)
            if state is None:
                state = self._running.pop(request_id, None)
            if state is not None:
                self._finish(state)

    # ------------------------------------------------------------------ queries

    @property
    def in_flight(self) -> bool:
        """A step was scheduled and its result has not arrived yet."""
        return bool(self._in_flight)

    @property
    def num_in_flight(self) -> int:
        """Steps scheduled whose results have not arrived yet."""
        return len(self._in_flight)

    def has_work(self) -> bool:
        """Whether there is something to send to execute (once no step is in flight)."""
        if self._info is None:
            return False
        return bool(self._waiting or self._running or self._pending_finish or self._unrunnable)

    def sampling_request_ids(self) -> list[str]:
        """The requests whose chunk in the newest step in flight samples a token (it reaches
        the end of their known tokens), in the step's chunk order; empty when no step is in
        flight."""
        if not self._in_flight:
            return []
        in_flight = self._in_flight[next(reversed(self._in_flight))]
        return [c.request_id for c in in_flight.step.chunks if c.request_id in in_flight.sampling]

    def num_output_tokens(self, request_id: str) -> int:
        """The tokens ``request_id`` (waiting or running) has generated so far.

        Raises:
            KeyError: no such waiting or running request.
        """
        state = self._running.get(request_id) or self._waiting.get(request_id)
        if state is None:
            raise KeyError(request_id)
        return state.num_output_tokens

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> EngineStats:
        """Gauges and counters now; ``step_seconds`` and ``forward_seconds`` are the last
        step's (schedule → update wall time, and execute's forward time),
        ``communication_seconds`` the total of every step's tensor-parallel collectives."""
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_blocks_total=self._total_blocks,
            kv_blocks_free=self._free_blocks,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            step_seconds=self._last_step_seconds,
            forward_seconds=self._last_forward_seconds,
            communication_seconds=self._communication_seconds,
            replica=self.config.replica,
            step_tokens=self._last_step_tokens,
            execute_threads=self._execute_threads,
            shard_busy_seconds=self._shard_busy_seconds,
            pipeline_answer_bytes=self._pipeline_answer_bytes,
            **({} if self._speculator is None else self._speculator.stats().engine_stats()),
        )

    # ------------------------------------------------------------------ planning

    def _token_limit(self) -> int:
        """The most tokens (prompt + output) a request may reach: under a model-wide window
        a request holds only its window's blocks, so a cache that holds them does not bound
        it."""
        info = self._info
        assert info is not None
        window = info.sliding_window
        if window is not None and self._total_blocks >= window_blocks_needed(
            window, info.block_size
        ):
            return info.max_model_len
        return min(info.max_model_len, self._total_blocks * info.block_size)

    def _held_blocks(self, num_computed_tokens: int) -> int:
        """The blocks execute holds for a request with this many computed tokens between
        steps: its table, less the leading blocks behind the window it gave back."""
        assert self._info is not None
        block_size = self._info.block_size
        window = self._info.sliding_window
        return _blocks_for(num_computed_tokens, block_size) - blocks_behind_window(
            num_computed_tokens, window, block_size
        )

    def _finish(self, state: _RequestState) -> None:
        """Retire ``state`` (done or aborted) and queue the free of its execute state."""
        state.status = _Status.DONE
        # NOTE: a request whose chunk is in flight is freed after its result (update()):
        # execute samples it then, and frees it only in a step planned after that
        if state.sent_to_execute and self._busy.get(state.request_id) is None:
            self._pending_finish.append(state)
        if self._speculator is not None:
            self._speculator.forget(state.request_id)
        self.policy.on_finish(state)

    def _preempt(self, state: _RequestState, plan: _Plan) -> None:
        """Preempt a running request by recompute within ``plan``."""
        del self._running[state.request_id]
        chunk = plan.chunks.pop(state.request_id, None)
        if chunk is not None:
            plan.budget += chunk.num_tokens
        # NOTE: num_blocks already counts the blocks planned for its chunk in this step, so
        # they come back once, with the blocks it held (execute frees those first).
        self._credit_freed_blocks(state, plan)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = _Status.WAITING
        self._waiting[state.request_id] = state
        plan.preempted.append(state.request_id)
        self._num_preemptions += 1

    def _credit_freed_blocks(self, state: _RequestState, plan: _Plan) -> None:
        """Give ``plan`` the blocks that certainly come free as ``state`` is preempted or
        finished (all it holds but those another request also held at the last step; the
        credit is then a lower bound) and take them from ``state``."""
        shared = self._shared_blocks.get(state.request_id, 0)
        if self._in_flight:
            # NOTE: nothing with steps in flight: a step execute has not prepared yet may
            # share these blocks (stages.steps_in_flight); execute's count will show them
            plan.free_is_lower_bound = True
        else:
            plan.free_blocks += state.num_blocks - shared
            plan.free_is_lower_bound |= shared > 0
        state.num_blocks = 0

    def _chunk_size(self, state: _RequestState, budget: int) -> int:
        remaining = state.num_tokens - state.num_computed_tokens
        size = min(remaining, budget)
        if remaining > 1 and self.config.long_prefill_chunk is not None:
            size = min(size, self.config.long_prefill_chunk)
        return size

    def _schedule_running(self, plan: _Plan, block_size: int) -> None:
        # NOTE: decodes go before prefill chunks of running requests so that a long prompt
        # mid-prefill never starves the token stream of the others. Each chunk gets its blocks
        # from the mirror; a request that cannot get blocks for even one token preempts the
        # policy's victim (possibly one already planned this step), or itself when it is the
        # victim, unless blocks freed in this plan were credited short (shared ones, see the
        # module docstring): then it waits one step for the exact count instead.
        running = list(self._running.values())
        ordered = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        ordered += [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        for state in ordered:
            if plan.budget == 0 or plan.seqs_left == 0:
                break
            if state.status is not _Status.RUNNING or state.request_id in self._busy:
                continue  # preempted earlier in this plan, or its chunk is in flight
            wanted = self._chunk_size(state, plan.budget)
            draft = self._draft(state, plan) if wanted == 1 else ()
            wanted += len(draft)
            while True:
                # Tokens this request can hold with its table plus every free block (its
                # table covers its computed tokens; entries behind a window hold no block).
                table = _blocks_for(state.num_computed_tokens, block_size)
                fits = (table + plan.free_blocks) * block_size
                size = min(wanted, fits - state.num_computed_tokens)
                if size >= 1:
                    break
                if self._in_flight:
                    break  # no preemption with steps in flight: it waits for their results
                victim = self._select_victim()
                if victim is state and plan.free_is_lower_bound:
                    break  # sit this step out (size < 1)
                self._preempt(victim, plan)
                if victim is state:
                    break
            if state.status is not _Status.RUNNING or size < 1:
                continue
            self._add_chunk(state, size, plan, block_size, draft[: size - 1])

    def _draft(self, state: _RequestState, plan: _Plan) -> tuple[int, ...]:
        """A draft for the decoding request ``state`` (docs/speculative.md): none without
        speculative decoding, at large batches, for requests whose sampling depends on their
        own output (:func:`stages.speculative.may_draft`), and past what the budget,
        ``max_tokens`` and the model length leave."""
        speculator = self._speculator
        if (
            speculator is None
            or state.num_tokens - state.num_computed_tokens != 1  # not decoding
            or not speculator.enabled_for(len(self._running))
            or not may_draft(state.request.params, state.num_output_tokens)
        ):
            return ()
        limit = min(
            plan.budget - 1,
            state.max_tokens - state.num_output_tokens - 1,
            self._token_limit() - state.num_tokens - 1,
            self._draft_room(plan),
        )
        if limit < 1:
            return ()
        tokens = [*state.request.prompt_token_ids, *state.output_token_ids]
        return speculator.propose(state.request_id, tokens, limit)

    def _draft_room(self, plan: _Plan) -> int:
        """The draft tokens a decoding request may add this step: a step of the running
        decode rows and their drafts stays within one step graph pass
        (:func:`stages.speculative.draft_room`). Decodes are planned first, so the chunks
        planned so far are decodes (their mirror counts them computed already)."""
        info = self._info
        rows = info.step_graph_rows if info is not None else 0
        waiting = sum(
            1
            for s in self._running.values()
            if s.request_id not in plan.chunks and s.num_tokens - s.num_computed_tokens == 1
        )
        return draft_room(rows, len(plan.chunks) + waiting)

    def _add_chunk(
        self,
        state: _RequestState,
        size: int,
        plan: _Plan,
        block_size: int,
        draft: tuple[int, ...] = (),
    ) -> None:
        start = state.num_computed_tokens
        needed = _blocks_for(start + size, block_size) - _blocks_for(start, block_size)
        assert needed <= plan.free_blocks, "planned more blocks than free"
        plan.free_blocks -= needed
        plan.budget -= size
        plan.seqs_left -= 1
        plan.chunks[state.request_id] = ScheduledChunk(state.request_id, start, size, draft)
        state.num_blocks += needed
        state.num_computed_tokens = start + size

    def _select_victim(self) -> _RequestState:
        candidates = list(self._running.values())
        victim = self.policy.select_victim(candidates)
        state = self._running.get(victim.request_id)
        if state is None:
            raise SchedulerError(
                f"policy {self.policy.name!r} chose victim {victim.request_id!r}, "
                "which is not among the running requests it was given"
            )
        return state

    def _ordered_waiting(self) -> list[_RequestState]:
        waiting = list(self._waiting.values())
        ordered = self.policy.order_waiting(waiting)
        ids = [view.request_id for view in ordered]
        if len(ids) != len(waiting) or set(ids) != self._waiting.keys():
            raise SchedulerError(
                f"policy {self.policy.name!r}: order_waiting must return a permutation of the "
                f"{len(waiting)} waiting requests, got {len(ids)} entries"
            )
        return [self._waiting[request_id] for request_id in ids]

    def _schedule_waiting(self, plan: _Plan, block_size: int) -> list[EngineRequest]:
        new_requests: list[EngineRequest] = []
        if not self._waiting or len(self._running) >= self.config.max_num_seqs:
            return new_requests
        limit = self._token_limit()
        nothing_else_runs = not self._running
        adapters = running_adapters(self._running.values(), self.config.max_loras)
        for state in self._ordered_waiting():
            if plan.budget == 0 or len(self._running) >= self.config.max_num_seqs:
                break
            if plan.seqs_left == 0:
                break
            if state.request_id in self._busy:
                continue  # an aborted request of this id is still in flight
            if adapters is not None and not adapters.admits(state.request.lora):
                continue  # its adapter would exceed max_loras: it waits (as vLLM's scheduler)
            if state.num_prompt_tokens >= limit:
                # Admit refuses it; without admit it can never run: end it as an error.
                del self._waiting[state.request_id]
                state.status = _Status.DONE
                self._unrunnable.append(state)
                if state.sent_to_execute:
                    self._pending_finish.append(state)
                self.policy.on_finish(state)
                continue
            size = self._chunk_size(state, plan.budget)
            if _blocks_for(size, block_size) > plan.free_blocks:
                if not nothing_else_runs:
                    break  # wait for running requests to free blocks (no partial admission)
                size = min(size, plan.free_blocks * block_size)
                if size < 1:
                    break
            del self._waiting[state.request_id]
            state.status = _Status.RUNNING
            self._running[state.request_id] = state
            if adapters is not None:
                adapters.add(state.request.lora)
            nothing_else_runs = False
            if not state.sent_to_execute:
                state.sent_to_execute = True
                state.scheduled_time = self._clock()
                new_requests.append(state.request)
                if state.request.kv_blocks is not None:  # imported once: not kept (P/D)
                    state.request = dataclasses.replace(state.request, kv_blocks=None)
            self._add_chunk(state, size, plan, block_size)
        return new_requests

    def schedule(self) -> SchedulerStep | None:
        """Plan the next step.

        Returns:
            The step for execute, or None when a step is in flight, the engine info is not
            known yet, or there is nothing to do. A step with no chunks only frees state.
        Raises:
            SchedulerError: the policy answered with requests it was not given.
        """
        if len(self._in_flight) >= self.config.max_steps_in_flight or self._info is None:
            return None
        block_size = self._info.block_size
        finishing, self._pending_finish = self._pending_finish, []
        plan = _Plan(budget=self.config.max_num_batched_tokens, free_blocks=self._free_blocks)
        if self.config.max_steps_in_flight > 1:
            plan.seqs_left = fair_share(
                len(self._running) + len(self._waiting), self.config.max_steps_in_flight
            )
        for state in finishing:
            self._credit_freed_blocks(state, plan)
        self._schedule_running(plan, block_size)
        new_requests: list[EngineRequest] = []
        # NOTE: as in vLLM, a step that had to preempt admits no waiting request: blocks are
        # short, and admitting would only preempt again.
        if not plan.preempted:
            new_requests = self._schedule_waiting(plan, block_size)
        # A request that was preempted earlier and found unrunnable above is known to
        # execute: free it in this step too.
        finishing.extend(self._pending_finish)
        self._pending_finish = []
        if not (plan.chunks or finishing or plan.preempted or self._unrunnable):
            return None
        step = SchedulerStep(
            step_id=self._next_step_id,
            new_requests=tuple(new_requests),
            chunks=tuple(plan.chunks.values()),
            finished=tuple(s.request_id for s in finishing),
            preempted=tuple(plan.preempted),
            spare_blocks=self.config.max_steps_in_flight == 1,
        )
        self._next_step_id += 1
        states = {request_id: self._running[request_id] for request_id in plan.chunks}
        # NOTE: a chunk with a draft computes past the known tokens by its draft's length
        sampling = {
            rid
            for rid, s in states.items()
            if s.num_computed_tokens == s.num_tokens + len(plan.chunks[rid].draft_token_ids)
        }
        decoding = {
            rid
            for rid in sampling
            if plan.chunks[rid].num_tokens == 1 + len(plan.chunks[rid].draft_token_ids)
            and states[rid].num_output_tokens > 0
        }
        net = self._free_blocks - plan.free_blocks
        self._free_blocks = plan.free_blocks
        self._in_flight[step.step_id] = _InFlight(
            step, self._clock(), states, sampling, decoding, net
        )
        for request_id in states:
            self._busy[request_id] = step.step_id
        return step

    # ------------------------------------------------------------------ results

    def _stop_reason(self, state: _RequestState, token_id: int) -> tuple[str, int | None] | None:
        """Whether ``state`` is done after sampling ``token_id`` (vLLM ``check_stop``)."""
        assert self._info is not None
        params = state.request.params
        # NOTE: a constrained request samples EOS or a stop id before min_tokens only where its
        # grammar allowed nothing else (execute's sampler lets the grammar win over
        # min_tokens): the output is complete, so it stops (docs/structured-outputs.md).
        if state.num_output_tokens >= params.min_tokens or params.structured_outputs is not None:
            if not params.ignore_eos and token_id in self._info.eos_token_ids:
                return _FINISH_STOP, None  # vLLM: EOS is no stop_reason
            if token_id in params.stop_token_ids:
                return _FINISH_STOP, token_id
        if state.num_output_tokens >= state.max_tokens or state.num_tokens >= self._token_limit():
            return _FINISH_LENGTH, None
        return None

    def update(self, result: StepResult) -> EngineOutputs:
        """Apply execute's result of a step in flight.

        Returns:
            The new token of every request that sampled (and any request ended without
            running), with finish reasons and the current stats.
        Raises:
            SchedulerError: no step is in flight, the step id does not match, no KV blocks
                are reported, or execute returned a token for a request whose chunk did not
                sample (or none for one whose chunk did).
        """
        if not self._in_flight:
            raise SchedulerError(f"StepResult {result.step_id} arrived with no step in flight")
        in_flight = self._in_flight.get(result.step_id)
        if in_flight is None:
            raise SchedulerError(
                f"StepResult {result.step_id} does not answer step "
                f"{' or '.join(str(step_id) for step_id in self._in_flight)}"
            )
        if result.total_blocks < 1:
            raise SchedulerError(f"StepResult {result.step_id} reports no KV blocks in total")
        del self._in_flight[result.step_id]
        self._num_steps += 1
        # execute counted its free blocks with the steps up to prepared_through allocated:
        # the later ones in flight take (or give) theirs still
        self._free_blocks = free_after(
            result, [(step_id, f.net_blocks) for step_id, f in self._in_flight.items()]
        )
        for request_id, settled in in_flight.states.items():
            del self._busy[request_id]
            if settled.status is _Status.DONE:  # aborted while in flight: freed now
                self._pending_finish.append(settled)
        self._shared_blocks = result.shared_blocks
        self._total_blocks = result.total_blocks
        self._prefix_cache_queries = result.prefix_cache_queries
        self._prefix_cache_hits = result.prefix_cache_hits
        self._last_step_seconds = max(self._clock() - in_flight.started, 0.0)
        self._last_forward_seconds = result.forward_seconds
        self._communication_seconds += result.communication_seconds
        self._shard_busy_seconds = sum_shard_seconds(self._shard_busy_seconds, result.shard_seconds)
        self._pipeline_answer_bytes += result.pipeline_answer_bytes
        self._execute_threads = result.threads or self._execute_threads

        preempted = set(result.preempted)
        for request_id in result.preempted:
            state = in_flight.states.get(request_id)
            if state is None:
                raise SchedulerError(f"execute preempted {request_id!r}, which had no chunk")
            # Execute already freed its blocks (they are in `free_blocks`).
            state.num_blocks = 0
            state.num_computed_tokens = 0
            if state.status is _Status.RUNNING:
                del self._running[request_id]
                state.status = _Status.WAITING
                state.num_preemptions += 1
                self._waiting[request_id] = state
                self._num_preemptions += 1
        for request_id, cached in result.cached_tokens.items():
            state = in_flight.states.get(request_id)
            if state is not None and not state.cached_tokens_reported:
                state.num_cached_tokens = cached
        assert self._info is not None  # a step was scheduled
        for request_id, served in result.computed_tokens.items():
            # The cache served past the chunk (blocks that cost execute nothing, or that it
            # could spare): those tokens are computed, their blocks held.
            state = in_flight.states.get(request_id)
            if state is None or request_id in preempted or state.status is not _Status.RUNNING:
                continue
            if not state.num_computed_tokens < served < state.num_tokens:
                raise SchedulerError(
                    f"execute reports {served} computed tokens for {request_id!r}, which "
                    f"has {state.num_computed_tokens} computed of {state.num_tokens}"
                )
            state.num_computed_tokens = served
        accepted = self._roll_back_drafts(in_flight, result, preempted)
        for request_id, state in in_flight.states.items():
            # What execute holds now: after the step it gave back what fell behind a window.
            if request_id not in preempted:
                state.num_blocks = self._held_blocks(state.num_computed_tokens)

        logprobs_by_id = dict(zip(result.logprob_request_ids, result.logprobs, strict=True))
        ids: list[str] = []
        new_tokens: list[tuple[int, ...]] = []
        finish_reasons: list[str | None] = []
        stop_reasons: list[int | None] = []
        logprobs: dict[str, tuple[Logprobs, ...]] = {}
        prompt_logprobs: dict[str, tuple[Logprobs, ...]] = {}
        cached_tokens: dict[str, int] = {}
        scheduler_times: dict[str, tuple[float, float]] = {}
        now = self._clock()
        expected = in_flight.sampling - preempted
        for request_id, token_id in zip(result.request_ids, result.token_ids, strict=True):
            if request_id not in expected:
                raise SchedulerError(
                    f"execute sampled a token for {request_id!r}, whose chunk does not sample"
                )
            expected.discard(request_id)
            state = in_flight.states[request_id]
            if state.request.pooling is not None:
                raise SchedulerError(
                    f"execute sampled a token for {request_id!r}, an embedding request"
                )
            if state.status is not _Status.RUNNING:
                continue  # aborted while the step was in flight
            if len(state.output_token_ids) == 0 and state.scheduled_time is not None:
                # vLLM's queued and prefill intervals (vllm/v1/metrics/stats.py), on one clock
                scheduled = state.scheduled_time
                scheduler_times[request_id] = (scheduled - state.arrival_time, now - scheduled)
            # NOTE: a verified draft's accepted tokens come before the sampled one; the first
            # that stops the request ends its run, the tokens after it are dropped.
            run: list[int] = []
            stop = None
            for token in (*accepted.get(request_id, ()), token_id):
                state.output_token_ids.append(token)
                run.append(token)
                stop = self._stop_reason(state, token)
                if stop is not None:
                    break
            # NOTE: with stop strings a run goes out one entry per token (the same id in
            # order): stop-check then ends the request at the token that completes a stop
            # string, and drops the entries after it (docs/speculative.md)
            entries = [(token,) for token in run] if state.request.params.stop else [tuple(run)]
            for before_last, entry in enumerate(entries, 1 - len(entries)):
                ids.append(request_id)
                new_tokens.append(entry)
                finish_reasons.append(None if stop is None or before_last else stop[0])
                stop_reasons.append(None if stop is None or before_last else stop[1])
            if request_id in logprobs_by_id:
                logprobs[request_id] = (logprobs_by_id[request_id],)
            if request_id in result.prompt_logprobs:
                prompt_logprobs[request_id] = result.prompt_logprobs[request_id]
            if not state.cached_tokens_reported:
                state.cached_tokens_reported = True
                if state.num_cached_tokens > 0:
                    cached_tokens[request_id] = state.num_cached_tokens
            if stop is not None:
                del self._running[request_id]
                self._finish(state)
        embeddings: dict[str, Any] = {}
        for request_id, embedding in result.embeddings.items():
            # An embedding request's last chunk pooled instead of sampling: it is done
            # (docs/architecture.md §12).
            if request_id not in expected or in_flight.states[request_id].request.pooling is None:
                raise SchedulerError(
                    f"execute pooled {request_id!r}, which is no embedding request whose chunk "
                    "ends its prompt"
                )
            expected.discard(request_id)
            state = in_flight.states[request_id]
            if state.status is not _Status.RUNNING:
                continue  # aborted while the step was in flight
            if state.scheduled_time is not None:
                scheduled = state.scheduled_time
                scheduler_times[request_id] = (scheduled - state.arrival_time, now - scheduled)
            ids.append(request_id)
            new_tokens.append(())
            finish_reasons.append(_FINISH_STOP)
            stop_reasons.append(None)
            embeddings[request_id] = embedding
            if state.num_cached_tokens > 0:
                cached_tokens[request_id] = state.num_cached_tokens
            del self._running[request_id]
            self._finish(state)
        if expected:
            raise SchedulerError(f"execute returned no token for {sorted(expected)}")
        for state in self._unrunnable:
            ids.append(state.request_id)
            new_tokens.append(())
            finish_reasons.append(_FINISH_ERROR)
            stop_reasons.append(None)
        self._unrunnable = []

        computed = [c for c in in_flight.step.chunks if c.request_id not in preempted]
        num_decode = sum(1 for c in computed if c.request_id in in_flight.decoding)
        self._last_step_tokens = sum(c.num_tokens for c in computed)
        self.policy.on_step(
            StepObservation(
                duration=result.forward_seconds or self._last_step_seconds,
                num_prefill_tokens=self._last_step_tokens - num_decode,
                num_decode_tokens=num_decode,
            )
        )
        return EngineOutputs(
            request_ids=tuple(ids),
            new_token_ids=tuple(new_tokens),
            finish_reasons=tuple(finish_reasons),
            stop_reasons=tuple(stop_reasons),
            logprobs=logprobs,
            num_cached_tokens=cached_tokens,
            stats=self.stats(),
            scheduler_times=scheduler_times,
            prompt_logprobs=prompt_logprobs,
            embeddings=embeddings,
        )

    def _roll_back_drafts(
        self, in_flight: _InFlight, result: StepResult, preempted: set[str]
    ) -> dict[str, tuple[int, ...]]:
        """Take each verified draft's accepted tokens from ``result``: the mirror's computed
        tokens drop the rejected ones (execute rolled their KV slots back the same way), the
        speculator counts them.

        Returns:
            The accepted draft tokens of each request that drafted and was not preempted.
        Raises:
            SchedulerError: execute's accepted tokens are missing, or not a prefix of the
                draft, or come for a request that drafted nothing.
        """
        drafts = {c.request_id: c.draft_token_ids for c in in_flight.step.chunks}
        try:
            accepted = accepted_drafts(drafts, result.accepted_token_ids, preempted)
        except ValueError as exc:
            raise SchedulerError(f"StepResult {result.step_id}: {exc}") from None
        for request_id, taken in accepted.items():
            state = in_flight.states[request_id]
            num_drafted = len(drafts[request_id])
            state.num_computed_tokens -= num_drafted - len(taken)
            if self._speculator is not None and state.status is _Status.RUNNING:
                self._speculator.observe(request_id, num_drafted, len(taken))
        if self._speculator is not None:  # draft_model: the drafts for the next step
            self._speculator.receive(
                result.request_ids, result.draft_token_ids, result.drafts_dropped
            )
        return accepted
