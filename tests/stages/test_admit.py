"""The admit stage in a real pipeline: validation, per-tenant rate limits, the queue bound —
every request is either forwarded or answered with a typed rejection, never dropped."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pipeline import Pipeline, RunningPipeline
from stages.admit import (
    PRUNE_BUCKETS_AT,
    AdmitConfig,
    AdmitStage,
    TenantLimits,
    validate_request,
)
from stages.errors import InvalidRequestError
from stages.messages import EngineInfo, EngineRequest, EngineStats, RequestRejected
from stages.params import SamplingParams
from stages.validation import resolve_max_tokens

INFO = EngineInfo(
    model="fake",
    vocab_size=1000,
    max_model_len=64,
    eos_token_ids=(2,),
    num_blocks=100,
    block_size=16,
    dtype="float32",
    device="cpu",
    kv_cache_bytes=0,
    enable_prefix_caching=True,
)


def admit_pipeline(config: AdmitConfig) -> Pipeline:
    pipeline = Pipeline("admit")
    pipeline.add("admit", AdmitStage, config)
    pipeline.entry("requests", "admit.in").entry("info", "admit.info").entry("stats", "admit.stats")
    pipeline.exit("admitted", "admit.out").exit("rejected", "admit.rejected")
    return pipeline


def run_admit(
    config: AdmitConfig, body: Callable[[RunningPipeline], Awaitable[Any]], *, info: bool = True
) -> Any:
    async def main() -> Any:
        async with await admit_pipeline(config).start() as running:
            if info:
                await running.send("info", INFO)
            return await body(running)

    return asyncio.run(asyncio.wait_for(main(), 60))


def request(
    request_id: str, prompt: tuple[int, ...] = (5, 6, 7), tenant: str = "", **params: Any
) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(**params), tenant)


async def answer(running: RunningPipeline, message: EngineRequest) -> Any:
    """Send one request and return its single answer (admitted request or rejection)."""
    await running.send("requests", message)
    admitted, rejected = running.exit_channel("admitted"), running.exit_channel("rejected")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30  # a hang guard, not a timing assumption
    while loop.time() < deadline:
        if len(admitted):
            return await running.receive("admitted")
        if len(rejected):
            return await running.receive("rejected")
        await asyncio.sleep(0.005)
    raise AssertionError(f"no answer for {message.request_id}")


@pytest.mark.parametrize(
    ("message", "kind", "field"),
    [
        (request("a", ()), "invalid", "prompt"),
        (request("b", (1,) * 64), "prompt_too_long", "prompt"),
        (request("c", (5, 1000)), "invalid", "prompt_token_ids"),
        (request("g", stop_token_ids=(5000,)), "invalid", "stop_token_ids"),
        (request("j", min_tokens=20, max_tokens=10), "invalid", "min_tokens"),
    ],
)
# NOTE: what every request's fields may hold (token ids that are ints, sampling parameters in
# range) is checked once, where the request enters the engine: those cases moved to
# tests/stages/test_validation.py (test_the_core_refuses_what_admit_used_to_check_again).
# Admit checks what only it knows: the prompt against the model's length and vocabulary, and
# min_tokens against the limit resolve_max_tokens derives.
def test_invalid_requests_are_rejected_naming_the_field(
    message: EngineRequest, kind: str, field: str
) -> None:
    async def body(running: RunningPipeline) -> None:
        rejected = await answer(running, message)
        assert isinstance(rejected, RequestRejected)
        assert (rejected.request_id, rejected.kind, rejected.field) == (
            message.request_id,
            kind,
            field,
        )
        # the next good request still passes
        assert isinstance(await answer(running, request("good")), EngineRequest)

    run_admit(AdmitConfig(), body)


def test_requests_wait_for_the_engine_info() -> None:
    async def body(running: RunningPipeline) -> None:
        for i in range(3):
            await running.send("requests", request(f"early-{i}"))
        await asyncio.sleep(0.1)
        assert len(running.exit_channel("admitted")) == 0  # held, not dropped
        await running.send("info", INFO)
        got = [await running.receive("admitted") for _ in range(3)]
        assert [r.request_id for r in got] == ["early-0", "early-1", "early-2"]

    run_admit(AdmitConfig(), body, info=False)


def test_requests_per_second_limit_per_tenant() -> None:
    # a burst of 2; refilling one request takes 20 s, far longer than the test runs
    limits = TenantLimits(requests_per_second=0.05, burst_seconds=40.0)
    config = AdmitConfig(tenant_limits={"small": limits})

    async def body(running: RunningPipeline) -> None:
        answers = [await answer(running, request(f"s{i}", tenant="small")) for i in range(3)]
        assert [type(a).__name__ for a in answers] == ["EngineRequest"] * 2 + ["RequestRejected"]
        assert answers[2].kind == "rate_limited" and "retry in" in answers[2].message
        # other tenants are not limited by it
        for i in range(5):
            assert isinstance(
                await answer(running, request(f"o{i}", tenant="other")), EngineRequest
            )

    run_admit(config, body)


def test_tokens_per_second_limit() -> None:
    # a burst of 30 tokens; refilling the 10 that t2 lacks takes 80 s, far longer than the test
    limits = TenantLimits(tokens_per_second=0.125, burst_seconds=240.0)
    config = AdmitConfig(default_limits=limits)

    async def body(running: RunningPipeline) -> None:
        first = await answer(running, request("t1", (5,) * 10, max_tokens=10))  # 20 tokens
        second = await answer(running, request("t2", (5,) * 10, max_tokens=10))  # over 30
        too_big = await answer(running, request("t3", (5,) * 30, max_tokens=16))  # 46 > burst
        assert isinstance(first, EngineRequest)
        assert isinstance(second, RequestRejected) and second.kind == "rate_limited"
        # waiting would never let it through: a bad request, not a retryable rate limit
        assert isinstance(too_big, RequestRejected)
        assert (too_big.kind, too_big.field) == ("invalid", "max_tokens")
        assert "needs 46 tokens" in too_big.message and "(30)" in too_big.message

    run_admit(config, body)


def test_max_tokens_none_means_the_rest_of_the_model_length() -> None:
    # a burst of 64 tokens that takes 512 s to refill: n2 is refused however slow the machine
    limits = TenantLimits(tokens_per_second=0.125, burst_seconds=512.0)
    config = AdmitConfig(default_limits=limits)

    async def body(running: RunningPipeline) -> None:
        admitted = await answer(running, request("n1", (5,) * 10, max_tokens=None))
        assert isinstance(admitted, EngineRequest)
        assert admitted.params.max_tokens == INFO.max_model_len - 10  # and it cost 64 tokens
        limited = await answer(running, request("n2", (5,) * 10, max_tokens=None))
        assert isinstance(limited, RequestRejected) and limited.kind == "rate_limited"
        too_many = await answer(running, request("n3", (5,) * 60, max_tokens=None, min_tokens=5))
        assert isinstance(too_many, RequestRejected)
        assert (too_many.kind, too_many.field) == ("invalid", "min_tokens")

    run_admit(config, body)


def test_max_tokens_none_is_capped_at_the_burst() -> None:
    # A tenant whose burst is below the model's length can still run a request without
    # max_tokens: it gets and pays for the whole burst (never more) instead of being refused
    # as too long.
    # a burst of 20 tokens; refilling the 4 that b2 costs takes 32 s, far longer than the test
    limits = TenantLimits(tokens_per_second=0.125, burst_seconds=160.0)
    config = AdmitConfig(default_limits=limits)

    async def body(running: RunningPipeline) -> None:
        admitted = await answer(running, request("b1", (5,) * 10, max_tokens=None))
        assert isinstance(admitted, EngineRequest)
        assert admitted.params.max_tokens == 20 - 10
        # it took the whole burst (20 tokens), so the next one waits
        limited = await answer(running, request("b2", (5,) * 3, max_tokens=1))
        assert isinstance(limited, RequestRejected) and limited.kind == "rate_limited"
        # a prompt over the burst is a bad request, never a retryable rate limit
        too_long = await answer(running, request("b3", (5,) * 30, max_tokens=None))
        assert isinstance(too_long, RequestRejected)
        assert (too_long.kind, too_long.field) == ("invalid", "prompt")
        assert "30 tokens" in too_long.message

    run_admit(config, body)


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "min_tokens"),
    [(10, None, 0), (30, None, 0), (10, None, 15), (60, None, 5), (10, 8, 0), (63, None, 0)],
)
def test_admit_resolves_max_tokens_by_the_one_rule(
    num_prompt: int, max_tokens: int | None, min_tokens: int
) -> None:
    """What admit admits or refuses is what :func:`resolve_max_tokens` says, with the
    tenant's burst (20 tokens) as the budget: the scheduler and the rate limit use that one
    number (the limit admitted is the one charged)."""
    limits = TenantLimits(tokens_per_second=1000.0, burst_seconds=0.02)  # a burst of 20
    message = request("m", (5,) * num_prompt, max_tokens=max_tokens, min_tokens=min_tokens)

    async def body(running: RunningPipeline) -> None:
        got = await answer(running, message)
        try:
            expected = resolve_max_tokens(
                message.params,
                prompt_tokens=num_prompt,
                max_model_len=INFO.max_model_len,
                budget=20.0,
                request_id="m",
            )
        except InvalidRequestError as error:
            assert isinstance(got, RequestRejected)
            assert (got.field, got.message) == (error.field, str(error))
            return
        if num_prompt + expected > 20:  # an explicit max_tokens over the burst
            assert isinstance(got, RequestRejected) and got.field == "max_tokens"
            assert f"needs {num_prompt + expected} tokens" in got.message
            return
        assert isinstance(got, EngineRequest) and got.params.max_tokens == expected

    run_admit(AdmitConfig(default_limits=limits), body)


def test_full_buckets_of_many_tenants_are_forgotten() -> None:
    config = AdmitConfig(default_limits=TenantLimits(requests_per_second=1000.0))

    async def body(running: RunningPipeline) -> None:
        for i in range(PRUNE_BUCKETS_AT):
            await running.send("requests", request(f"u{i}", tenant=f"user-{i}"))
        for _ in range(PRUNE_BUCKETS_AT):
            assert isinstance(await running.receive("admitted"), EngineRequest)
        # NOTE: every bucket refills within a millisecond of its one request. The next new
        # tenant prunes the table, so all of them must have refilled before it arrives
        # (not only by the end of the test): else the newest ones survive the prune.
        await asyncio.sleep(0.01)
        for i in range(PRUNE_BUCKETS_AT, PRUNE_BUCKETS_AT + 50):
            await running.send("requests", request(f"u{i}", tenant=f"user-{i}"))
        for _ in range(50):
            assert isinstance(await running.receive("admitted"), EngineRequest)
        await running.send("requests", request("last", tenant="one more"))
        assert isinstance(await running.receive("admitted"), EngineRequest)
        stage = running.stage("admit")
        assert isinstance(stage, AdmitStage)
        assert len(stage._buckets) <= 51

    run_admit(config, body)


def test_queue_bound_rejects_with_overloaded_until_the_engine_catches_up() -> None:
    async def body(running: RunningPipeline) -> None:
        assert isinstance(await answer(running, request("q1")), EngineRequest)
        assert isinstance(await answer(running, request("q2")), EngineRequest)
        over = await answer(running, request("q3"))
        assert isinstance(over, RequestRejected) and over.kind == "overloaded"
        # the scheduler reports an empty waiting queue: room again
        await running.send("stats", EngineStats(num_running=2, num_waiting=0, kv_blocks_total=100,
                                                kv_blocks_free=90))  # fmt: skip
        await asyncio.sleep(0.05)
        assert isinstance(await answer(running, request("q4")), EngineRequest)

    run_admit(AdmitConfig(max_queued_requests=2), body)


def test_a_prompt_the_whole_kv_cache_cannot_hold_is_too_long() -> None:
    small = dataclasses.replace(INFO, num_blocks=2)  # 32 tokens, under the model's 64

    async def body(running: RunningPipeline) -> None:
        await running.send("info", small)
        rejected = await answer(running, request("big", (5,) * 40))
        assert isinstance(rejected, RequestRejected)
        assert (rejected.kind, rejected.field) == ("prompt_too_long", "prompt")
        assert "KV cache holds 32" in rejected.message
        assert isinstance(await answer(running, request("fits", (5,) * 20)), EngineRequest)

    run_admit(AdmitConfig(), body, info=False)


def test_vllm_default_stop_lists_are_admitted() -> None:
    validate_request(request("v", stop=None, stop_token_ids=None), INFO)
