"""Cycles in a pipeline: stages of one host that wait on each other's full mailboxes fail the
pipeline with DeadlockError (in the calling process and in a spawned host) instead of hanging;
a cycle that only comes close to full does not; the demo pipeline bounds what is in flight
around its cycle, so a job of any size runs in default mailboxes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pipeline import Caller, DeadlockError, Pipeline, Stage
from pipeline.demo import Job, collatz_pipeline, collatz_steps
from pipeline.runtime.stage import handles
from tests.pipeline.runtime.test_running import run
from transports.codec import message

# Generous bound: it only tells "fails or finishes" from "hangs" on a loaded machine.
PROMPTLY = 60.0


pytestmark = pytest.mark.usefixtures("no_child_left")


@message(64)
@dataclasses.dataclass(frozen=True, slots=True)
class Token:
    token_id: int
    hops: int  # how many more times it goes round before it leaves


class Relay(Stage):
    """Passes a token to the other relay until its hops run out, then to ``done``. Mailbox
    of one: two relays hold at most four tokens (one in each mailbox, one in each handler)."""

    mailbox_capacity = 1
    outputs = ("out", "done")

    @handles(Token)
    async def on_token(self, token: Token) -> None:
        if token.hops == 0:
            await self.emit("done", token)
        else:
            await self.emit("out", dataclasses.replace(token, hops=token.hops - 1))


def _relays(host: str = "main") -> Pipeline:
    pipeline = Pipeline("relays").add("ping", Relay, host=host).add("pong", Relay, host=host)
    pipeline.connect("ping.out", "pong").connect("pong.out", "ping")
    return pipeline.entry("tokens", "ping").exit("done", "ping.done", "pong.done")


async def _circulate(pipeline: Pipeline, tokens: int, hops: int) -> list[int]:
    """Send ``tokens`` tokens round the cycle; the ids of those that came out."""
    async with await pipeline.start() as running:
        caller = Caller(running, "tokens", "done", key=lambda token: token.token_id)
        done = await asyncio.wait_for(
            asyncio.gather(*(caller.call(Token(i, hops)) for i in range(tokens))), PROMPTLY
        )
        await caller.aclose()
    return sorted(token.token_id for token in done)


@pytest.mark.parametrize("host", ["main", "worker"])
def test_a_cycle_of_full_mailboxes_fails_with_deadlock_error(host: str) -> None:
    """Four tokens fill both relays: each waits to send into the other's full mailbox."""
    with pytest.raises(DeadlockError) as failure:
        run(lambda: _circulate(_relays(host), tokens=4, hops=1000))
    error = failure.value
    assert error.host == host
    assert sorted(error.stages) == ["ping", "pong"] and error.capacities == (1, 1)
    assert f"deadlock on host {host!r}" in str(error)
    assert "full mailbox (capacity 1)" in str(error)
    assert "Bound the messages in flight around a cycle" in str(error)


def test_a_cycle_one_short_of_full_is_no_deadlock() -> None:
    """Three tokens keep both relays as busy as they get without filling them: a relay
    waits for room that the other one is just making, which must not read as a deadlock."""
    assert asyncio.run(asyncio.wait_for(_circulate(_relays(), 3, 2000), PROMPTLY)) == [0, 1, 2]


# -- the demo pipeline: a window around its cycle -------------------------------------------------

#: 5000 items, more than the mailboxes of step and check hold together (2 x 1024)
BIG_JOB = Job("big", tuple(range(1, 5001)))
#: as many items, each done in one to ten steps (fewer messages between processes)
BIG_SHORT_JOB = Job("big-short", tuple(2 ** (1 + i % 10) for i in range(5000)))


async def _run_job(pipeline: Pipeline, job: Job) -> list[int]:
    async with await pipeline.start() as running:
        caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
        result = await asyncio.wait_for(caller.call(job), 300)
        await caller.aclose()
    steps: list[int] = result.steps.tolist()
    return steps


def test_the_demo_runs_a_job_larger_than_its_mailboxes_in_one_host() -> None:
    steps = asyncio.run(_run_job(collatz_pipeline(), BIG_JOB))
    assert steps == [collatz_steps(value) for value in BIG_JOB.values]


def test_the_demo_runs_a_job_larger_than_its_mailboxes_across_hosts() -> None:
    steps = asyncio.run(_run_job(collatz_pipeline().place("step", "worker"), BIG_SHORT_JOB))
    assert steps == [collatz_steps(value) for value in BIG_SHORT_JOB.values]


def test_without_its_window_the_demo_deadlocks_and_says_so() -> None:
    """The demo's cycle with more items in flight than its mailboxes hold: the error the
    runtime raises instead of hanging, naming the cycle."""
    pipeline = collatz_pipeline(window=len(BIG_JOB.values))
    with pytest.raises(DeadlockError) as failure:
        asyncio.run(_run_job(pipeline, BIG_JOB))
    assert sorted(failure.value.stages) == ["check", "step"]
    assert failure.value.capacities == (1024, 1024)
