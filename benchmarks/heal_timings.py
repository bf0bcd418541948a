"""How long ``actorline serve`` takes to heal (docs/serving.md, "Metrics and health"): start
it, then for each signal SIGKILL or SIGSTOP its engine process and time, from the signal,
``/health`` turning 503, ``/health`` back to 200, and the first answer after it.

    python -m benchmarks.heal_timings --model smollm2-135m --rounds 3

Prints one line per round and the median per signal. Needs nothing but the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

READY = re.compile(r"^serving OpenAI-compatible API on (http://127\.0\.0\.1:\d+)/v1$")


def health(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/health", timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return 0


def answer(base: str) -> str:
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 8, "temperature": 0.0}
    request = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        text: str = json.loads(response.read())["choices"][0]["text"]
        return text


def engine_pid(parent: int) -> int:
    """The engine host among ``parent``'s children, or among the children of its zygote (a
    restarted host is forked by one: pipeline.runtime.zygote)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z" and "host_main" in command:
            if "--zygote" in command.split():
                try:
                    return engine_pid(int(entry.name))
                except RuntimeError:
                    continue  # a zygote with no host (yet): the host is elsewhere
            return int(entry.name)
    raise RuntimeError("no engine process")


def wait(condition: object, limit: float) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        if time.monotonic() - started > limit:
            raise TimeoutError("timed out")
        time.sleep(0.05)
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    args = parser.parse_args()
    command = [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main())",
               "serve", "--model", args.model, "--host", "127.0.0.1", "--http-port", "0",
               "--served-model-name", "m", "--heartbeat-timeout", str(args.heartbeat_timeout),
               "--restart-backoff", "0", "--restart-limit", str(2 * args.rounds + 1),
               "--log-level", "ERROR"]  # fmt: skip
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        match = READY.match(serve.stdout.readline().strip())
        if match is None:
            raise RuntimeError("actorline serve did not start")
        base = match.group(1)
        started = time.monotonic()
        expected = answer(base)
        first = time.monotonic() - started
        started = time.monotonic()
        answer(base)
        print(f"fresh serve: first answer {first:.2f} s, the next "
              f"{time.monotonic() - started:.2f} s", flush=True)  # fmt: skip
        times: dict[str, list[float]] = {"SIGKILL": [], "SIGSTOP": []}
        for round_ in range(args.rounds):
            for name in times:
                pid = engine_pid(serve.pid)
                signalled = time.monotonic()
                os.kill(pid, getattr(signal, name))
                down = wait(lambda: health(base) == 503, 60) - signalled
                up = wait(lambda: health(base) == 200, 300) - signalled
                if answer(base) != expected:
                    raise RuntimeError("a different answer after the restart")
                answered = time.monotonic() - signalled
                started = time.monotonic()
                answer(base)
                again = time.monotonic() - started
                times[name].append(up)
                print(f"round {round_ + 1} {name}: 503 after {down:.2f} s, 200 after {up:.2f} s, "
                      f"answered after {answered:.2f} s (the next answer {again:.2f} s)",
                      flush=True)  # fmt: skip
        for name, values in times.items():
            print(f"{name}: median {statistics.median(values):.2f} s from the signal to healthy")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
