"""The engine requests answering one HTTP request, one per choice, and their lifetime.

All choices start at once; the answer waits for the first output of each, so that a refusal
(invalid, rate limited, overloaded) is answered with its HTTP status rather than in the middle
of a stream. A refusal of any choice refuses the whole request: the choices already admitted
are aborted. A client that disconnects aborts every choice (the engine frees their KV blocks
at once), and however the response ends (finished, failed, client gone, cancelled at
shutdown) every choice's engine stream is closed.

NOTE: plain asyncio. The cleanup runs in a task of its own that the caller awaits shielded,
so a response cancelled by the server (uvicorn's graceful-shutdown timeout) still closes its
engine streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Coroutine, Sequence
from typing import Any, cast

from starlette.types import Receive

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.prompts import CheckedPrompt
from stages.messages import RequestOutput
from transports.tasks import TaskSet

__all__ = ["Choices", "RunningRequests"]

logger = logging.getLogger("actorline.server.http")

_Arrival = tuple[int, RequestOutput | Exception | None]


class RunningRequests:
    """The engine requests an HTTP server is answering (to abort them at shutdown), and the
    tasks serving them: each :class:`Choices`' readers and disconnect watcher (its close
    cancels them) and the cleanups still running (kept referenced until they end)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.tasks = TaskSet("http requests")  # the cleanups, and each choice's tasks

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in a task that is kept referenced until it ends."""
        return self.tasks.spawn(work, name="http:close-choices")


class Choices:
    """The engine requests of one HTTP request (a choice's index is its position), started
    with :meth:`start`; :attr:`latest` holds each choice's latest output. ``per_prompt``:
    the choices of each prompt (``n``)."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        choices: Sequence[CheckedPrompt],
        tenant: str,
        running: RunningRequests,
        per_prompt: int = 1,
    ) -> None:
        self.request_id = request_id
        self.engine_ids = [f"{request_id}-{index}" for index in range(len(choices))]
        # NOTE: each prompt's n choices are one parent request to the metrics (vLLM's
        # parallel sampling); a choice of its own has none
        parents = [
            (f"{request_id}/{index // per_prompt}", per_prompt) if per_prompt > 1 else None
            for index in range(len(choices))
        ]
        self._engine = engine
        self._running = running
        # NOTE: generate() is an async generator; closing it aborts a running request
        self._streams = [
            cast(
                AsyncGenerator[RequestOutput, None],
                engine.generate(checked, request_id=engine_id, tenant=tenant, parent=parent),
            )
            for engine_id, checked, parent in zip(self.engine_ids, choices, parents)
        ]
        self.latest: list[RequestOutput] = []
        self._readers: list[asyncio.Task[Any]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._streams)

    async def start(self, receive: Receive) -> None:
        """Start every choice and wait for its first output; from now on a disconnect seen
        on ``receive`` (the request's, its body read) aborts them all.

        Raises:
            Exception: the engine's error for a choice (the first refused, by index), as soon
                as one is refused; every choice is closed then.
        """
        self._running.ids.update(self.engine_ids)
        tasks = self._running.tasks
        self._watcher = tasks.spawn(
            self._abort_on_disconnect(receive), name=f"http:watch:{self.request_id}"
        )
        try:
            readers = [
                tasks.spawn(_next(stream), name=f"http:first:{engine_id}")
                for stream, engine_id in zip(self._streams, self.engine_ids)
            ]
            self._readers = readers
            await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
            for reader in readers:
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise cast(Exception, reader.exception())
            self.latest = [reader.result() for reader in readers]
        except BaseException:
            await self.close()
            raise

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Every choice's outputs (its first one included) as they arrive, with its index.

        Raises:
            Exception: the first error of any choice (the engine died, ...).
        """
        arrived: asyncio.Queue[_Arrival] = asyncio.Queue()
        self._readers = [
            self._running.tasks.spawn(self._read(index, arrived), name=f"http:read:{engine_id}")
            for index, engine_id in enumerate(self.engine_ids)
        ]
        ended = 0
        while ended < len(self):
            index, item = await arrived.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                self.latest[index] = item
                yield index, item

    async def collect(self) -> list[RequestOutput]:
        """Every choice's last output (closes the choices).

        Raises:
            Exception: the first error of any choice.
        """
        try:
            async for _ in self.outputs():
                pass
            return self.latest
        finally:
            await self.close()

    async def close(self) -> None:
        """End every choice, aborting those still running. Idempotent; runs to its end even
        when the caller is cancelled."""
        if self._closing is None:
            self._closing = self._running.spawn(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._running.ids.difference_update(self.engine_ids)
        if self._watcher is not None:
            self._watcher.cancel()
        # NOTE: a stream can be closed only once no task runs it: cancel its reader first
        # (which ends it, aborting a running request), then close them all.
        for reader in self._readers:
            reader.cancel()
        if self._readers:
            await asyncio.wait(self._readers)
        for reader in self._readers:
            if not reader.cancelled():
                reader.exception()  # retrieved: a second refusal needs no warning
        for stream in self._streams:
            await stream.aclose()

    async def _read(self, index: int, arrived: asyncio.Queue[_Arrival]) -> None:
        arrived.put_nowait((index, self.latest[index]))
        try:
            async for output in self._streams[index]:
                arrived.put_nowait((index, output))
        except Exception as exc:
            arrived.put_nowait((index, exc))
        else:
            arrived.put_nowait((index, None))

    async def _abort_on_disconnect(self, receive: Receive) -> None:
        """Wait for the client to go away, then abort every choice (frees their KV)."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # the server is closing the connection
            logger.debug("request %s: receive failed: %s", self.request_id, exc)
        logger.info("client of %s disconnected; aborting", self.request_id)
        for engine_id in self.engine_ids:
            with contextlib.suppress(Exception):  # finished meanwhile, or the engine is gone
                await self._engine.abort(engine_id)


async def _next(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    return await anext(stream)
