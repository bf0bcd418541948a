"""Server-sent events: a streamed answer is ``data: {json}`` events ending with
``data: [DONE]``, as OpenAI and vLLM stream. An error after the stream began is sent as one
``data: {"error": {...}}`` event before ``[DONE]`` (vLLM does the same).

NOTE: the response is plain asyncio (not Starlette's StreamingResponse, whose disconnect
watch runs in an anyio task group): the handler's own watch (:class:`~pipeline.server.http.
choices.Choices`) aborts the engine requests when the client goes, and the response closes
every choice however it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.server.http.choices import Choices
from pipeline.server.http.errors import ApiError

__all__ = ["DONE", "EventStream", "event"]

logger = logging.getLogger("actorline.server.http")

DONE = "data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> str:
    """One event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStream(Response):
    """The events of ``choices`` (``events`` then ``[DONE]``) as a ``text/event-stream``
    response, which ends every choice however the response ends: finished, failed, the
    client gone, or cancelled."""

    media_type = "text/event-stream"

    def __init__(
        self,
        choices: Choices,
        events: AsyncGenerator[str, None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        # NOTE: no Response.__init__: it would render a body and set Content-Length
        self.status_code = 200
        self.background = None
        self.init_headers({**_HEADERS, **(headers or {})})
        self._choices = choices
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self._stream()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await stream.aclose()
            await self._events.aclose()
            await self._choices.close()

    async def _stream(self) -> AsyncGenerator[bytes, None]:
        try:
            async with contextlib.aclosing(self._events):
                async for item in self._events:
                    yield item.encode()
        except Exception as exc:
            error = ApiError.from_error(exc)
            logger.warning("request %s failed mid-stream: %s", self._choices.request_id, error)
            yield event(error.body()).encode()
        finally:
            await self._choices.close()
        yield DONE.encode()
