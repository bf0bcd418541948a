"""Where the time goes in a running pipeline: a per-stage table built from two statistics
snapshots (:meth:`RunningPipeline.statistics`) taken around a measured window, plus, per host,
the CPU time spent outside the stages (transport and runtime) and the traffic of every
cross-host link. Any benchmark can print it with ``--profile``::

    before = await take_snapshot(engine.running)
    ...  # the measured work
    after = await take_snapshot(engine.running)
    print(format_profile(build_profile(before, after, wall_seconds, tokens)))
"""

from __future__ import annotations

import dataclasses
import os
import time

from pipeline.bench.process import cpu_seconds
from pipeline.bench.report import format_table
from pipeline.runtime.control import HostStatistics
from pipeline.runtime.planning import plan_hosts
from pipeline.runtime.running import RunningPipeline

__all__ = [
    "STAGE_ORDER",
    "TRANSPORT",
    "HostRow",
    "LinkRow",
    "Profile",
    "ProfileSnapshot",
    "StageRow",
    "build_profile",
    "format_profile",
    "take_snapshot",
]

#: the default pipeline's stages in the order a request meets them (others follow, by name),
#: then the transport row of each host
STAGE_ORDER = ("tokenize", "admit", "schedule", "execute", "detokenize", "stop_check")
#: the stage-table row of a host's cross-host links (encoding and decoding messages)
TRANSPORT = "transport"
_MICRO = 1e6

FOOTNOTE = """\
Stage time: wall time spent in the stage's handlers (Host counters), including awaiting a full
downstream link and the model's worker thread (execute). Transport: encoding and decoding the
messages of the host's cross-host links (msgpack, zstd), measured in the links; the encoding
happens inside the sending stage's send and is moved from that stage's row to this one.
Shares are of the measured wall time; stages on different hosts (and the execute worker
thread) run in parallel, so shares may add past 100%.
CPU: the host process's CPU time (user+system, all threads, from /proc) in the window; CPU % wall
near 100 marks the process that limits throughput. "Outside" = CPU minus stage and transport
time: socket I/O and the links' pump tasks, the event loop and, on the main host, the API's
output dispatch and the callers' consumer tasks -- the cost not attributed to any row. Stage
time counts wall time, so on an oversubscribed machine (a stage descheduled mid-message)
"outside" is a lower bound and may read 0."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileSnapshot:
    """Statistics of every host and each host process's CPU seconds at one moment."""

    taken_at: float
    hosts: tuple[HostStatistics, ...]
    cpu_seconds: dict[str, float | None]
    link_names: dict[str, str]
    #: link id -> the stage whose output port sends on it (the caller: absent)
    link_sources: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class StageRow:
    """One stage over the window: messages handled and time spent handling them."""

    stage: str
    host: str
    handled: int
    seconds: float
    us_per_message: float
    share_of_wall: float
    us_per_token: float


@dataclasses.dataclass(frozen=True, slots=True)
class HostRow:
    """One host process over the window: its CPU time, the part spent in stages, the rest."""

    host: str
    pid: int
    cpu_seconds: float | None
    cpu_us_per_token: float | None
    cpu_share_of_wall: float | None
    stage_seconds: float
    outside_seconds: float | None
    outside_us_per_token: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class LinkRow:
    """One cross-host link over the window (counted at its sending end)."""

    link: str
    messages: int
    bytes: int
    bytes_per_message: float


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """Per-stage, per-host and per-link figures for ``tokens`` tokens in ``wall_seconds``."""

    wall_seconds: float
    tokens: int
    stages: tuple[StageRow, ...]
    hosts: tuple[HostRow, ...]
    links: tuple[LinkRow, ...]


async def take_snapshot(running: RunningPipeline) -> ProfileSnapshot:
    """Statistics of every host of ``running`` plus each host process's CPU time now."""
    hosts = tuple(await running.statistics())
    cpu = {host.host: cpu_seconds(host.pid) for host in hosts}
    sources: dict[str, str] = {}
    targets: dict[str, str] = {}
    source_stages: dict[str, str] = {}
    for plan in plan_hosts(running.pipeline, running.options).values():
        for link in plan.outbound:
            sources[link.link_id] = str(link.endpoint)
            source_stages[link.link_id] = link.endpoint.stage
        for link in plan.inbound:
            targets[link.link_id] = str(link.endpoint)
    names = {
        link_id: f"{sources.get(link_id, '?')} → {targets.get(link_id, '?')}"
        for link_id in sources.keys() | targets.keys()
    }
    return ProfileSnapshot(time.perf_counter(), hosts, cpu, names, source_stages)


