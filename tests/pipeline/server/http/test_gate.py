"""The gate of the HTTP API: API keys checked before any body is read, and the body cap.

In process, the gate in front of a FastAPI app with a JSON body (ASGI messages driven by the
test): a ``Content-Length`` over the cap is refused before the body is read at all, a
chunked body is refused once past the cap (no more of it is read), a body within the cap
passes. Through ``actorline serve``: 20 MB bodies, declared or chunked, get 413 with an
OpenAI-style error, the server's memory stays bounded, and a stream running meanwhile is not
disturbed."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from pipeline.server.auth import ApiKey, ApiKeys
from pipeline.server.http.errors import add_error_handlers
from pipeline.server.http.gate import Gate, tenant_of
from tests.pipeline.server.http.conftest import API_KEY, IGNORE_EOS, MODEL
from tests.pipeline.server.serving import ServeProcess

CAP = 1000
CHUNK = 256
KEY = "gate-key"


class Body(BaseModel):
    text: str


def gated_app(keys: ApiKeys) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Gate, api_keys=keys, max_request_bytes=CAP)
    add_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(body: Body, request: Request) -> dict[str, Any]:
        return {"length": len(body.text), "tenant": tenant_of(request.scope)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


class Exchange:
    """One request driven through an ASGI app: the body in ``chunks`` (``more_body`` until
    the last), and what the app sent back."""

    def __init__(self, chunks: list[bytes], headers: dict[str, str]) -> None:
        self.chunks = chunks
        headers = {"content-type": "application/json", **headers}
        self.headers = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
        self.received = 0  # body messages the app took
        self.sent: list[dict[str, Any]] = []

    async def run(self, app: FastAPI, method: str, path: str) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": self.headers, "scheme": "http", "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 1234), "root_path": "",
        }  # fmt: skip

        async def receive() -> dict[str, Any]:
            if self.received < len(self.chunks):
                self.received += 1
                more = self.received < len(self.chunks)
                return {"type": "http.request", "body": self.chunks[self.received - 1],
                        "more_body": more}  # fmt: skip
            await asyncio.sleep(3600)  # the client waits for the answer
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            self.sent.append(message)

        await asyncio.wait_for(app(scope, receive, send), 30)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def response_headers(self) -> dict[str, str]:
        return {name.decode(): value.decode() for name, value in self.sent[0]["headers"]}

    def json(self) -> Any:
        return json.loads(b"".join(message.get("body", b"") for message in self.sent[1:]))


def exchange(
    app: FastAPI, chunks: list[bytes], headers: dict[str, str], path: str = "/v1/echo"
) -> Exchange:
    done = Exchange(chunks, headers)
    asyncio.run(done.run(app, "POST" if chunks else "GET", path))
    return done


def body_of(size: int) -> bytes:
    """A JSON body of exactly ``size`` bytes."""
    overhead = len(json.dumps({"text": ""}))
    return json.dumps({"text": "x" * (size - overhead)}).encode()


def chunked(data: bytes) -> list[bytes]:
    return [data[index : index + CHUNK] for index in range(0, len(data), CHUNK)]


def test_a_body_within_the_cap_passes() -> None:
    data = body_of(CAP)
    for headers in ({"content-length": str(len(data))}, {}):  # declared, then chunked
        done = exchange(gated_app(ApiKeys()), chunked(data), headers)
        assert done.status == 200
        assert done.json() == {"length": CAP - len(json.dumps({"text": ""})), "tenant": ""}


def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    data = body_of(CAP + 1)
    done = exchange(gated_app(ApiKeys()), chunked(data), {"content-length": str(len(data))})
    assert done.status == 413 and done.received == 0
    assert done.response_headers["connection"] == "close"
    error = done.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert f"is {CAP + 1} bytes" in error["message"] and "--max-request-bytes" in error["message"]


def test_a_chunked_body_over_the_cap_is_refused_once_past_it() -> None:
    data = body_of(20 * CAP)
    done = exchange(gated_app(ApiKeys()), chunked(data), {})
    assert done.status == 413
    assert done.received == CAP // CHUNK + 1  # read until past the cap, not further
    assert done.response_headers["connection"] == "close"
    assert done.json()["error"]["code"] == "request_too_large"


def test_the_key_is_checked_before_the_body() -> None:
    keys = ApiKeys([ApiKey.create(KEY)])
    data = body_of(20 * CAP)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        done = exchange(gated_app(keys), chunked(data), headers)
        assert done.status == 401 and done.received == 0
        assert done.json()["error"]["code"] == "invalid_api_key"
    done = exchange(gated_app(keys), chunked(body_of(CAP)), {"authorization": f"Bearer {KEY}"})
    assert done.status == 200 and done.json()["tenant"] == ApiKey.create(KEY).tenant
    assert exchange(gated_app(keys), [], {}, path="/health").status == 200  # no key needed


def test_the_cap_must_be_a_positive_integer() -> None:
    for cap in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_request_bytes"):
            Gate(FastAPI(), api_keys=ApiKeys(), max_request_bytes=cap)  # type: ignore[arg-type]


# -- through actorline serve ----------------------------------------------------------------

#: the size of a hostile body
HOSTILE_BYTES = 20_000_000
#: how much the server may grow over six hostile bodies (it grew by 1.8 GB with one, before
#: the cap)
GROWTH_BOUND = 64 * 1024 * 1024


def rss(pid: int) -> int:
    """The resident memory of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hostile_chunks() -> Iterator[bytes]:
    """A 20 MB JSON completion body in chunks: valid JSON, one huge prompt."""
    yield b'{"model": "tiny", "prompt": "'
    piece = b"a" * 65536
    for _ in range(HOSTILE_BYTES // len(piece)):
        yield piece
    yield b'"}'


def post_until_answered(serve: ServeProcess, chunked_body: bool) -> tuple[int, dict[str, Any]]:
    """POST a hostile body to /v1/completions, declared (Content-Length) or chunked, sending
    until the server answers (as curl does); the status and JSON of the answer."""
    url = urllib.parse.urlsplit(serve.base_url)
    framing = (
        "Transfer-Encoding: chunked" if chunked_body else f"Content-Length: {HOSTILE_BYTES + 32}"
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json"
        f"\r\nAuthorization: Bearer {API_KEY}\r\n{framing}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=60) as connection:
        connection.sendall(head)
        answer = b""
        for chunk in hostile_chunks():
            data = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked_body else chunk
            readable, _, _ = select.select([connection], [], [], 0)
            if readable:
                break
            try:
                connection.sendall(data)
            except OSError:  # closed after its answer
                break
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            received = connection.recv(65536)
            if not received:
                break
            answer += received
    head_text, _, body = answer.partition(b"\r\n\r\n")
    status = int(head_text.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head_text.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body.strip().split(b"\r\n")[0])


@pytest.mark.slow
def test_hostile_bodies_get_413_and_leave_memory_and_streams_alone(
    openai_serve: ServeProcess, client: openai.OpenAI
) -> None:
    before = rss(openai_serve.process.pid)
    bystander: list[Any] = []

    def stream() -> None:
        bystander.extend(
            client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=64, temperature=0.0, stream=True,
                extra_body=IGNORE_EOS,
            )
        )  # fmt: skip

    reader = threading.Thread(target=stream)
    reader.start()
    for chunked_body in (False, True) * 3:
        status, answer = post_until_answered(openai_serve, chunked_body)
        assert status == 413, answer
        assert answer["error"]["code"] == "request_too_large"
        assert set(answer["error"]) == {"message", "type", "param", "code"}
    reader.join(120)
    growth = rss(openai_serve.process.pid) - before
    assert growth < GROWTH_BOUND, f"the server grew by {growth / 2**20:.0f} MiB"
    assert bystander[-1].choices[0].finish_reason == "length"
    assert sum(bool(chunk.choices[0].text) for chunk in bystander) > 1
