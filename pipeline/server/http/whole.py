"""A whole (not streamed) answer, built and written a slice at a time so that a large one does
not hold the event loop: the loop that runs the server also runs the gRPC front end and the
engine's frontend stages, and every stream waits while it is held.

The answer is an ordinary JSON value in which the long arrays (each choice's logprobs) are
:class:`LazyArray`: their items are made only as they are written, :data:`BATCH` at a time,
each batch encoded by :func:`json.dumps`. :class:`JsonAnswer` writes the pieces and yields the
loop once it has worked for :data:`SLICE_SECONDS`; what it wrote waits in the connection's
buffer (uvicorn applies the transport's flow control: a slow reader pauses the writer, so the
server never holds much more than one buffer of the answer). An answer that fits in one
buffer is sent whole with its ``Content-Length``; a longer one is sent chunked.

Measured with the issue's request (4 prompts x n=16 x 1,900 tokens, 20 top logprobs, a
5.2 MiB answer): written whole, it stalled every other stream for 1.1-1.8 s; written this way,
see docs/serving.md ("Large answers").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["BATCH", "SLICE_SECONDS", "JsonAnswer", "LazyArray", "json_pieces"]

#: array items made and encoded at once
BATCH = 256
#: seconds of work between two yields of the loop
SLICE_SECONDS = 0.005
#: bytes gathered before they are written
_BUFFER_BYTES = 64 * 1024
_HEADERS = [(b"content-type", b"application/json")]


class LazyArray:
    """A JSON array whose items ``items`` yields (plain JSON values: dicts, lists, strings,
    numbers, bools, None), made only when written."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items


def _dumps(value: Any) -> str:
    # NOTE: JSONResponse's settings (NaN is refused, not written as the non-JSON NaN)
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_pieces(value: Any) -> Iterator[str]:
    """``value`` as compact JSON, in pieces: dicts and lists are walked (their keys and short
    values encoded one by one), each :class:`LazyArray` made and encoded :data:`BATCH` items
    at a time; every other value is encoded whole.

    Raises:
        ValueError: a NaN or infinity; TypeError: a value JSON has no form for.
    """
    if isinstance(value, LazyArray):
        yield "["
        first = True
        batch: list[Any] = []
        for item in value.items:
            batch.append(item)
            if len(batch) == BATCH:
                yield ("" if first else ",") + _dumps(batch)[1:-1]
                first, batch = False, []
        if batch:
            yield ("" if first else ",") + _dumps(batch)[1:-1]
        yield "]"
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ("," if index else "") + _dumps(str(key)) + ":"
            yield from json_pieces(item)
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from json_pieces(item)
        yield "]"
    else:
        yield _dumps(value)


class JsonAnswer(Response):
    """``content`` (JSON, with :class:`LazyArray` parts) as an ``application/json`` response,
    written a slice at a time (see the module docstring)."""

    media_type = "application/json"

    def __init__(
        self, content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
    ) -> None:
        # NOTE: no Response.__init__: it would render the whole body
        self.status_code = status_code
        self.background = None
        self.init_headers()
        self._content = content
        self._raw = [
            *_HEADERS,
            *((name.lower().encode("latin-1"), value.encode("latin-1"))
              for name, value in (headers or {}).items()),
        ]  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pieces = json_pieces(self._content)
        buffer: list[str] = []
        size = 0
        started = False
        began = time.perf_counter()
        for piece in pieces:
            buffer.append(piece)
            size += len(piece)
            if size >= _BUFFER_BYTES:
                body = "".join(buffer).encode()
                buffer, size = [], 0
                if not started:
                    await send(
                        {"type": "http.response.start", "status": self.status_code,
                         "headers": self._raw}
                    )  # fmt: skip
                    started = True
                await send({"type": "http.response.body", "body": body, "more_body": True})
            if time.perf_counter() - began > SLICE_SECONDS:
                await asyncio.sleep(0)
                began = time.perf_counter()
        body = "".join(buffer).encode()
        if not started:
            headers = [*self._raw, (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": headers})  # fmt: skip
        await send({"type": "http.response.body", "body": body, "more_body": False})