def build_profile(
    before: ProfileSnapshot, after: ProfileSnapshot, wall_seconds: float, tokens: int
) -> Profile:
    """The differences between two snapshots of the same running pipeline.

    ``wall_seconds``: the measured window (shares are relative to it); ``tokens``: tokens
    delivered in it (for the per-token columns).

    Raises:
        ValueError: ``wall_seconds`` is not positive.
    """
    if not wall_seconds > 0:
        raise ValueError(f"wall_seconds must be > 0, got {wall_seconds}")
    per_token = _MICRO / tokens if tokens > 0 else float("nan")
    earlier = {(host.host, stage.name): stage for host in before.hosts for stage in host.stages}
    stages: list[StageRow] = []
    hosts: list[HostRow] = []
    links: list[LinkRow] = []
    sent_before = {
        link_id: stats for host in before.hosts for link_id, stats in host.links_out.items()
    }
    received_before = {
        link_id: stats for host in before.hosts for link_id, stats in host.links_in.items()
    }

    def row(name: str, host: str, handled: int, seconds: float) -> StageRow:
        return StageRow(
            stage=name,
            host=host,
            handled=handled,
            seconds=seconds,
            us_per_message=seconds * _MICRO / handled if handled else float("nan"),
            share_of_wall=seconds / wall_seconds,
            us_per_token=seconds * per_token,
        )

    for host in after.hosts:
        # what each stage spent encoding for its cross-host links counts as transport
        encoding: dict[str, float] = {}
        codec_seconds, codec_messages = 0.0, 0
        for link_id, stats in host.links_out.items():
            old = sent_before.get(link_id)
            seconds = stats.codec_seconds - (old.codec_seconds if old else 0.0)
            codec_seconds += seconds
            codec_messages += stats.messages_sent - (old.messages_sent if old else 0)
            source = after.link_sources.get(link_id)
            if source is not None:
                encoding[source] = encoding.get(source, 0.0) + seconds
        for link_id, stats in host.links_in.items():
            old = received_before.get(link_id)
            codec_seconds += stats.codec_seconds - (old.codec_seconds if old else 0.0)
            codec_messages += stats.messages_received - (old.messages_received if old else 0)
        host_stage_seconds = 0.0
        for stage in host.stages:
            previous = earlier.get((host.host, stage.name))
            handled = stage.handled - (previous.handled if previous else 0)
            seconds = stage.handle_seconds - (previous.handle_seconds if previous else 0.0)
            seconds = max(seconds - encoding.get(stage.name, 0.0), 0.0)
            host_stage_seconds += seconds
            stages.append(row(stage.name, host.host, handled, seconds))
        if host.links_out or host.links_in:
            stages.append(row(TRANSPORT, host.host, codec_messages, codec_seconds))
        attributed = host_stage_seconds + codec_seconds
        cpu_after, cpu_before = after.cpu_seconds.get(host.host), before.cpu_seconds.get(host.host)
        cpu = None if cpu_after is None or cpu_before is None else cpu_after - cpu_before
        outside = None if cpu is None else max(cpu - attributed, 0.0)
        hosts.append(
            HostRow(
                host=host.host,
                pid=host.pid,
                cpu_seconds=cpu,
                cpu_us_per_token=None if cpu is None else cpu * per_token,
                cpu_share_of_wall=None if cpu is None else cpu / wall_seconds,
                stage_seconds=attributed,
                outside_seconds=outside,
                outside_us_per_token=None if outside is None else outside * per_token,
            )
        )
        for link_id, stats in sorted(host.links_out.items()):
            old = sent_before.get(link_id)
            messages = stats.messages_sent - (old.messages_sent if old else 0)
            sent_bytes = stats.bytes_sent - (old.bytes_sent if old else 0)
            links.append(
                LinkRow(
                    link=after.link_names.get(link_id, link_id),
                    messages=messages,
                    bytes=sent_bytes,
                    bytes_per_message=sent_bytes / messages if messages else float("nan"),
                )
            )
    order = {name: index for index, name in enumerate(STAGE_ORDER)}
    stages.sort(
        key=lambda row: (row.stage == TRANSPORT, order.get(row.stage, len(order)), row.stage)
    )
    return Profile(wall_seconds, tokens, tuple(stages), tuple(hosts), tuple(links))


def format_profile(profile: Profile, *, title: str = "where the time goes") -> str:
    """The profile as tables with the footnote explaining the estimates."""
    stage_table = format_table(
        ["stage", "host", "handled", "total s", "µs/msg", "% wall", "µs/token"],
        [
            [
                row.stage,
                row.host,
                row.handled,
                row.seconds,
                row.us_per_message,
                100.0 * row.share_of_wall,
                row.us_per_token,
            ]
            for row in profile.stages
        ],
        title=f"{title}: {profile.tokens:,} tokens in {profile.wall_seconds:.2f} s "
        f"(pid {os.getpid()} is this process)",
    )
    host_table = format_table(
        [
            "host",
            "pid",
            "CPU s",
            "CPU % wall",
            "CPU µs/token",
            "stages+transport s",
            "outside s",
            "outside µs/token",
        ],
        [
            [
                row.host,
                str(row.pid),
                row.cpu_seconds,
                None if row.cpu_share_of_wall is None else 100.0 * row.cpu_share_of_wall,
                row.cpu_us_per_token,
                row.stage_seconds,
                row.outside_seconds,
                row.outside_us_per_token,
            ]
            for row in profile.hosts
        ],
    )
    parts = [stage_table, "", host_table]
    if profile.links:
        link_table = format_table(
            ["cross-host link", "messages", "bytes", "bytes/msg"],
            [[row.link, row.messages, row.bytes, row.bytes_per_message] for row in profile.links],
        )
        parts += ["", link_table]
    parts += ["", FOOTNOTE]
    return "\n".join(parts)
