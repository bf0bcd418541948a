"""Pipeline parallelism on a Ray cluster of two nodes, started as users start one
(docs/parallelism.md, "Pipeline parallelism on Ray"): ``ray start --head`` and a second
``ray start --address HEAD --resources '{"second": 1}'`` on this machine, each in a session
of its own (tests/ray_started.py), token authentication on as Ray turns it on for a user with
a token. A driver process of the cluster's user starts the tiny model at PP=2 with the engine
on Ray:

- PP=2 x TP=2 (each shard a tensor-parallel group of two ranks), spread by
  ``ray_placement_strategy="STRICT_SPREAD"`` and pinned by ``ray_shard_resources`` (the head's
  ``node:__internal_head__``, the second node's ``second``): each shard's ranks report its
  shard's node id, the shards different ones, each the node that holds its resource, and each
  actor process is in its node's session; the greedy tokens are one local engine's;
  ``ray.kill`` of the second shard's second rank fails every pending stream with
  EngineDeadError in bounded time;
- two replicas (DP=2 x PP=2) spread by ``ray_placement_strategy="STRICT_SPREAD"``: each
  replica's shards on both nodes, one engine's tokens; ``ray.kill`` of replica 1's second
  shard fails only replica 1's streams, in bounded time, and replica 0 serves on;
- disaggregated prefill and decode 1:1 pinned by ``ray_prefill_decode_resources`` (the
  prefill engine to the head, the decode engine to the second node): every prompt's blocks
  move between the nodes, the greedy tokens are one local engine's; ``ray.kill`` of the decode
  engine fails the streams it held, and the prefill engine serves on, whole; the same at
  TP=2 (each engine a tensor-parallel group of two ranks on its node, the blocks going
  straight from the prefill engine to the decode engine), one local TP=1 engine's tokens;
- once closed, no host actor is left on either node.

The options' plain data (bundles, strategies, refusals) needs no cluster.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import AsyncEngine
from pipeline.cli.llm import engine_options_from
from pipeline.cli.main import build_parser
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import start_options
from pipeline.runtime.ray_hosts import RayPlacementGroup, placement_shortfall
from tests.pipeline.engine.test_ray_engine import GREEDY, PROMPTS
from tests.pipeline.engine.test_ray_started import local_tokens, wait_no_host_actor
from tests.pipeline.runtime.test_ray_hosts import wait_until_gone
from tests.pipeline.runtime.test_running import run
from tests.pipeline.server.serving import REPOSITORY
from tests.ray_started import StartedRay, StartedRayNode, generate_token

__all__ = ["local_tokens"]  # the fixture, shared with test_ray_engine

#: seconds every stream may take to fail once a shard's actor is killed (Ray reports the death
#: at once; the rest is the engine's teardown on a loaded machine)
KILLED_SHARD_SECONDS = 15.0
#: the driver: start each engine of argv[3] (JSON: [options, host to kill]) on the cluster at
#: argv[2], report where its hosts run and its greedy tokens, then kill the host's actor with
#: a stream on every prompt and report how the streams of its replica ended, and how long
#: that took; with replicas, the survivors' and a new request's
DRIVER = """
import asyncio, json, os, sys, time
import ray
from pipeline import AsyncEngine, EngineDeadError, SamplingParams

model, address, engines, prompts, max_tokens = sys.argv[1:6]
prompts = json.loads(prompts)

async def one(engine, prompt, params, started=None):
    tokens = ()
    try:
        async for out in engine.generate(prompt, params, request_id=f"{prompt}@{time.monotonic()}"):
            tokens = out.token_ids
            if started is not None:
                started.set()
    except EngineDeadError as error:
        return type(error).__name__
    return list(tokens)

