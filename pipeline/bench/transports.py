"""Transport benchmark: actorline links against raw pyzmq and raw grpc.aio, on the same bytes.

For each transport (memory, zmq over ipc, grpc), message size (100 B, 10 KB, 1 MB) and
compression (off, zstd) it measures

- throughput: one sender task streams N messages to one receiver task in this process;
- round trip: a ping-pong over two links (p50 and p99 latency);

and, in the same run, the raw baseline moving exactly the frames the link would put on the
wire: PUSH/PULL sockets of ``zmq.asyncio`` for zmq, one ``grpc.aio`` bidirectional stream
per direction for grpc. For grpc there are two raw baselines: one gRPC write per message,
and one that batches as the link does (the same length-prefixed link messages packed into
writes of up to the link's batch size, split again by the receiving handler), since the
link's batching, not its code, is most of what it gains over one write per message. Link and
raw runs alternate; the best of ``--repeats`` runs of each is reported, with the link/raw
ratios. Targets: zmq and grpc links >= 0.8x raw messages/s at 10 KB (for grpc against the
one-write-per-message baseline; the ratio to the batched one is printed beside it); memory
links >= 200,000 messages/s.

    actorline bench transports            # full run (several minutes on 2 cores)
    actorline bench transports --quick    # a short run
    actorline bench transports --json     # machine-readable results
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import grpc.aio
import numpy as np
import zmq
import zmq.asyncio

from transports.base import LinkOptions, Receiver, Sender, Transport
from transports.compression import Compression
from transports.errors import EndOfStream
from transports.framing import FrameCodec
from transports.grpc import (
    BATCH_ALONE_BYTES,
    BATCH_BYTES,
    MAX_BATCH,
    GrpcTransport,
    join_batch,
    join_frames,
    split_batch,
)
from transports.memory import MemoryTransport
from transports.tasks import TaskSet
from transports.testing import KitArrays, KitPayload
from transports.zmq import ZmqTransport

TRANSPORTS: dict[str, type[Transport]] = {
    "memory": MemoryTransport,
    "zmq": ZmqTransport,
    "grpc": GrpcTransport,
}
SIZES = (100, 10_000, 1_000_000)
#: throughput messages per run, by transport and size (about half a second each)
THROUGHPUT_COUNTS = {
    "memory": {100: 200_000, 10_000: 200_000, 1_000_000: 200_000},
    "zmq": {100: 40_000, 10_000: 20_000, 1_000_000: 400},
    "grpc": {100: 6_000, 10_000: 4_000, 1_000_000: 150},
}
ROUND_TRIPS = {100: 2_000, 10_000: 2_000, 1_000_000: 100}
QUICK_DIVISOR = 5
TARGET_RATIO = 0.8
TARGET_RATIO_SIZE = 10_000
MEMORY_TARGET = 200_000
CAPACITY = 1024
RAW_SERVICE = "bench.Raw"
RAW_METHOD = "Stream"


@dataclasses.dataclass
class Result:
    transport: str
    size: int
    payload: str
    zstd: bool
    link_msgs_per_s: float
    raw_msgs_per_s: float | None
    link_cpu_us: float
    raw_cpu_us: float | None
    link_p50_us: float
    link_p99_us: float
    raw_p50_us: float | None
    raw_p99_us: float | None
    #: the raw grpc.aio baseline that batches as the link does (grpc only)
    raw_batched_msgs_per_s: float | None = None
    raw_batched_cpu_us: float | None = None

    @property
    def ratio(self) -> float | None:
        """Link over raw messages/s."""
        return self.link_msgs_per_s / self.raw_msgs_per_s if self.raw_msgs_per_s else None

    @property
    def batched_ratio(self) -> float | None:
        """Link over the batched raw baseline's messages/s (grpc only)."""
        batched = self.raw_batched_msgs_per_s
        return self.link_msgs_per_s / batched if batched else None

    @property
    def cpu_ratio(self) -> float | None:
        """Raw over link CPU time per message (1.0: the link costs no more CPU than raw)."""
        return self.raw_cpu_us / self.link_cpu_us if self.raw_cpu_us else None

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "ratio": self.ratio,
            "batched_ratio": self.batched_ratio,
            "cpu_ratio": self.cpu_ratio,
        }


