"""The admit stage: checks the prompt against the model, resolves the request's token
limit, rate-limits tenants, bounds the queue.

The request's fields were checked once where it entered the engine
(:mod:`stages.validation`); admit checks only what it alone knows (the model's length, the KV
cache, the vocabulary: :func:`validate_request`) and derives ``max_tokens`` with the one rule,
:func:`stages.validation.resolve_max_tokens` (docs/architecture.md §7.1).

Every request is either forwarded to schedule or answered at once with a typed
:class:`~stages.messages.RequestRejected` (invalid → the field is named, over a tenant's limit
→ ``rate_limited``, too many queued → ``overloaded``); nothing is dropped silently.

Ports: ``in`` (EngineRequest from tokenize), ``info`` (EngineInfo from execute: model length
and vocabulary), ``stats`` (EngineStats from schedule: how many requests wait);
``out`` (to schedule), ``rejected`` (to the frontend).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipeline.runtime.stage import Stage, handles, recoverable
from stages.checks import check_token_ids
from stages.errors import (
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RateLimitedError,
    RequestError,
)
from stages.messages import EngineInfo, EngineRequest, EngineStats, RequestRejected
from stages.pooling import check_dimensions
from stages.recovery import rejection, request_id_of
from stages.token_bucket import TokenBucket
from stages.validation import resolve_max_tokens, room_after_prompt

__all__ = [
    "AdmitConfig",
    "AdmitStage",
    "TenantLimits",
    "validate_request",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TenantLimits:
    """Token-bucket limits of one tenant; None means unlimited. A bucket holds
    ``burst_seconds`` worth of its rate. Tokens count prompt plus ``max_tokens``."""

    requests_per_second: float | None = None
    tokens_per_second: float | None = None
    burst_seconds: float = 1.0

    def __post_init__(self) -> None:
        for name in ("requests_per_second", "tokens_per_second"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.burst_seconds <= 0:
            raise ValueError(f"burst_seconds must be > 0, got {self.burst_seconds}")


@dataclasses.dataclass(frozen=True, slots=True)
class AdmitConfig:
    """``max_queued_requests``: requests that may wait for the scheduler at once.
    ``tenant_limits`` overrides ``default_limits`` per tenant name."""

    max_queued_requests: int = 4096
    default_limits: TenantLimits = TenantLimits()
    tenant_limits: Mapping[str, TenantLimits] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")

    def limits_for(self, tenant: str) -> TenantLimits:
        return self.tenant_limits.get(tenant, self.default_limits)


def validate_request(request: EngineRequest, info: EngineInfo) -> None:
    """Check the prompt against the model before it can use any resource: what only admit
    knows (the model's length, the KV cache, the vocabulary). Every other field was checked
    once where the request entered the engine (:func:`stages.validation.validate_generate_request`,
    docs/architecture.md §7.1), and is trusted here.

    Raises:
        PromptTooLongError: the prompt leaves no room for one generated token in the model's
            length or in the whole KV cache.
        InvalidRequestError: an empty prompt, or a prompt or stop token id outside the
            vocabulary; an embedding request to an engine without embeddings, or with
            ``dimensions`` the model does not allow (the error names the field).
    """
    ids = request.prompt_token_ids
    if not ids:
        raise InvalidRequestError(
            "the prompt has no tokens", field="prompt", request_id=request.request_id
        )
    room_after_prompt(len(ids), info.max_model_len, request_id=request.request_id)
    kv_tokens = info.num_blocks * info.block_size
    if len(ids) >= kv_tokens:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens; the whole KV cache holds {kv_tokens} "
            "(prompt plus at least one generated token)",
            field="prompt",
            request_id=request.request_id,
        )
    vocab = info.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab})",
            field="prompt_token_ids",
            request_id=request.request_id,
        )
    if request.pooling is not None:
        check_dimensions(
            request.pooling,
            model=info.model,
            embedding_size=info.embedding_size,
            matryoshka_dimensions=info.matryoshka_dimensions,
            request_id=request.request_id,
        )
    # NOTE: the façade checks stop token ids against the vocabulary only once it knows it
    # (not for a request sent while the engine starts): admit always does.
    check_token_ids(
        "stop_token_ids",
        request.params.stop_token_ids,
        vocab_size=vocab,
        allow_empty=True,
        request_id=request.request_id,
    )


#: the number of tenants' buckets above which full ones are forgotten
PRUNE_BUCKETS_AT = 1024


class _TenantBuckets:
    __slots__ = ("requests", "tokens")

    def __init__(self, limits: TenantLimits) -> None:
        self.requests = (
            TokenBucket(
                limits.requests_per_second,
                max(1.0, limits.requests_per_second * limits.burst_seconds),
            )
            if limits.requests_per_second
            else None
        )
        self.tokens = (
            TokenBucket(
                limits.tokens_per_second, max(1.0, limits.tokens_per_second * limits.burst_seconds)
            )
            if limits.tokens_per_second
            else None
        )

    def full(self) -> bool:
        """Whether both buckets are full again: then this equals a fresh one."""
        return all(bucket is None or bucket.full for bucket in (self.requests, self.tokens))


class AdmitStage(Stage):
    inputs = ("in", "info", "stats")
    outputs = ("out", "rejected")

    def __init__(self, config: AdmitConfig | None = None) -> None:
        super().__init__(config or AdmitConfig())
        self.engine: EngineInfo | None = None
        self._held: list[EngineRequest] = []
        self._buckets: dict[str, _TenantBuckets] = {}
        self._waiting_at_last_stats = 0
        self._admitted_since_stats = 0

    @handles(EngineInfo)
    async def on_engine_info(self, info: EngineInfo) -> None:
        self.engine = info
        held, self._held = self._held, []
        for request in held:
            try:
                await self.on_request(request)
            except Exception as error:  # as the runtime would for this request's own message
                if not recoverable(error) or not await self.recover(request, "in", error):
                    raise
                self.contained(error, info, request.request_id)

    @handles(EngineStats)
    async def on_stats(self, stats: EngineStats) -> None:
        self._waiting_at_last_stats = stats.num_waiting
        self._admitted_since_stats = 0

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        if self.engine is None:
            if len(self._held) >= self.config.max_queued_requests:
                await self._reject(request, OverloadedError("the engine is still starting"))
            else:
                self._held.append(request)
            return
        try:
            validate_request(request, self.engine)
            buckets = self._buckets_of(request.tenant)
            max_tokens = resolve_max_tokens(
                request.params,
                prompt_tokens=len(request.prompt_token_ids),
                max_model_len=self.engine.max_model_len,
                budget=buckets.tokens.burst if buckets.tokens is not None else None,
                tenant=request.tenant,
                request_id=request.request_id,
            )
            if max_tokens != request.params.max_tokens:
                params = request.params.replace(max_tokens=max_tokens)
                request = dataclasses.replace(request, params=params)
            self._check_queue()
            self._check_rate(request, buckets, max_tokens)
        except RequestError as error:
            await self._reject(request, error)
            return
        self._admitted_since_stats += 1
        await self.emit("out", request)

    def _check_queue(self) -> None:
        queued = self._waiting_at_last_stats + self._admitted_since_stats
        if queued >= self.config.max_queued_requests:
            raise OverloadedError(
                f"{queued} requests are queued "
                f"(limit {self.config.max_queued_requests}); retry later"
            )

    def _buckets_of(self, tenant: str) -> _TenantBuckets:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            if len(self._buckets) >= PRUNE_BUCKETS_AT:
                self._prune_buckets()
            buckets = _TenantBuckets(self.config.limits_for(tenant))
            self._buckets[tenant] = buckets
        return buckets

    def _check_rate(self, request: EngineRequest, buckets: _TenantBuckets, max_tokens: int) -> None:
        """Take the request's cost from its tenant's buckets, or raise.

        The cost is the prompt plus ``max_tokens`` as :func:`resolve_max_tokens` resolved it
        (a request without ``max_tokens`` from a tenant with a tokens/s limit already got it
        capped at what the tenant's burst leaves after the prompt: it takes all the tenant
        may use at once, and can never generate more than it paid for).

        Raises:
            InvalidRequestError: the cost is more than the tenant's burst (waiting never helps).
            RateLimitedError: the tenant's buckets cannot pay for it now.
        """
        tenant = request.tenant or "(default)"
        cost = len(request.prompt_token_ids) + max_tokens
        if buckets.tokens is not None and cost > buckets.tokens.burst:
            # Waiting never helps this request: not a rate limit (retryable) but a bad one.
            raise InvalidRequestError(
                f"the request needs {cost} tokens (prompt plus max_tokens), more than tenant "
                f"{tenant} may use at once ({buckets.tokens.burst:.0f}); lower max_tokens",
                field="max_tokens",
                request_id=request.request_id,
            )
        for bucket, amount, what in (
            (buckets.requests, 1, "requests"),
            (buckets.tokens, cost, "tokens"),
        ):
            wait = bucket.retry_after(amount) if bucket is not None else 0.0
            if wait > 0:
                raise RateLimitedError(
                    f"tenant {tenant} is over its limit of {what} per second; retry in {wait:.2f}s",
                    retry_after=wait,
                )
        # take from both only once both allow it, so a refusal costs the tenant nothing
        if buckets.requests is not None:
            buckets.requests.try_take(1)
        if buckets.tokens is not None:
            buckets.tokens.try_take(cost)

    def _prune_buckets(self) -> None:
        # A full bucket is what a new tenant gets, so forgetting it changes nothing; this
        # bounds the table when tenant names are many (one per user, say).
        self._buckets = {name: b for name, b in self._buckets.items() if not b.full()}

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request this stage failed on is answered with a typed error. Nothing is kept
        per request (a request whose send to schedule failed has paid its tenant's buckets,
        as one that ran), so the stage goes on as it was."""
        request_id = request_id_of(message)
        if request_id is None:
            return False
        await self.emit("rejected", rejection(self.name, request_id, error))
        return True

    async def _reject(self, request: EngineRequest, error: RequestError) -> None:
        await self.emit(
            "rejected",
            RequestRejected.of(request.request_id, error),
        )

    def idle(self) -> bool:
        return not self._held