async def run(options, kill):
    engine = AsyncEngine(model, ray_address=address, num_blocks=128, heartbeat_timeout=60.0,
                         **options)
    await engine.start()
    report = {"hosts": {}}
    try:
        for host in sorted(h for h in engine.running.pids if h.startswith("engine")):
            actor = engine.running.ray_actor(host)
            pid, _, _ = await actor.where.remote()
            report["hosts"][host] = {"node": await actor.node_id.remote(),
                                     "session": os.getsid(pid)}
        # (the engine connected this process to Ray, and disconnects it as it closes)
        report["nodes"] = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        greedy = SamplingParams(max_tokens=int(max_tokens), temperature=0.0, ignore_eos=True)
        report["tokens"] = await asyncio.gather(*(one(engine, p, greedy) for p in prompts))
        if "prefill_decode" in options:
            router = engine.running.stage("router")
            report["moved"] = [router.transfers, router.blocks_moved, router.fallbacks]
            report["transfers"] = [[t.source, t.target, t.num_blocks, t.nbytes]
                                   for t in router.recent_transfers]
        long = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        started = {p: asyncio.Event() for p in prompts}
        tasks = {p: asyncio.create_task(one(engine, p, long, started[p])) for p in prompts}
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 120)
        replica = kill.partition("_pp")[0].partition("_")[2] or "0"
        victims = prompts
        if options.get("data_parallel_size", 1) > 1:
            routed = {rid.partition("@")[0]: r for rid, r in engine.running.stage("router").recent}
            victims = [p for p in prompts if routed[p] == replica]
        ray.kill(engine.running.ray_actor(kill))
        killed = time.monotonic()
        report["killed"] = [await asyncio.wait_for(tasks[p], 120) for p in victims]
        report["seconds"] = time.monotonic() - killed
        report["survivors_running"] = [not tasks[p].done() for p in prompts if p not in victims]
        report["failure"] = type(engine.failure).__name__ if engine.failure else None
        if engine.failure is None:
            report["after"] = await asyncio.gather(*(one(engine, p, greedy) for p in prompts))
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    finally:
        await engine.close()
    return report

async def main():
    print(json.dumps([await run(options, kill) for options, kill in json.loads(engines)]))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StartedRay, StartedRay]]:
    """The head (2 CPUs) and a second node (2 CPUs, resource ``second``) of one cluster,
    started by a user with a Ray token."""
    home = tmp_path_factory.mktemp("ray-two-nodes")
    generate_token(home)
    head = StartedRay(home)
    try:
        # as Ray's docs ask of every node of a cluster with token authentication
        node = StartedRayNode(head, num_cpus=2, resources={"second": 1}, RAY_AUTH_MODE="token")
        try:
            yield head, node
        finally:
            node.stop()
    finally:
        head.stop()


