"""The HTTP load generator against a real server: a streamed completion from
``actorline serve --http-port`` on the tiny model (text events timed, usage read), and the
event parser on split, CRLF and [DONE] input."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.http_load import HttpLoadError, parse_events, stream_completion
from pipeline.bench.online_http import (
    SERVED_NAME,
    HttpOnlineConfig,
    actorline_server_command,
    vllm_server_command,
)


def test_events_are_parsed_across_reads() -> None:
    first = b'data: {"choices": [{"text": "a"}]}\r\n\r\ndata: {"choi'
    events, rest, done = parse_events(first)
    assert events == [{"choices": [{"text": "a"}]}] and not done
    events, rest, done = parse_events(rest + b'ces": []}\n\ndata: [DONE]\n\n')
    assert events == [{"choices": []}] and done and rest == b""
    with pytest.raises(HttpLoadError, match="not JSON"):
        parse_events(b"data: {oops\n\n")


def test_servers_get_the_same_limits(tmp_path: Path) -> None:
    config = HttpOnlineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=300)
    ours = actorline_server_command(config)
    theirs = vllm_server_command(tmp_path / "python", tmp_path / "model", 8123, config)
    limits = {
        "--max-num-seqs": "8",
        "--max-num-batched-tokens": "512",
        "--max-model-len": "300",
        "--served-model-name": SERVED_NAME,
    }
    for command in (ours, theirs):
        for flag, value in limits.items():
            assert command[command.index(flag) + 1] == value
    assert theirs[:3] == [str(tmp_path / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert theirs[theirs.index("--model") + 1] == str(tmp_path / "model")
    assert theirs[theirs.index("--port") + 1] == "8123"
    with pytest.raises(ValueError, match="unknown vLLM variants"):
        HttpOnlineConfig(vllm_variants=("fast",))


@pytest.mark.slow
def test_a_streamed_completion_is_timed_per_token(tiny_model_dir: Path) -> None:
    command = [sys.executable, "-m", "pipeline.cli", "serve", "--model", str(tiny_model_dir),
               "--http-port", "0", "--served-model-name", SERVED_NAME]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = next(line for line in server.stdout if "OpenAI-compatible" in line)
        port = int(line.strip().rsplit(":", 1)[1].split("/")[0])
        payload = {"model": SERVED_NAME, "prompt": [5, 17, 300], "max_tokens": 6,
                   "temperature": 0.0, "ignore_eos": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip
        trace = asyncio.run(stream_completion("127.0.0.1", port, payload, timeout=120))
        assert trace.usage_tokens == 6
        # one event per token, except that a token decoding to no text yet sends none
        assert 1 <= len(trace.token_times) <= 6
        assert trace.sent < trace.token_times[0] <= trace.token_times[-1] <= trace.finished
        with pytest.raises(HttpLoadError, match="status 4"):
            asyncio.run(stream_completion("127.0.0.1", port, {**payload, "max_tokens": -1}))
    finally:
        server.terminate()
        server.wait(timeout=60)
