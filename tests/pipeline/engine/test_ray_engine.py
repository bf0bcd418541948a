"""The LLM engine on a local Ray cluster (docs/parallelism.md, "Hosts on a Ray cluster"): two
data-parallel replicas whose hosts are Ray actors (one placement group each), and two
tensor-parallel ranks on Ray (one STRICT_PACK group, meeting at the node's IP), give the greedy
tokens of local processes; ``ray.kill`` of one replica's actor fails only its requests, of the
last one every pending request, with EngineDeadError within 5 s; ``actorline serve --ray
ADDRESS`` serves from the session's cluster; and once closed an engine leaves no actor and no
placement group in the cluster. Without Ray, the option is refused (API and CLI) naming the
extra. Engine hosts reserve GPUs in their bundles (``ray_num_gpus``), and each rank computes on
the GPU Ray assigned it (on CPU: the bundles and the device choice as plain data)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline import AsyncEngine, EngineDeadError, SamplingParams
from pipeline.cli.llm import engine_options_from
from pipeline.cli.main import build_parser
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import check_parallelism, engine_bundle, start_options
from pipeline.runtime.ray_hosts import GPU_IDS_ENV, NODE_IP_ENV, RayUnavailableError
from pipeline.server.client import Client
from stages.execute.config import ExecuteConfigError
from stages.execute.tensor_parallel import rank_device, rendezvous_host
from stages.route import RouterStage
from tests.pipeline.runtime.test_ray_hosts import pipeline_state, wait_until_gone
from tests.pipeline.runtime.test_running import run
from tests.pipeline.server.serving import ServeProcess, engine_host_pids, serve_arguments

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [f"Request {index} talks about {topic}" for index, topic in enumerate(
    ["rivers", "trains", "bridges", "towns"]
)]  # fmt: skip
PROMPTLY = 60.0
#: ``actorline serve`` refusing the Ray option where Ray cannot be imported
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from pipeline.cli.main import main; " \
    "sys.exit(main(sys.argv[1:]))"  # fmt: skip


async def outputs(engine: AsyncEngine) -> list[tuple[int, ...]]:
    """The greedy tokens of PROMPTS, generated concurrently."""

    async def one(prompt: str) -> tuple[int, ...]:
        last = None
        async for output in engine.generate(prompt, GREEDY):
            last = output
        assert last is not None
        return last.token_ids

    return list(await asyncio.gather(*(one(prompt) for prompt in PROMPTS)))


#: local_tokens' reference by model directory: computed once per test process, though the
#: Ray modules that share the fixture (test_ray_started, test_pp_ray_nodes) each import it
_LOCAL_TOKENS: dict[Path, list[tuple[int, ...]]] = {}


@pytest.fixture(scope="module")
def local_tokens(tiny_model_dir: Path) -> list[tuple[int, ...]]:
    """PROMPTS' greedy tokens from the tiny model on a local engine process (TP=1, DP=1)."""

    async def local() -> list[tuple[int, ...]]:
        async with AsyncEngine(str(tiny_model_dir), num_blocks=128) as engine:
            return await outputs(engine)

    if tiny_model_dir not in _LOCAL_TOKENS:
        _LOCAL_TOKENS[tiny_model_dir] = run(local, timeout=300)
    return list(_LOCAL_TOKENS[tiny_model_dir])


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Ray cannot be imported in this process while the test runs."""
    monkeypatch.setitem(sys.modules, "ray", None)
    yield


# -- plain data: placements, bundles, the device of each rank ------------------------------------


def test_start_options_place_each_replica_in_a_placement_group() -> None:
    options = start_options(
        EngineOptions(data_parallel_size=2, tensor_parallel_size=3, ray=True, ray_num_cpus=0.5)
    )
    assert sorted(options.hosts) == [
        "engine",
        "engine_1",
        "engine_1_tp1",
        "engine_1_tp2",
        "engine_tp1",
        "engine_tp2",
    ]
    assert options.hosts["engine_1_tp2"].placement_group == "replica1"
    # the replica's one shard is one bundle: its three ranks' resources, each rank's actor in it
    assert options.hosts["engine_1_tp2"].bundle_index == 0
    group = options.placement_groups["replica1"]
    assert group.strategy == "STRICT_PACK" and group.bundles == ({"CPU": 1.5},)
    assert all(host.num_gpus == 0 for host in options.hosts.values())
    assert start_options(EngineOptions()).hosts == {}
    with pytest.raises(ValueError, match="transport 'memory'"):
        EngineOptions(ray=True, transport="memory")


def test_engine_hosts_reserve_their_gpus_in_their_bundles() -> None:
    gpus = EngineOptions(
        data_parallel_size=2,
        tensor_parallel_size=2,
        device="cuda",
        ray=True,
        ray_num_cpus=2,
        ray_num_gpus=1,
    )
    assert engine_bundle(gpus) == {"CPU": 2.0, "GPU": 1.0}
    options = start_options(gpus)
    assert sorted(options.placement_groups) == ["replica0", "replica1"]
    for group in options.placement_groups.values():
        # one GPU per rank, the ranks of a replica on one node (one bundle)
        assert group.strategy == "STRICT_PACK" and group.bundles == ({"CPU": 4.0, "GPU": 2.0},)
    assert {(h.num_cpus, h.num_gpus) for h in options.hosts.values()} == {(2.0, 1.0)}
    # the CLI flag reaches the options
    args = build_parser().parse_args(
        ["serve", "--ray", "--device", "cuda", "--ray-num-gpus", "0.5", "--ray-num-cpus", "1"]
    )
    assert EngineOptions.create(**engine_options_from(args)).ray_num_gpus == 0.5
    assert build_parser().parse_args(["serve", "--ray"]).ray_num_gpus == 0.0
    with pytest.raises(ValueError, match="ray_num_gpus must be a number >= 0"):
        EngineOptions(ray=True, device="cuda", ray_num_gpus=-1)
    with pytest.raises(ValueError, match="device is 'cpu'"):
        EngineOptions(ray=True, ray_num_gpus=1)


def test_each_rank_computes_on_the_gpu_ray_assigned_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cuda1 = torch.device("cuda"), torch.device("cuda", 1)
    # no GPU of its own (a local process, an actor with none): rank r takes the r-th GPU
    assert rank_device(cuda, 2, ()) == torch.device("cuda", 2)
    assert rank_device(cuda1, 1, ()) == torch.device("cuda", 2)
    # each rank's actor holds its own GPU, the only one its process sees: cuda:0 for every rank
    assert rank_device(cuda, 0, ("3",)) == rank_device(cuda, 1, ("5",)) == torch.device("cuda", 0)
    assert rank_device(cuda1, 1, ("4", "5")) == cuda1
    with pytest.raises(ExecuteConfigError, match="Ray assigned rank 1's host 1 GPU"):
        rank_device(cuda1, 1, ("5",))
    assert rank_device(torch.device("cpu"), 1, ("5",)) == torch.device("cpu")
    # by default, as this process's Ray host published it (pipeline.runtime.ray_hosts)
    monkeypatch.setenv(GPU_IDS_ENV, "6")
    assert rank_device(cuda, 1) == torch.device("cuda", 0)
    monkeypatch.delenv(GPU_IDS_ENV)
    assert rank_device(cuda, 1) == torch.device("cuda", 1)
    # the ranks meet at rank 0's node IP on Ray, on the loopback elsewhere
    assert rendezvous_host("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv(NODE_IP_ENV, "10.1.2.3")
    assert rendezvous_host("127.0.0.1") == "10.1.2.3"


# -- without Ray ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_ray")
def test_without_ray_the_engine_refuses_the_option_naming_the_extra(tiny_model_dir: Path) -> None:
    with pytest.raises(RayUnavailableError, match=r"pip install 'actorline\[ray\]'"):
        check_parallelism(EngineOptions(ray=True))
    engine = AsyncEngine(str(tiny_model_dir), ray_address="auto")
    with pytest.raises(RayUnavailableError, match=r"pip install 'actorline\[ray\]'"):
        run(engine.start)
    run(engine.close)


def test_without_ray_actorline_serve_refuses_the_option_in_one_line(tiny_model_dir: Path) -> None:
    command = [sys.executable, "-c", WITHOUT_RAY, "serve", "--ray", "--port", "0"]
    result = subprocess.run(
        [*command, "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "actorline: error: a host is placed on Ray, but Ray is not installed: "
        "pip install 'actorline[ray]'"
    ]
    assert result.stdout == ""


# -- on the session's Ray cluster ----------------------------------------------------------------


def test_replicas_on_ray_serve_like_local_processes_and_die_typed(
    tiny_model_dir: Path,
    ray_cluster: object,
    local_tokens: list[tuple[int, ...]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = str(tiny_model_dir)

    async def on_ray() -> None:
        engine = AsyncEngine(
            model, num_blocks=128, data_parallel_size=2, ray=True, ray_num_cpus=0.5
        )
        await engine.start()
        try:
            # half a CPU each on a 2-CPU cluster: the engine says its model gets one thread
            assert "the model computes on 1 thread while the cluster's nodes have up to 2" in (
                caplog.text
            )
            assert await outputs(engine) == local_tokens
            actors, groups = pipeline_state(ray_cluster, "llm")
            assert len(actors) == 2 and sorted(groups) == ["actorline:llm:replica0",
                                                          "actorline:llm:replica1"]  # fmt: skip
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage) and set(router.routed) == {"0", "1"}
            long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            started: dict[str, asyncio.Event] = {p: asyncio.Event() for p in PROMPTS}

            async def stream(prompt: str) -> BaseException | None:
                try:
                    async for _ in engine.generate(prompt, long, request_id=prompt):
                        started[prompt].set()
                except EngineDeadError as error:
                    return error
                return None

            tasks = {p: asyncio.create_task(stream(p)) for p in PROMPTS}
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), PROMPTLY)
            placed = {rid.partition("#")[0]: replica for rid, replica in router.recent}
            ray = ray_cluster
            ray.kill(engine.running.ray_actor("engine_1"))  # type: ignore[attr-defined]
            killed = time.monotonic()
            victims = [p for p in PROMPTS if placed[p] == "1"]
            for prompt in victims:
                assert isinstance(await asyncio.wait_for(tasks[prompt], PROMPTLY), EngineDeadError)
            assert time.monotonic() - killed < 5.0
            assert engine.failure is None
            assert not any(tasks[p].done() for p in PROMPTS if p not in victims)
            ray.kill(engine.running.ray_actor("engine"))  # type: ignore[attr-defined]
            killed = time.monotonic()
            for prompt in PROMPTS:
                assert isinstance(await asyncio.wait_for(tasks[prompt], PROMPTLY), EngineDeadError)
            assert time.monotonic() - killed < 5.0
            assert isinstance(engine.failure, EngineDeadError)
        finally:
            await engine.close()
        await wait_until_gone(ray_cluster, "llm")

    run(on_ray, timeout=300)


def test_tensor_parallel_ranks_on_ray_meet_at_the_node_ip_and_match_local(
    tiny_model_dir: Path, ray_cluster: object, local_tokens: list[tuple[int, ...]]
) -> None:
    node_ip = ray_cluster.util.get_node_ip_address()  # type: ignore[attr-defined]

    async def on_ray() -> None:
        # two ranks of half a CPU each: one STRICT_PACK group fits the 2-CPU session cluster
        engine = AsyncEngine(
            str(tiny_model_dir), num_blocks=128, tensor_parallel_size=2, ray=True, ray_num_cpus=0.5
        )
        async with engine:
            assert await outputs(engine) == local_tokens
            actors, groups = pipeline_state(ray_cluster, "llm")
            assert sorted(name.rsplit(":", 1)[0] for name in actors) == [
                "actorline:llm:engine",
                "actorline:llm:engine_tp1",
            ]
            assert groups == ["actorline:llm:replica0"]
            for host in ("engine", "engine_tp1"):  # where the rendezvous is, and no GPU
                _, ip, gpus = await engine.running.ray_actor(host).where.remote()
                assert (ip, gpus) == (node_ip, ())
        await wait_until_gone(ray_cluster, "llm")

    run(on_ray, timeout=300)


def test_actorline_serve_ray_address_serves_from_the_cluster(
    tiny_model_dir: Path,
    ray_cluster: object,
    local_tokens: list[tuple[int, ...]],
    tmp_path: Path,
) -> None:
    address = ray_cluster.get_runtime_context().gcs_address  # type: ignore[attr-defined]
    arguments = serve_arguments(tiny_model_dir, "--ray", address, "--ray-num-cpus", "0.5")
    serve = ServeProcess(arguments, tmp_path / "stderr.txt")
    try:
        assert serve.address is not None
        actors, groups = pipeline_state(ray_cluster, "llm")
        assert len(actors) == 1 and actors[0].startswith("actorline:llm:engine:")
        assert groups == ["actorline:llm:replica0"]
        assert not engine_host_pids(serve.process.pid)  # the engine is on Ray, not here
        with Client(serve.address) as client:
            tokens = [t for out in client.generate(PROMPTS[0], GREEDY) for t in out.token_ids]
        assert tuple(tokens) == local_tokens[0]
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(PROMPTLY) == 0, serve.stderr[-3000:]
    finally:
        serve.kill()
    run(lambda: wait_until_gone(ray_cluster, "llm"))


@pytest.mark.cuda
def test_an_engine_on_ray_computes_on_the_gpu_ray_assigned_it(
    tiny_model_dir: Path, ray_cluster: object
) -> None:
    gpus = ray_cluster.cluster_resources().get("GPU", 0)  # type: ignore[attr-defined]
    if gpus < 1:
        pytest.skip("the session's Ray cluster has no GPU")
    model = str(tiny_model_dir)

    async def tokens(**options: object) -> list[tuple[int, ...]]:
        async with AsyncEngine(model, num_blocks=128, device="cuda", **options) as engine:
            assert engine.info is not None and engine.info.device == "cuda:0"
            if options.get("ray"):
                for host in engine.running.pids:
                    _, _, assigned = await engine.running.ray_actor(host).where.remote()
                    assert len(assigned) == 1  # its own GPU, seen as cuda:0
            return await outputs(engine)

    async def body() -> None:
        on_ray = dict(ray=True, ray_num_cpus=0.5, ray_num_gpus=1)
        assert await tokens(**on_ray) == await tokens()
        if gpus >= 2:  # a rank per GPU: each computes on cuda:0 of its own process
            assert await tokens(tensor_parallel_size=2, **on_ray) == await tokens(
                tensor_parallel_size=2
            )
        await wait_until_gone(ray_cluster, "llm")

    run(body, timeout=600)