#: "bytes": a message with a bytes field (inline, copied by msgpack); "array": a message
#: carrying a numpy array (out of band, sent without copying)
PAYLOADS = ("bytes", "array")
ARRAY_SIZES = (1_000_000,)


def make_message(size: int, payload: str) -> object:
    data = make_payload(size)
    if payload == "array":
        return KitArrays("bench", (np.frombuffer(data, dtype=np.uint8),), {})
    return KitPayload(0, data)


def make_payload(size: int) -> bytes:
    """Moderately compressible bytes (a small alphabet), like token ids or text."""
    rng = np.random.default_rng(size)
    return rng.integers(0, 16, size=size, dtype=np.uint8).tobytes()


def link_options(zstd: bool) -> LinkOptions:
    return LinkOptions(compression=Compression() if zstd else None, capacity=CAPACITY)


class Clock:
    """Wall and process CPU time (all threads, so gRPC's and ZMQ's own threads count)."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def rate(self, count: int) -> Throughput:
        """(messages/s, CPU microseconds per message) since the clock started."""
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        return count / wall, cpu / count * 1e6


Throughput = tuple[float, float]


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return p50 * 1e6, p99 * 1e6


# -- actorline links -----------------------------------------------------------------------------


async def link_throughput(
    name: str, options: LinkOptions, message: object, count: int
) -> Throughput:
    async with TRANSPORTS[name](options) as transport, TaskSet("bench:throughput") as tasks:
        receiver = await transport.listen()
        sender = await transport.connect(receiver.address, name="bench")

        async def produce() -> None:
            for _ in range(count):
                await sender.send(message)
            await sender.aclose()

        clock = Clock()
        producer = tasks.spawn(produce())
        received = 0
        try:
            while True:
                await receiver.receive()
                received += 1
        except EndOfStream:
            pass
        rate = clock.rate(count)
        await producer
        await receiver.aclose()
    assert received == count, f"{received} of {count} messages arrived"
    return rate


async def _echo(receiver: Receiver, sender: Sender) -> None:
    async for item in receiver:
        await sender.send(item)


async def link_round_trip(
    name: str, options: LinkOptions, message: object, rounds: int
) -> list[float]:
    async with TRANSPORTS[name](options) as transport, TaskSet("bench:round-trip") as tasks:
        there = await transport.listen()
        back = await transport.listen()
        to_there = await transport.connect(there.address, name="ping")
        to_back = await transport.connect(back.address, name="pong")
        echo = tasks.spawn(_echo(there, to_back))
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            await to_there.send(message)
            await back.receive()
            samples.append(time.perf_counter() - started)
        await to_there.aclose()
        await echo
        await to_back.aclose()
        for receiver in (there, back):
            await receiver.aclose()
    return samples


# -- raw pyzmq -----------------------------------------------------------------------------------


class RawZmq:
    """PUSH/PULL pairs of zmq.asyncio over ipc, with the link's high-water marks."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.directory = tempfile.mkdtemp(prefix="bench-zmq-")
        self.sockets: list[zmq.asyncio.Socket] = []

    def pair(self, index: int) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        address = f"ipc://{self.directory}/{index}"
        pull = self.context.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, CAPACITY)
        pull.bind(address)
        push = self.context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, CAPACITY)
        push.connect(address)
        self.sockets += [push, pull]
        return push, pull

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()
        shutil.rmtree(self.directory, ignore_errors=True)


