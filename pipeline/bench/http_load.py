"""An HTTP load generator for OpenAI-compatible servers: streamed ``/v1/completions`` over
plain asyncio sockets (HTTP/1.1, chunked or not, server-sent events), so the same client
measures ``actorline serve --http-port`` and ``vllm serve`` alike with no client library
between the socket and the clock.

:func:`stream_completion` sends one request and records when each event carrying text arrives
(one token per event, as vLLM's ``benchmarks/benchmark_serving.py`` counts them); the online
benchmark turns those times into TTFT and inter-token latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

__all__ = ["HttpLoadError", "StreamTrace", "parse_events", "post_json", "stream_completion"]

_MAX_LINE = 1 << 20


class HttpLoadError(RuntimeError):
    """A request failed: an error status, a malformed answer or a closed connection."""


@dataclasses.dataclass(slots=True)
class StreamTrace:
    """One streamed request: when it was sent, when each text event arrived, when the stream
    ended, the completion tokens the server's usage reported (0 if none), and the last
    ``timings`` object an event carried (llama-server's own account; None from others)."""

    sent: float
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished: float = 0.0
    usage_tokens: int = 0
    timings: dict[str, Any] | None = None


def parse_events(buffer: bytes) -> tuple[list[Any], bytes, bool]:
    """The complete server-sent events in ``buffer``: their ``data:`` payloads decoded as
    JSON, the unparsed rest, and whether ``data: [DONE]`` came.

    Raises:
        HttpLoadError: a ``data:`` payload is not JSON.
    """
    text = buffer.replace(b"\r\n", b"\n")
    events: list[Any] = []
    done = False
    while b"\n\n" in text:
        event, text = text.split(b"\n\n", 1)
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                events.append(json.loads(payload))
            except ValueError:
                raise HttpLoadError(f"an event is not JSON: {payload[:200]!r}") from None
    return events, text, done


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> Any:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
            yield data
    else:
        while data := await reader.read(65536):
            yield data


async def _request(
    host: str, port: int, path: str, body: bytes, accept: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
    """Send one POST; the open connection, the status and the headers of its answer."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: {accept}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=_MAX_LINE)
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split(b" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
    except BaseException:
        writer.close()
        raise
    return reader, writer, status, headers


async def post_json(
    host: str, port: int, path: str, payload: dict[str, Any], *, timeout: float = 3600.0
) -> Any:
    """POST ``payload`` to ``path`` and return the JSON answer (not streamed).

    Raises:
        HttpLoadError: an error status or an answer that is not JSON.
        TimeoutError: no answer within ``timeout`` seconds.
    """

    async def exchange() -> Any:
        body = json.dumps(payload).encode()
        reader, writer, status, headers = await _request(host, port, path, body, "application/json")
        try:
            data = b"".join([chunk async for chunk in _body_chunks(reader, headers)])
        finally:
            writer.close()
        if status != 200:
            raise HttpLoadError(f"{path}: status {status}: {data[:500]!r}")
        try:
            return json.loads(data)
        except ValueError:
            raise HttpLoadError(f"{path}: the answer is not JSON: {data[:200]!r}") from None

    return await asyncio.wait_for(exchange(), timeout)


async def stream_completion(
    host: str, port: int, payload: dict[str, Any], *, timeout: float = 600.0
) -> StreamTrace:
    """POST ``payload`` (with ``"stream": true``) to ``/v1/completions`` and time its events.

    Raises:
        HttpLoadError: the server answered an error or broke the stream.
        TimeoutError: no answer within ``timeout`` seconds.
    """
    body = json.dumps({**payload, "stream": True}).encode()

    async def exchange() -> StreamTrace:
        sent = time.perf_counter()
        reader, writer, status, headers = await _request(
            host, port, "/v1/completions", body, "text/event-stream"
        )
        try:
            trace = StreamTrace(sent)
            if status != 200:
                rest = await reader.read(2000)
                raise HttpLoadError(f"status {status}: {rest[:500]!r}")
            pending, done = b"", False
            async for data in _body_chunks(reader, headers):
                now = time.perf_counter()
                events, pending, finished = parse_events(pending + data)
                done = done or finished
                for event in events:
                    for choice in event.get("choices") or ():
                        if choice.get("text"):
                            trace.token_times.append(now)
                    usage = event.get("usage")
                    if usage:
                        trace.usage_tokens = int(usage.get("completion_tokens") or 0)
                    if isinstance(event.get("timings"), dict):
                        trace.timings = event["timings"]
                if done:
                    break
            if not done:
                raise HttpLoadError("the stream ended without data: [DONE]")
            trace.finished = time.perf_counter()
            return trace
        finally:
            writer.close()

    return await asyncio.wait_for(exchange(), timeout)
