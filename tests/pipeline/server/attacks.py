"""Issue 34's listener vectors as a client plays them against ``actorline serve``: idle
connections, trickling heads and bodies, a huge whole answer beside a stream; and the
bystanders that must still be answered. Used by ``test_listeners.py``, and runnable to measure
a server (before/after figures, docs/serving.md "Connection limits")::

    PYTHONPATH=$PWD python -m tests.pipeline.server.attacks listeners --model smollm2-135m
    PYTHONPATH=$PWD python -m tests.pipeline.server.attacks big-answer --model smollm2-135m

``listeners`` starts ``actorline serve`` under ``ulimit -n 1024`` and prints, per vector, the
bystanders' latencies, the server's RSS and how many lines its log grew by; ``big-answer``
serves a model with a probe of the event loop and prints the worst stall and a bystander
stream's worst gap while a big whole answer is made, without and with logprobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from pipeline.server import generation_pb2 as pb
from pipeline.server import generation_pb2_grpc as pb_grpc

__all__ = [
    "Trickle",
    "big_answer_body",
    "grpc_bystander",
    "http_bystander",
    "limit_descriptors",
    "open_idle",
    "rss_mib",
    "stream_gaps",
    "stream_until",
]


#: the head of a request whose body then trickles
TRICKLED_BODY_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n"
)


def split_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``http://host:port/...``."""
    hostport = url.split("://", 1)[1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def open_idle(host: str, port: int, count: int, timeout: float = 10.0) -> list[socket.socket]:
    """``count`` TCP connections to ``host:port`` that send nothing (those the kernel did not
    complete in ``timeout`` are left out)."""
    sockets = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
        except OSError:
            sock.close()
            continue
        sockets.append(sock)
    return sockets


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset waiting to be read)."""
    sock.setblocking(False)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def count_closed(sockets: list[socket.socket]) -> int:
    return sum(closed_by_peer(sock) for sock in sockets)


class Trickle:
    """``count`` connections to ``host:port`` that each send ``preamble`` at once, then one
    byte of ``payload`` every ``interval`` seconds (a thread does it) until the server closes
    them or :meth:`stop`; :attr:`closed_after` holds the seconds after the start at which each
    was seen closed."""

    def __init__(
        self,
        host: str,
        port: int,
        count: int,
        payload: bytes,
        interval: float = 1.0,
        preamble: bytes = b"",
    ) -> None:
        self.sockets = open_idle(host, port, count)
        if preamble:
            for sock in self.sockets:
                sock.sendall(preamble)
        self.payload = payload
        self.interval = interval
        self.closed_after: dict[int, float] = {}
        self._stop = threading.Event()
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set() and len(self.closed_after) < len(self.sockets):
            byte = self.payload[sent % len(self.payload) : sent % len(self.payload) + 1]
            for index, sock in enumerate(self.sockets):
                if index in self.closed_after:
                    continue
                if closed_by_peer(sock):
                    self.closed_after[index] = time.monotonic() - self.started
                    continue
                try:
                    sock.send(byte)
                except OSError:
                    self.closed_after[index] = time.monotonic() - self.started
            sent += 1
            self._stop.wait(self.interval)

    def wait_all_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.closed_after) == len(self.sockets):
                return True
            time.sleep(0.2)
        return len(self.closed_after) == len(self.sockets)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for sock in self.sockets:
            sock.close()


def http_bystander(
    url: str, model: str, api_key: str | None = None, timeout: float = 30.0
) -> float:
    """Seconds a small /v1/completions request takes to be answered (raises on failure)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url + "/completions", data=body, headers=headers)
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
    return time.monotonic() - began