async def raw_zmq_throughput(frames: list[Any], count: int) -> Throughput:
    raw = RawZmq()
    push, pull = raw.pair(0)

    async def produce() -> None:
        for _ in range(count):
            await push.send_multipart(frames, copy=False)

    async with TaskSet("bench:raw-zmq") as tasks:
        clock = Clock()
        producer = tasks.spawn(produce())
        for _ in range(count):
            await pull.recv_multipart(copy=False)
        rate = clock.rate(count)
        await producer
    raw.close()
    return rate


async def raw_zmq_round_trip(frames: list[Any], rounds: int) -> list[float]:
    raw = RawZmq()
    push_there, pull_there = raw.pair(0)
    push_back, pull_back = raw.pair(1)

    async def echo() -> None:
        for _ in range(rounds):
            await push_back.send_multipart(await pull_there.recv_multipart(copy=False), copy=False)

    async with TaskSet("bench:raw-zmq") as tasks:
        echoing = tasks.spawn(echo())
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            await push_there.send_multipart(frames, copy=False)
            await pull_back.recv_multipart(copy=False)
            samples.append(time.perf_counter() - started)
        await echoing
    raw.close()
    return samples


# -- raw grpc.aio --------------------------------------------------------------------------------


class RawGrpc:
    """A grpc.aio server whose generic bidi method hands each request to a callback, and
    channels with one bidi call each; bytes in and out, the link's message size limits."""

    def __init__(self, on_request: Callable[[bytes], Awaitable[None]]) -> None:
        limit = 1 << 30
        self.sizes = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]
        self.on_request = on_request
        self.server: Any = None
        self.channels: list[Any] = []
        self.port = 0

    async def start(self) -> None:
        self.server = grpc.aio.server(options=self.sizes)
        handler = grpc.stream_stream_rpc_method_handler(self.serve)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(RAW_SERVICE, {RAW_METHOD: handler}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def serve(self, requests: Any, context: Any) -> None:
        async for request in requests:
            await self.on_request(request)

    def call(self) -> Any:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{self.port}",
            options=[*self.sizes, ("grpc.use_local_subchannel_pool", 1)],
        )
        self.channels.append(channel)
        return channel.stream_stream(f"/{RAW_SERVICE}/{RAW_METHOD}")()

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        # NOTE: with grace, as the link's transport stops: grace=None cancels the calls and
        # gRPC core logs the GOAWAY it sends at INFO, on stderr, amid the benchmark's output.
        await self.server.stop(grace=1.0)


async def _raw_grpc_stream_rate(
    first: bytes, write: bytes, writes: int, count_of: Callable[[bytes], int], count: int
) -> Throughput:
    """Raw grpc.aio: send ``first`` (to connect, untimed, as the link's connect() does), then
    ``write`` ``writes`` times; the rate is per message, ``count`` of them, counted on the
    receiving side by ``count_of`` each request."""
    done = asyncio.get_running_loop().create_future()
    received = 0

    async def count_messages(request: bytes) -> None:
        nonlocal received
        received += count_of(request)
        if received == count + 1 and not done.done():  # + the one sent to connect
            done.set_result(None)

    raw = RawGrpc(count_messages)
    await raw.start()
    call = raw.call()
    await call.write(first)
    clock = Clock()
    for _ in range(writes):
        await call.write(write)
    await done
    rate = clock.rate(count)
    await call.done_writing()
    await call.code()  # the handler has seen the end: closing now cancels nothing
    await raw.close()
    return rate


async def raw_grpc_throughput(data: bytes, count: int) -> Throughput:
    return await _raw_grpc_stream_rate(data, data, count, lambda request: 1, count)


