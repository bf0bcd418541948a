"""examples/grpc_chat.py against a real Generation server: the script, fed two user turns and
/quit on stdin, prints exactly the replies the server's engine produced, sends the history
with the second turn, and exits 0; a reply is written piece by piece as it streams; a wrong
API key ends the chat with status 1."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_chat import REPLY_PREFIX, ChatSession

from pipeline.engine.async_engine import EngineObserver
from pipeline.server.client import Client
from stages.messages import ChatMessage, GenerateRequest, RequestOutput
from stages.params import SamplingParams
from tests.examples.running import RUN_TIMEOUT, example_command, example_env
from tests.pipeline.server.serving import ServedEngine, ServeProcess, serve_arguments

#: every test here talks to a server whose start takes several seconds
pytestmark = pytest.mark.slow

CHAT_KEY = "chat-key-0123"
MAX_TOKENS = 12


class Recorder(EngineObserver):
    """What the server's engine saw: every request sent and every finished output."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[GenerateRequest] = []
        self.finished: dict[str, RequestOutput] = {}

    def request_sent(self, request: GenerateRequest) -> None:
        with self.lock:
            self.requests.append(request)

    def output_received(self, output: RequestOutput) -> None:
        if output.finished:
            with self.lock:
                self.finished[output.request_id] = output

    def take(self) -> list[tuple[GenerateRequest, RequestOutput]]:
        """The requests since the last call, each with its final output."""
        with self.lock:
            taken = [(request, self.finished[request.request_id]) for request in self.requests]
            self.requests.clear()
            return taken


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[ServedEngine, Recorder]]:
    server = ServedEngine(tiny_model_dir, keys={CHAT_KEY: None}, num_blocks=128)
    recorder = Recorder()
    server.engine.add_observer(recorder)
    yield server, recorder
    server.close()


def chat(address: str, stdin: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    command = example_command(
        "grpc_chat", "--target", address, "--max-tokens", str(MAX_TOKENS),
        "--temperature", "0", *arguments,
    )  # fmt: skip
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=example_env(),
        timeout=RUN_TIMEOUT,
    )  # fmt: skip


def test_two_turns_then_quit(served: tuple[ServedEngine, Recorder]) -> None:
    server, recorder = served
    recorder.take()
    result = chat(server.address, "Hello there\n\nWhat next?\n/quit\nnever sent\n",
                  "--api-key", CHAT_KEY)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (first, first_reply), (second, second_reply) = recorder.take()
    assert first.messages == (ChatMessage("user", "Hello there"),)
    assert second.messages == (
        ChatMessage("user", "Hello there"),
        ChatMessage("assistant", first_reply.text),
        ChatMessage("user", "What next?"),
    )
    assert first_reply.text and second_reply.text
    expected = f"{REPLY_PREFIX}{first_reply.text}\n{REPLY_PREFIX}{second_reply.text}\n"
    assert result.stdout == expected


def test_a_reply_streams_in_pieces(served: tuple[ServedEngine, Recorder]) -> None:
    server, _ = served
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with Client(server.address, api_key=CHAT_KEY) as client:
        session = ChatSession(client, params, system="Be brief.")
        pieces: list[str] = []
        reply = session.send("Tell me a story", pieces.append)
        assert len(pieces) > 1
        assert "".join(pieces) == reply
        assert session.history == [
            {"role": "user", "content": "Tell me a story"},
            {"role": "assistant", "content": reply},
        ]
        assert session.messages("And then?")[0] == {"role": "system", "content": "Be brief."}
        session.reset()
        assert session.history == []


def test_a_wrong_api_key_ends_the_chat(served: tuple[ServedEngine, Recorder]) -> None:
    server, _ = served
    result = chat(server.address, "Hello\n", "--api-key", "not-a-key")
    assert result.returncode == 1
    assert "refused the API key" in result.stderr


def test_against_actorline_serve(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The chat against the real ``actorline serve`` process: each reply is what the server
    answers to the same conversation (greedy), the second turn carrying the first."""
    serve = ServeProcess(serve_arguments(tiny_model_dir, "--api-key", CHAT_KEY), tmp_path / "err")
    try:
        result = chat(serve.address, "Hello there\nWhat next?\n/quit\n", "--api-key", CHAT_KEY)
        assert result.returncode == 0, result.stderr[-3000:]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        history: list[dict[str, str]] = []
        expected = ""
        with Client(serve.address, api_key=CHAT_KEY) as client:
            for turn in ("Hello there", "What next?"):
                history.append({"role": "user", "content": turn})
                reply = "".join(chunk.delta for chunk in client.generate(history, params))
                history.append({"role": "assistant", "content": reply})
                expected += f"{REPLY_PREFIX}{reply}\n"
        assert result.stdout == expected
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(60) == 0
    finally:
        serve.kill()
