"""Stage.colocated and Stage.call (docs/architecture.md §2.7): a stage linked to exactly one
stage of its own host can call that stage's methods directly, counted in the callee's
statistics, its raise failing the pipeline as the callee's; a port linked to a stage on
another host, to two stages, or to an exit has no colocated stage; record_work counts a
loop's work as the stage's."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import Pipeline, Stage, StageFailedError, handles


class Doubler(Stage):
    inputs = ("in",)
    outputs = ()

    async def double(self, value: int) -> int:
        if value < 0:
            raise ValueError(f"cannot double {value}")
        return 2 * value

    @handles(int)
    async def on_int(self, message: int) -> None:
        await self.double(message)


class Caller(Stage):
    """Answers each int on ``in`` with its double, called directly on the colocated stage
    behind ``peer`` (or the string "remote" when there is none)."""

    inputs = ("in",)
    outputs = ("peer", "out")
    optional_outputs = ("peer",)

    @handles(int)
    async def on_int(self, message: int) -> None:
        peer = self.colocated("peer")
        if not isinstance(peer, Doubler):
            await self.emit("out", "remote")
            return
        answer = await self.call(peer, peer.double, message)
        self.record_work(0.001)
        await self.emit("out", answer)


def _pipeline() -> Pipeline:
    pipeline = Pipeline("colocated").add("caller", Caller).add("doubler", Doubler)
    pipeline.connect("caller.peer", "doubler")
    return pipeline.entry("in", "caller").exit("out", "caller.out")


def test_a_colocated_stage_is_called_and_counted() -> None:
    async def body() -> None:
        async with await _pipeline().start(transport="memory") as running:
            for value in (1, 2, 3):
                await running.send("in", value)
                assert await asyncio.wait_for(running.receive("out"), 10) == 2 * value
            (host,) = await running.statistics()
            stages = {s.name: s for s in host.stages}
            assert stages["doubler"].handled == 3  # the calls, as if it handled messages
            assert stages["doubler"].mailbox.messages_sent == 0  # none through its mailbox
            assert stages["caller"].handled == 3 + 3  # its messages and the work it recorded
            await running.send("in", -1)
            with pytest.raises(StageFailedError) as failed:
                await asyncio.wait_for(running.receive("out"), 10)
            assert failed.value.stage == "doubler"
            assert "cannot double -1" in str(failed.value)

    asyncio.run(body())


def test_no_colocated_stage_across_hosts_or_with_two_links() -> None:
    async def body(pipeline: Pipeline, transport: str) -> None:
        async with await pipeline.start(transport=transport) as running:
            await running.send("in", 5)
            assert await asyncio.wait_for(running.receive("out"), 30) == "remote"

    asyncio.run(body(_pipeline().place("doubler", "other"), "zmq"))
    two = _pipeline().add("doubler_2", Doubler).connect("caller.peer", "doubler_2")
    asyncio.run(body(two, "memory"))
    to_exit = Pipeline("exit").add("caller", Caller).entry("in", "caller")
    to_exit.exit("out", "caller.out").exit("peer", "caller.peer")
    asyncio.run(body(to_exit, "memory"))
