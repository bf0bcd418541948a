"""Hostile request bodies against the HTTP front end: what the body cap buys.

For each server, ``actorline serve --http-port 0`` in a subprocess, a bystander streams a
long completion while hostile bodies arrive (``--bodies`` of ``--body-mb`` MB, JSON with a
prompt of token ids, alternately with a ``Content-Length`` and chunked). The peer is the same
server without a cap (``--max-request-bytes`` above the body: how the server was before the
cap); ours keeps the default cap. Reported per server: the answers' statuses, how long the
server took to answer them all, how much its peak resident memory grew, the bystander's
longest wait between two chunks overlapping that time (a stall the bodies caused; the wait
can also be the model's own step on a loaded machine), and whether the engine still serves
afterwards (``/health``).

    python -m benchmarks.http_body [--quick] [--json] [--model M]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from pipeline.bench.process import peak_rss_bytes
from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main
from pipeline.server.http.defaults import DEFAULT_MAX_REQUEST_BYTES

__all__ = [
    "HttpBodyConfig",
    "HttpBodyResult",
    "ServerRun",
    "add_arguments",
    "format_http_body",
    "main",
    "run_from_args",
    "run_http_body",
]

_READY = "serving OpenAI-compatible API on "
_SEND_CHUNK = 65536
#: seconds to wait for the server to start, and for any one answer
_TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True, slots=True)
class HttpBodyConfig:
    """``bodies`` hostile bodies of ``body_mb`` MB each, while a bystander streams
    ``bystander_tokens`` tokens, against ``model``."""

    model: str = "smollm2-135m"
    bodies: int = 6
    body_mb: float = 20.0
    bystander_tokens: int = 256

    def __post_init__(self) -> None:
        if self.bodies < 1 or not self.body_mb > 0 or self.bystander_tokens < 1:
            raise ValueError("bodies, body_mb and bystander_tokens must be positive")


@dataclasses.dataclass(frozen=True, slots=True)
class ServerRun:
    """One server under the bodies: its cap, the HTTP statuses of the answers and the seconds
    from the first body to the last answer, peak memory growth (MiB), the bystander's longest
    gap between chunks overlapping those seconds (s) and whether it finished, and whether
    ``/health`` answered 200 afterwards."""

    name: str
    max_request_bytes: int
    statuses: tuple[int, ...]
    answer_seconds: float
    peak_growth_mib: float
    bystander_longest_gap_s: float
    bystander_finished: bool
    engine_alive: bool


@dataclasses.dataclass(frozen=True, slots=True)
class HttpBodyResult:
    config: HttpBodyConfig
    runs: tuple[ServerRun, ...]


def _body(model: str, size: int) -> bytes:
    ids = [12345] * max(1, size // 7)
    return json.dumps({"model": model, "prompt": ids, "max_tokens": 1}).encode()


def _post(host: str, port: int, body: bytes, chunked: bool) -> int:
    """POST ``body`` to /v1/completions, sending until the server answers (as curl does);
    the answer's status (0: the connection closed without one)."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{framing}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=_TIMEOUT) as connection:
        connection.sendall(head)
        try:
            for start in range(0, len(body), _SEND_CHUNK):
                if select.select([connection], [], [], 0)[0]:
                    break  # answered early
                part = body[start : start + _SEND_CHUNK]
                connection.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            else:
                if chunked:
                    connection.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # closed after its answer
        answer = b""
        while b"\r\n" not in answer:
            received = connection.recv(65536)
            if not received:
                break
            answer += received
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=60) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _run_server(config: HttpBodyConfig, name: str, cap: int, body: bytes) -> ServerRun:
    command = [sys.executable, "-m", "pipeline.cli", "serve", "--model", config.model,
               "--http-port", "0", "--max-request-bytes", str(cap)]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if not line.startswith(_READY):
            raise RuntimeError(f"the server did not start: {line!r}")
        url = line.removeprefix(_READY)
        base = url.removesuffix("/v1")
        address = urllib.parse.urlsplit(base)
        host, port = address.hostname or "127.0.0.1", address.port or 80
        before = peak_rss_bytes(server.pid) or 0
        chunks: list[float] = []
        finished: list[bool] = []
        started = threading.Event()

        stream = {
            "model": config.model,
            "prompt": "Once upon a time",
            "max_tokens": config.bystander_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }

        def bystander() -> None:
            request = urllib.request.Request(
                url + "/completions",
                data=json.dumps(stream).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=_TIMEOUT) as response:
                    for raw in response:
                        if not raw.strip():
                            continue
                        chunks.append(time.monotonic())
                        started.set()
                        if raw.strip() == b"data: [DONE]":
                            finished.append(True)
            except (urllib.error.URLError, OSError):
                pass
            started.set()

        reader = threading.Thread(target=bystander, daemon=True)
        reader.start()
        started.wait(_TIMEOUT)
        first = time.monotonic()
        statuses = tuple(_post(host, port, body, chunked=bool(i % 2)) for i in range(config.bodies))
        last = time.monotonic()
        reader.join(_TIMEOUT)
        growth = ((peak_rss_bytes(server.pid) or 0) - before) / 2**20
        overlapping = [
            later - earlier
            for earlier, later in itertools.pairwise(chunks)
            if later > first and earlier < last
        ]
        return ServerRun(
            name, cap, statuses, last - first, growth, max(overlapping, default=float("nan")),
            bool(finished), _healthy(base),
        )  # fmt: skip
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run_http_body(config: HttpBodyConfig) -> HttpBodyResult:
    """Run the bodies against the uncapped peer, then against the default cap."""
    size = int(config.body_mb * 1_000_000)
    body = _body(config.model, size)
    runs = (
        _run_server(config, "uncapped (peer)", max(len(body) + 1, DEFAULT_MAX_REQUEST_BYTES), body),
        _run_server(config, "capped (default)", DEFAULT_MAX_REQUEST_BYTES, body),
    )
    return HttpBodyResult(config, runs)


def format_http_body(result: HttpBodyResult) -> str:
    """The readable report, with the peer / ours ratios."""
    config = result.config
    rows: list[list[object]] = [
        [
            run.name,
            run.max_request_bytes,
            " ".join(map(str, run.statuses)),
            run.answer_seconds,
            run.peak_growth_mib,
            run.bystander_longest_gap_s,
            "yes" if run.bystander_finished else "no",
            "yes" if run.engine_alive else "no",
        ]
        for run in result.runs
    ]
    peer, ours = result.runs
    ratio = [
        "peer / capped",
        "",
        "",
        f"{peer.answer_seconds / ours.answer_seconds:.0f}x",
        f"{peer.peak_growth_mib / max(ours.peak_growth_mib, 1.0):.0f}x (vs >= 1 MiB)",
        f"{peer.bystander_longest_gap_s / ours.bystander_longest_gap_s:.1f}x",
        "",
        "",
    ]
    return format_table(
        ["server", "cap bytes", "statuses", "answered in s", "peak growth MiB",
         "longest gap s", "stream done", "engine alive"],
        [*rows, ratio],
        title=f"{config.bodies} bodies of {config.body_mb:g} MB of token ids ({config.model}), "
        "a stream running meanwhile",
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--bodies", type=int, default=6, help="hostile bodies to send (6)")
    parser.add_argument("--body-mb", type=float, default=20.0, help="MB per body (20)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    config = HttpBodyConfig(model=args.model, bodies=args.bodies, body_mb=args.body_mb)
    if args.quick:
        config = dataclasses.replace(config, bodies=2, body_mb=2.0, bystander_tokens=32)
    result = run_http_body(config)
    print_result(result, format_http_body(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.http_body``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