def drive(
    model_dir: Path,
    nodes: tuple[StartedRay, StartedRay],
    engines: list[list[Any]],
    prompts: list[str],
    *,
    timeout: float,
) -> tuple[list[dict[str, Any]], str, str]:
    """Run :data:`DRIVER` on the two-node cluster with ``engines`` (``[options, host to
    kill]`` each) over ``prompts``; its reports, the head's node id and the second node's.
    Checks that the driver succeeded, that each report sees the same two nodes (one of them
    with resource ``second``), that each actor's process runs under its node's ``ray start``
    (its session) and that, once the driver is gone, no host actor is left on either node."""
    head, node = nodes
    command = [sys.executable, "-c", DRIVER, str(model_dir), head.address, json.dumps(engines),
               json.dumps(prompts), str(GREEDY.max_tokens)]  # fmt: skip
    result = subprocess.run(
        command,
        env={**head.environment(), "PYTHONPATH": str(REPOSITORY)},
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reports: list[dict[str, Any]] = json.loads(result.stdout.strip().splitlines()[-1])
    seen = reports[0]["nodes"]
    second = [nid for nid, resources in seen.items() if "second" in resources]
    first = [nid for nid, resources in seen.items() if "second" not in resources]
    assert len(second) == len(first) == 1, seen
    sessions = {head.process.pid: first[0], node.process.pid: second[0]}
    for report in reports:
        assert report["nodes"] == seen
        for where in report["hosts"].values():
            assert sessions[where["session"]] == where["node"]
    wait_no_host_actor(head)
    wait_no_host_actor(node)
    return reports, first[0], second[0]


# -- plain data ----------------------------------------------------------------------------------


def test_shards_are_bundles_of_their_replicas_group_pinned_or_spread_as_asked() -> None:
    options = EngineOptions(
        pipeline_parallel_size=3,
        data_parallel_size=2,
        ray=True,
        ray_num_cpus=0.5,
        ray_shard_resources="node:10.0.0.5,,gpu_box",
    )
    started = start_options(options)
    assert sorted(started.hosts) == [
        "engine", "engine_1", "engine_1_pp1", "engine_1_pp2", "engine_pp1", "engine_pp2"
    ]  # fmt: skip
    assert started.hosts["engine_1_pp2"].placement_group == "replica1"
    assert started.hosts["engine_1_pp2"].bundle_index == 2
    for group in started.placement_groups.values():
        # PACK by default with shards: one node where they fit, else several
        assert group.strategy == "PACK"
        assert group.bundles == (
            {"CPU": 0.5, "node:10.0.0.5": 0.001},
            {"CPU": 0.5},
            {"CPU": 0.5, "gpu_box": 0.001},
        )
    # PP x TP: a shard and its tensor-parallel ranks are one bundle (so one node, whatever
    # the strategy), pinned as the shard
    both = EngineOptions(pipeline_parallel_size=2, tensor_parallel_size=2, ray=True,
                         ray_num_cpus=0.5, ray_placement_strategy="STRICT_SPREAD",
                         ray_shard_resources=",second")  # fmt: skip
    started = start_options(both)
    assert {name: host.bundle_index for name, host in started.hosts.items()} == {
        "engine": 0, "engine_tp1": 0, "engine_pp1": 1, "engine_pp1_tp1": 1
    }  # fmt: skip
    assert started.placement_groups["replica0"].bundles == (
        {"CPU": 1.0}, {"CPU": 1.0, "second": 0.001}
    )  # fmt: skip
    spread = EngineOptions(pipeline_parallel_size=2, ray=True, ray_placement_strategy="SPREAD")
    assert start_options(spread).placement_groups["replica0"].strategy == "SPREAD"
    # without shards the engine's hosts keep to one node, as before
    plain = EngineOptions(tensor_parallel_size=2, ray=True)
    assert start_options(plain).placement_groups["replica0"].strategy == "STRICT_PACK"
    # the flags reach the options
    args = build_parser().parse_args(
        ["serve", "--ray", "auto", "--pipeline-parallel-size", "2",
         "--ray-placement-strategy", "STRICT_SPREAD", "--ray-shard-resources", "a,b"]
    )  # fmt: skip
    parsed = EngineOptions.create(**engine_options_from(args))
    assert (parsed.ray_placement_strategy, parsed.ray_shard_resources) == ("STRICT_SPREAD", "a,b")


def test_prefill_and_decode_engines_are_pinned_by_role() -> None:
    options = EngineOptions(prefill_decode=(1, 2), ray=True, ray_num_cpus=0.5,
                            tensor_parallel_size=2,
                            ray_prefill_decode_resources="node:__internal_head__,")  # fmt: skip
    started = start_options(options)
    assert sorted(started.hosts) == [
        "engine", "engine_1", "engine_1_tp1", "engine_2", "engine_2_tp1", "engine_tp1"
    ]  # fmt: skip
    groups = started.placement_groups
    # every prefill and decode engine a placement group of its own, as a replica's
    assert groups["replica0"].bundles == ({"CPU": 1.0, "node:__internal_head__": 0.001},)
    assert groups["replica1"].bundles == groups["replica2"].bundles == ({"CPU": 1.0},)
    args = build_parser().parse_args(
        ["serve", "--ray", "auto", "--prefill-decode", "1:1",
         "--ray-prefill-decode-resources", "a,b"]
    )  # fmt: skip
    parsed = EngineOptions.create(**engine_options_from(args))
    assert parsed.ray_prefill_decode_resources == "a,b"
    pinned = start_options(parsed).placement_groups
    assert [group.bundles[0].get("b") for group in pinned.values()] == [None, 0.001]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (dict(ray_placement_strategy="SPREAD"), "ray_placement_strategy places the engine's hosts"),
        (dict(ray_shard_resources="a"), "ray_shard_resources places the engine's hosts"),
        (dict(ray=True, ray_placement_strategy="spread"), "must be one of"),
        (dict(ray=True, pipeline_parallel_size=2, ray_shard_resources="a"),
         "names 1 shards (a), but pipeline_parallel_size is 2"),
        (dict(ray=True, pipeline_parallel_size=2, ray_shard_resources=","), "names no resource"),
        (dict(ray=True, pipeline_parallel_size=2, ray_shard_resources="a b,c"), "whitespace"),
        (dict(ray_prefill_decode_resources="a,b", prefill_decode=(1, 1)),
         "ray_prefill_decode_resources places the engine's hosts"),
        (dict(ray=True, ray_prefill_decode_resources="a,b"),
         "pins prefill and decode engines, but there are none"),
        (dict(ray=True, prefill_decode=(1, 1), ray_prefill_decode_resources="a"),
         "names 1 resources (a): give two"),
    ],
)  # fmt: skip
def test_placement_options_are_refused_where_they_cannot_apply(
    options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        EngineOptions(**options)


def test_a_placement_the_live_nodes_cannot_hold_is_named() -> None:
    head = {"Alive": True, "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}}
    second = {"Alive": True, "Resources": {"CPU": 2.0, "second": 1.0}}
    gone = {"Alive": False, "Resources": {"CPU": 8.0, "third": 1.0}}
    nodes = [head, second, gone]
    pinned = RayPlacementGroup(({"CPU": 1.0, "second": 0.001}, {"CPU": 1.0}), "PACK")
    assert placement_shortfall(pinned, nodes) is None
    missing = RayPlacementGroup(({"CPU": 1.0, "third": 0.001},), "PACK")
    assert placement_shortfall(missing, nodes) == "no live node has resource 'third'"
    large = RayPlacementGroup(({"CPU": 4.0},), "PACK")
    assert placement_shortfall(large, nodes) == "no live node is large enough for bundle " + str(
        {"CPU": 4.0}
    )
    spread = RayPlacementGroup(({"CPU": 0.5},) * 3, "STRICT_SPREAD")
    assert placement_shortfall(spread, nodes) == (
        "STRICT_SPREAD needs 3 nodes, the cluster has 2 live"
    )
    assert placement_shortfall(RayPlacementGroup(({"CPU": 0.5},) * 3, "SPREAD"), nodes) is None


@pytest.mark.slow
def test_shards_pinned_to_a_resource_no_node_has_are_warned_of_and_time_out(
    tiny_model_dir: Path, ray_cluster: object, caplog: pytest.LogCaptureFixture
) -> None:
    engine = AsyncEngine(
        str(tiny_model_dir), pipeline_parallel_size=2, ray=True, ray_num_cpus=0.5,
        ray_shard_resources=",nowhere", start_timeout=8.0,
    )  # fmt: skip
    with pytest.raises(TimeoutError):
        run(engine.start, timeout=300)
    run(engine.close)
    assert "no live node has resource 'nowhere'; waiting for nodes to join" in caplog.text
    run(lambda: wait_until_gone(ray_cluster, "llm"))


# -- on two nodes started with `ray start` -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shards_on_two_nodes_give_one_engines_tokens_and_a_killed_one_fails_all(
    tiny_model_dir: Path,
    two_nodes: tuple[StartedRay, StartedRay],
    local_tokens: list[tuple[int, ...]],
) -> None:
    # PP x TP: two shards of two ranks each, STRICT_SPREAD over the two nodes (a shard and its
    # ranks are one bundle), the second shard pinned by its resource, one of its ranks killed;
    # two replicas spread, the survivor serving on
    pinned = dict(pipeline_parallel_size=2, tensor_parallel_size=2, ray_num_cpus=0.5,
                  ray_placement_strategy="STRICT_SPREAD",
                  ray_shard_resources="node:__internal_head__,second")  # fmt: skip
    spread = dict(pipeline_parallel_size=2, data_parallel_size=2, router="round-robin",
                  ray_num_cpus=0.5, ray_placement_strategy="STRICT_SPREAD")  # fmt: skip
    engines = [[pinned, "engine_pp1_tp1"], [spread, "engine_1_pp1"]]
    reports, first, second = drive(tiny_model_dir, two_nodes, engines, PROMPTS, timeout=800)
    for engine in reports:
        assert [tuple(tokens) for tokens in engine["tokens"]] == local_tokens
        assert engine["seconds"] < KILLED_SHARD_SECONDS
    one, two = reports
    # each shard's ranks on its shard's node, the shards on the two nodes
    assert {host: where["node"] for host, where in one["hosts"].items()} == {
        "engine": first, "engine_tp1": first, "engine_pp1": second, "engine_pp1_tp1": second,
    }  # fmt: skip
    assert one["killed"] == ["EngineDeadError"] * len(PROMPTS)
    assert one["failure"] == "EngineDeadError"
    assert sorted(two["hosts"]) == ["engine", "engine_1", "engine_1_pp1", "engine_pp1"]
    for replica in ("engine", "engine_1"):  # each replica's shards on both nodes
        assert two["hosts"][replica]["node"] != two["hosts"][f"{replica}_pp1"]["node"]
    # round-robin: replica 1 held half the streams; they failed, the others ran on
    assert two["killed"] == ["EngineDeadError"] * (len(PROMPTS) // 2)
    assert two["survivors_running"] == [True] * (len(PROMPTS) // 2)
    assert two["failure"] is None
    assert [tuple(tokens) for tokens in two["after"]] == local_tokens


#: prompts of several full blocks (16 tokens each) for the tiny model, so that KV moves
LONG_PROMPTS = [" ".join([prompt] * 12) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def long_local_tokens(tiny_model_dir: Path) -> list[tuple[int, ...]]:
    """LONG_PROMPTS' greedy tokens from the tiny model on one local engine process."""
    from tests.pipeline.engine.test_ray_engine import GREEDY as greedy

    async def local() -> list[tuple[int, ...]]:
        async with AsyncEngine(str(tiny_model_dir), num_blocks=128) as engine:
            return await asyncio.gather(*(tokens_of(engine, p, greedy) for p in LONG_PROMPTS))

    tokens: list[tuple[int, ...]] = run(local, timeout=300)
    return tokens


async def tokens_of(engine: AsyncEngine, prompt: str, params: Any) -> tuple[int, ...]:
    last: tuple[int, ...] = ()
    async for output in engine.generate(prompt, params):
        last = tuple(output.token_ids)
    return last


def check_prefill_decode(report: dict[str, Any], expected: list[tuple[int, ...]]) -> None:
    """A P/D 1:1 engine's report over LONG_PROMPTS: every prompt prefilled on the prefill
    engine, its blocks moved (at least 3 full blocks each, none run whole), the greedy tokens
    ``expected`` (one local engine's); the killed decode engine's streams failed in bounded
    time, and the prefill engine lives on and serves the prompts whole, with those tokens."""
    transfers, blocks, fallbacks = report["moved"]
    assert (transfers, fallbacks) == (len(LONG_PROMPTS), 0)
    assert blocks >= 3 * len(LONG_PROMPTS)
    assert [tuple(tokens) for tokens in report["tokens"]] == expected
    assert report["killed"] == ["EngineDeadError"] * len(LONG_PROMPTS)
    assert report["seconds"] < KILLED_SHARD_SECONDS
    assert report["failure"] is None
    assert [tuple(tokens) for tokens in report["after"]] == expected


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_prefill_and_decode_engines_on_two_nodes_move_kv_and_a_killed_decoder_fails_its_own(
    tiny_model_dir: Path,
    two_nodes: tuple[StartedRay, StartedRay],
    long_local_tokens: list[tuple[int, ...]],
) -> None:
    """P/D 1:1 on Ray, the prefill engine pinned to the head and the decode engine to the
    second node, then the same at TP=2, one after the other in one driver process (one
    interpreter's start for both; each engine is its own, as in two tests):

    - TP=1: the prefill engine on the head, the decode engine on the second node; every
      prompt's blocks move, the greedy tokens are one local engine's; killing the decode
      engine fails the streams it held, and the prefill engine serves on, whole;
    - TP=2: the prefill engine's two ranks on the head, the decode engine's on the second
      node; each prompt's blocks (both KV heads, gathered from the prefill ranks) go straight
      from the prefill engine to the decode engine across the nodes, each decode rank keeps
      its heads, and the greedy tokens are one local engine's (TP=1). Killing the decode
      engine's second rank fails the streams it held; the prefill engine serves on, whole."""
    pinned = dict(ray_num_cpus=0.5, ray_prefill_decode_resources="node:__internal_head__,second")
    disaggregated = dict(prefill_decode=[1, 1], **pinned)
    tensor_parallel = dict(prefill_decode=[1, 1], tensor_parallel_size=2, **pinned)
    engines = [[disaggregated, "engine_1"], [tensor_parallel, "engine_1_tp1"]]
    (report, tp_report), first, second = drive(
        tiny_model_dir, two_nodes, engines, LONG_PROMPTS, timeout=800
    )
    # the prefill engine on the head, the decode engine on the second node
    assert {host: where["node"] for host, where in report["hosts"].items()} == {
        "engine": first, "engine_1": second
    }  # fmt: skip
    check_prefill_decode(report, long_local_tokens)
    # at TP=2, each engine's ranks on its node
    assert {host: where["node"] for host, where in tp_report["hosts"].items()} == {
        "engine": first, "engine_tp1": first, "engine_1": second, "engine_1_tp1": second,
    }  # fmt: skip
    check_prefill_decode(tp_report, long_local_tokens)
    # each straight from prefill engine 0 to decode engine 1, both KV heads of every block
    # (the tiny Llama: 2 layers, K and V, 16 tokens, 2 KV heads of 16, float32)
    for source, target, num_blocks, nbytes in tp_report["transfers"]:
        assert (source, target) == ("0", "1")
        assert nbytes == num_blocks * 2 * 2 * 16 * 2 * 16 * 4