def messages_per_write(size: int) -> int:
    """How many link messages of ``size`` bytes one gRPC write of the link carries when its
    sender is always ahead, by the link's rule (see ``transports.grpc._take_batch``): messages
    of :data:`BATCH_ALONE_BYTES` or more alone, else up to :data:`BATCH_BYTES` (the last one
    may cross it), :data:`MAX_BATCH` messages, and the link's ``capacity`` (a sender holds at
    most that many unwritten)."""
    if size >= BATCH_ALONE_BYTES:
        return 1
    return min(MAX_BATCH, CAPACITY, max(1, -(-BATCH_BYTES // size)))


#: the batched baseline sends at least this many writes (small messages pack a thousand to a
#: write: the link's message count would take a handful of writes, too short to time)
BATCHED_MIN_WRITES = 200


async def raw_grpc_batched_throughput(data: bytes, count: int) -> Throughput:
    """Raw grpc.aio batching as the link does: each write packs the next messages (the same
    bytes the link sends) with :func:`join_batch`; the handler splits each request again.
    Sends at least :data:`BATCHED_MIN_WRITES` writes (more messages than ``count`` when
    they are small); the rate is per message."""
    per_write = messages_per_write(len(data))
    writes = max(-(-count // per_write), BATCHED_MIN_WRITES)
    write = join_batch([data] * per_write) if per_write > 1 else data
    return await _raw_grpc_stream_rate(
        data, write, writes, lambda request: len(split_batch(request)), writes * per_write
    )


async def raw_grpc_round_trip(data: bytes, rounds: int) -> list[float]:
    replies: asyncio.Queue[bytes] = asyncio.Queue()
    back_call: Any = None

    async def forward(request: bytes) -> None:
        if request == b"back":  # the return stream introducing itself
            return
        await back_call.write(request)

    there = RawGrpc(forward)
    back = RawGrpc(replies.put)
    await there.start()
    await back.start()
    back_call = back.call()
    await back_call.write(b"back")
    there_call = there.call()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        await there_call.write(data)
        await replies.get()
        samples.append(time.perf_counter() - started)
    for call in (there_call, back_call):
        await call.done_writing()
    for call in (there_call, back_call):
        await call.code()
    await there.close()
    await back.close()
    return samples


# -- the run -------------------------------------------------------------------------------------


async def measure(
    name: str, size: int, payload: str, zstd: bool, repeats: int, divisor: int
) -> Result:
    options = link_options(zstd)
    message = make_message(size, payload)
    frames = FrameCodec(compression=options.compression).encode(message)
    count = max(THROUGHPUT_COUNTS[name][size] // divisor, 10)
    rounds = max(ROUND_TRIPS[size] // divisor, 10)
    link_rates: list[Throughput] = []
    raw_rates: list[Throughput] = []
    batched_rates: list[Throughput] = []
    link_latency: list[tuple[float, float]] = []
    raw_latency: list[tuple[float, float]] = []
    for _ in range(repeats):
        gc.collect()
        link_rates.append(await link_throughput(name, options, message, count))
        link_latency.append(percentiles(await link_round_trip(name, options, message, rounds)))
        gc.collect()
        if name == "zmq":
            raw_rates.append(await raw_zmq_throughput(frames, count))
            raw_latency.append(percentiles(await raw_zmq_round_trip(frames, rounds)))
        elif name == "grpc":
            data = join_frames(frames)
            raw_rates.append(await raw_grpc_throughput(data, count))
            gc.collect()
            batched_rates.append(await raw_grpc_batched_throughput(data, count))
            raw_latency.append(percentiles(await raw_grpc_round_trip(data, rounds)))
    best_link = min(link_latency)
    best_raw = min(raw_latency) if raw_latency else (None, None)
    return Result(
        transport=name,
        size=size,
        payload=payload,
        zstd=zstd,
        link_msgs_per_s=max(rate for rate, _ in link_rates),
        raw_msgs_per_s=max(rate for rate, _ in raw_rates) if raw_rates else None,
        link_cpu_us=min(cpu for _, cpu in link_rates),
        raw_cpu_us=min(cpu for _, cpu in raw_rates) if raw_rates else None,
        link_p50_us=best_link[0],
        link_p99_us=best_link[1],
        raw_p50_us=best_raw[0],
        raw_p99_us=best_raw[1],
        raw_batched_msgs_per_s=max(r for r, _ in batched_rates) if batched_rates else None,
        raw_batched_cpu_us=min(cpu for _, cpu in batched_rates) if batched_rates else None,
    )


def verdict(result: Result) -> str:
    if result.payload != "bytes":
        return ""
    if result.transport == "memory":
        return "ok" if result.link_msgs_per_s >= MEMORY_TARGET else "MISS"
    if result.size != TARGET_RATIO_SIZE or result.zstd or result.ratio is None:
        return ""
    text = "ok" if result.ratio >= TARGET_RATIO else "MISS"
    if result.batched_ratio is not None:
        text += " (batched: " + ("ok" if result.batched_ratio >= TARGET_RATIO else "MISS") + ")"
    return text


def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def cpu_figures(result: Result) -> str:
    figures = [result.link_cpu_us, result.raw_cpu_us]
    if result.raw_batched_cpu_us is not None:
        figures.append(result.raw_batched_cpu_us)
    return "/".join(number(figure, 1) for figure in figures)


def print_table(results: list[Result]) -> None:
    header = (
        f"{'transport':<9} {'size':>9} {'payload':>7} {'zstd':>4} "
        f"{'link msg/s':>11} {'raw msg/s':>11} {'ratio':>5} "
        f"{'batched raw':>11} {'ratio':>5} {'cpu us/msg link/raw/batched':>28} {'cpu':>5} "
        f"{'p50/p99 us link':>16} {'p50/p99 us raw':>16}  target"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.transport:<9} {r.size:>9,} {r.payload:>7} {'on' if r.zstd else 'off':>4} "
            f"{number(r.link_msgs_per_s):>11} {number(r.raw_msgs_per_s):>11} "
            f"{number(r.ratio, 2):>5} "
            f"{number(r.raw_batched_msgs_per_s):>11} {number(r.batched_ratio, 2):>5} "
            f"{cpu_figures(r):>28} "
            f"{number(r.cpu_ratio, 2):>5} "
            f"{number(r.link_p50_us) + '/' + number(r.link_p99_us):>16} "
            f"{number(r.raw_p50_us) + '/' + number(r.raw_p99_us):>16}  {verdict(r)}"
        )
    print(
        "ratio: link/raw messages/s (best runs), first against raw with one write per "
        "message, then against raw batched as the link batches (grpc); cpu: CPU time per "
        "message (all threads; steadier than wall time on a shared machine), and raw/link "
        "of it for the one-write-per-message baseline"
    )


async def run(args: argparse.Namespace) -> list[Result]:
    divisor = QUICK_DIVISOR if args.quick else 1
    repeats = 1 if args.quick else args.repeats
    results = []
    for name in args.transports:
        scenarios = [(size, "bytes") for size in args.sizes]
        scenarios += [(size, "array") for size in ARRAY_SIZES if size in args.sizes]
        for size, payload in scenarios:
            for zstd in (False, True) if name != "memory" else (False,):
                result = await measure(name, size, payload, zstd, repeats, divisor)
                results.append(result)
                if not args.json:
                    print(
                        f"  measured {name} {size:,} B {payload} zstd={'on' if zstd else 'off'}",
                        file=sys.stderr,
                    )
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The transport benchmark's command-line options."""
    parser.add_argument("--quick", action="store_true", help="fewer messages, one repeat")
    parser.add_argument("--json", action="store_true", help="print JSON results only")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, best kept")
    parser.add_argument(
        "--transports",
        type=lambda s: s.split(","),
        default=list(TRANSPORTS),
        help="comma-separated subset of memory,zmq,grpc",
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=list(SIZES),
        help="comma-separated payload sizes in bytes (of 100,10000,1000000)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(f"\n{os.cpu_count()} CPUs; best of {1 if args.quick else args.repeats} runs")
        print_table(results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.bench.transports``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