def grpc_bystander(
    address: str,
    api_key: str | None = None,
    timeout: float = 30.0,
    channel: grpc.Channel | None = None,
    wait_for_ready: bool = False,
) -> float:
    """Seconds a small Generate call takes over ``channel`` (None: a new one to ``address``);
    ``wait_for_ready``: a connection refused is retried until ``timeout`` (raises on
    failure)."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        if channel is None:
            channel = stack.enter_context(grpc.insecure_channel(address))
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="Hello", sampling_params=pb.SamplingParams(max_tokens=4))
        responses = list(
            stub.Generate(
                request, timeout=timeout, metadata=metadata, wait_for_ready=wait_for_ready
            )
        )
    assert responses and responses[-1].finish_reason in (
        pb.FINISH_REASON_LENGTH,
        pb.FINISH_REASON_STOP,
    ), responses
    return time.monotonic() - began


def stream_gaps(url: str, model: str, max_tokens: int, timeout: float = 120.0) -> Iterator[float]:
    """The seconds between a streamed /v1/completions answer's chunks, as they come."""
    body = json.dumps(
        {"model": model, "prompt": "Once", "max_tokens": max_tokens, "stream": True,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    request = urllib.request.Request(
        url + "/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        last = time.monotonic()
        for line in response:
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            yield now - last
            last = now
            if line.startswith(b"data: [DONE]"):
                return


def stream_until(
    url: str, model: str, done: threading.Event, gaps: list[float], tokens: int = 32
) -> None:
    """Stream one short /v1/completions request after another until ``done``, adding each
    wait for a chunk (the first one's included) to ``gaps``."""
    while not done.is_set():
        gaps.extend(stream_gaps(url, model, tokens))


def big_answer_body(model: str, prompts: int, n: int, max_tokens: int, top: int) -> bytes:
    """A /v1/completions body asking for a large whole answer with ``top`` logprobs."""
    return json.dumps(
        {"model": model, "prompt": [f"Story {i}:" for i in range(prompts)], "n": n,
         "max_tokens": max_tokens, "logprobs": top, "ignore_eos": True}
    ).encode()  # fmt: skip


def post(url: str, body: bytes, timeout: float = 300.0) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``url``: the status and the response body."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def limit_descriptors(limit: int = 1024) -> None:
    """Lower this process's descriptor limit (soft and hard) to ``limit``, as ``ulimit -n``:
    a ``preexec_fn`` for the server under attack."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- the measurement ------------------------------------------------------------------------


#: an HTTP server over a model (argv 1; argv 2 "null": the null model, random tokens at
#: once through the real frontend, so answers are real JSON of real size), on a free port;
#: prints its URL; stops cleanly on SIGINT. With argv 3 "probe", a task of its loop writes
#: ``STALL seconds`` to stderr whenever the loop went over 0.1 s without a turn.
MODEL_SERVER = """
import asyncio, signal, sys, time
from pipeline.engine.async_engine import AsyncEngine
from pipeline.server.http.server import HttpServer

async def probe():
    while True:
        began = time.perf_counter()
        await asyncio.sleep(0.005)
        late = time.perf_counter() - began - 0.005
        if late > 0.1:
            print(f"STALL {late:.3f}", file=sys.stderr, flush=True)

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    null = sys.argv[2:3] == ["null"]
    async with AsyncEngine(sys.argv[1], null_model=null, num_blocks=4096) as engine:
        server = HttpServer(engine, model_name="m")
        print(await server.start("127.0.0.1", 0), flush=True)
        if sys.argv[3:4] == ["probe"]:
            asyncio.ensure_future(probe())
        try:
            await stop.wait()
        finally:
            await server.stop()

asyncio.run(main())
"""


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Idle and trickling connections against ``actorline serve`` under ``ulimit -n 1024``:
    the bystanders' latencies, the server's RSS, how many lines its log grew by."""
    import sys

    from tests.pipeline.server.serving import ServeProcess

    log = Path(args.log)
    arguments = ["--model", args.model, "--host", "127.0.0.1", "--grpc-port", "0",
                 "--http-port", "0", "--served-model-name", "m", *args.extra]  # fmt: skip
    serve = ServeProcess(arguments, log, preexec_fn=limit_descriptors)
    results: dict[str, Any] = {}
    assert serve.http_url is not None and serve.address is not None
    host, port = split_url(serve.http_url)

    def lines() -> int:
        return len(log.read_text(errors="replace").splitlines())

    def bystanders() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, call in (
            ("http_s", lambda: http_bystander(serve.http_url or "", "m", timeout=10)),
            ("grpc_s", lambda: grpc_bystander(serve.address or "", timeout=10)),
        ):
            try:
                out[name] = round(call(), 3)
            except Exception as error:  # the figure is the failure
                out[name] = f"failed: {type(error).__name__}"
        return out

    try:
        results["baseline"] = {**bystanders(), "rss_mib": round(rss_mib(serve.process.pid))}
        before = lines()
        idle = open_idle(host, port, 1100, timeout=2)
        time.sleep(args.hold)
        results["idle_1100"] = {
            **bystanders(),
            "rss_mib": round(rss_mib(serve.process.pid)),
            "log_lines": lines() - before,
            "closed_by_server": count_closed(idle),
        }
        for sock in idle:
            sock.close()
        time.sleep(2)
        before = lines()
        head = Trickle(host, port, 300, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = Trickle(host, port, 300, b"[", preamble=TRICKLED_BODY_HEAD)
        time.sleep(args.hold)
        results["trickle_600"] = {
            **bystanders(),
            "rss_mib": round(rss_mib(serve.process.pid)),
            "log_lines": lines() - before,
            "closed_by_server": len(head.closed_after) + len(body.closed_after),
        }
        head.stop()
        body.stop()
    finally:
        serve.kill()
    results["log_tracebacks"] = log.read_text(errors="replace").count("Traceback")
    print(json.dumps(results, indent=1), file=sys.stdout)
    return results


def _measure_big_answer(args: argparse.Namespace) -> dict[str, Any]:
    """The server's worst event-loop stall (a probe task in the server process) and a
    bystander stream's worst gap while a big whole answer is made: without logprobs (the
    baseline), then with 20 top logprobs."""
    import subprocess
    import sys

    log = Path(args.log)
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", MODEL_SERVER, args.model, "real", "probe"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    results: dict[str, Any] = {}
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        body = json.loads(big_answer_body("m", args.prompts, args.n, args.max_tokens, 20))
        plain = {key: value for key, value in body.items() if key != "logprobs"}
        for name, request in (("without_logprobs", plain), ("with_logprobs", body)):
            gaps: list[float] = []
            done = threading.Event()
            mark = len(log.read_text().splitlines())
            bystander = threading.Thread(target=stream_until, args=(url, "m", done, gaps))
            bystander.start()
            began = time.monotonic()
            status, answer = post(url + "/completions", json.dumps(request).encode())
            took = time.monotonic() - began
            done.set()
            bystander.join()
            stalls = [
                float(line.split()[1])
                for line in log.read_text().splitlines()[mark:]
                if line.startswith("STALL ")
            ]
            results[name] = {
                "status": status,
                "answer_mib": round(len(answer) / 2**20, 2),
                "seconds": round(took, 1),
                "loop_worst_stall_s": round(max(stalls, default=0.0), 3),
                "bystander_worst_gap_s": round(max(gaps, default=0.0), 3),
                "server_rss_mib": round(rss_mib(process.pid)),
            }
    finally:
        process.kill()
        process.wait()
    results["log_tracebacks"] = log.read_text(errors="replace").count("Traceback")
    print(json.dumps(results, indent=1))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vector", choices=("listeners", "big-answer"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--log", default="/tmp/attacks-serve.log")
    parser.add_argument("--hold", type=float, default=15.0, help="seconds each attack runs")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("extra", nargs="*", help="more `actorline serve` arguments (after --)")
    args = parser.parse_args()
    if args.vector == "listeners":
        _measure(args)
    else:
        _measure_big_answer(args)


if __name__ == "__main__":
    main()
