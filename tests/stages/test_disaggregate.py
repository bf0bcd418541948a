"""Disaggregated prefill and decode on the tiny Llama (stages/disaggregate.py): a prefill
engine and a decode engine, each a real process, behind the router. Greedy outputs equal one
engine's over requests that share prefixes, with structured outputs and stop strings; every
request's prompt blocks moved (the router counts blocks and bytes) and the decode engine's
prefix cache served them; the options refuse what does not combine. A killed decode engine
fails only the requests it was streaming, a killed prefill engine fails none (its requests run
whole on the decode engine), both in bounded time and with no process left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import AsyncEngine, EngineDeadError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from stages.disaggregate import PREFILL_SUFFIX, PrefillDecodeRouterStage
from stages.structured.params import StructuredOutputsParams
from tests.processes import process_alive
from tests.stages.test_route import PROMPTLY, PROMPTS, run  # the two prompt families

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHOICE = SamplingParams(
    max_tokens=12,
    temperature=0.0,
    structured_outputs=StructuredOutputsParams(choice=("red river", "green bridge", "blue")),
)


async def final(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams) -> Any:
    last = None
    async for output in engine.generate(prompt, params, request_id=request_id):
        last = output
    assert last is not None
    return last


@contextlib.asynccontextmanager
async def pd_engine(
    model_dir: Path, **options: Any
) -> AsyncIterator[tuple[AsyncEngine, PrefillDecodeRouterStage, dict[str, int | None]]]:
    """A started P/D 1:1 engine on the tiny model (256 blocks, ``options`` on top), its
    router and its hosts' pids; closed on leaving, after which none of its processes is left
    (checked when the block ended without an error)."""
    engine = AsyncEngine(str(model_dir), num_blocks=256, prefill_decode=(1, 1), **options)
    await engine.start()
    pids = dict(engine.running.pids)
    try:
        router = engine.running.stage("router")
        assert isinstance(router, PrefillDecodeRouterStage)
        yield engine, router, pids
    finally:
        await engine.close()
    assert not any(process_alive(pid) for pid in pids.values() if pid is not None)


async def outputs_of(engine: AsyncEngine, stop: str | None) -> dict[str, tuple[Any, ...]]:
    """Each prompt greedy, under a grammar, and (given ``stop``) with a stop string: the
    first of each family alone, then the rest at once. ``stop`` None: the stop string is
    taken from the first greedy output's text (what :func:`expected` does)."""
    names = sorted(PROMPTS)
    done: dict[str, tuple[Any, ...]] = {}
    firsts = [name for name in names if name.endswith("0")]
    for batch in (firsts, [name for name in names if name not in firsts]):
        outs = await asyncio.gather(*(final(engine, n, PROMPTS[n], GREEDY) for n in batch))
        for name, out in zip(batch, outs):
            done[name] = (out.token_ids, out.finish_reason)
    if stop is None:
        text = (await final(engine, "probe", PROMPTS["a0"], GREEDY)).text
        stop = text[len(text) // 3 : len(text) // 3 + 3]
    stopping = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,))
    for name in names:
        chosen = await final(engine, f"{name}-choice", PROMPTS[name], CHOICE)
        stopped = await final(engine, f"{name}-stop", PROMPTS[name], stopping)
        done[f"{name}-choice"] = (chosen.text, chosen.finish_reason)
        done[f"{name}-stop"] = (stopped.text, stopped.finish_reason, stop)
    return done


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[str, tuple[Any, ...]]:
    async def one() -> dict[str, tuple[Any, ...]]:
        async with AsyncEngine(str(tiny_model_dir), num_blocks=256) as engine:
            return await outputs_of(engine, None)

    return run(one())


@pytest.mark.slow
def test_prefill_decode_serves_like_one_engine_and_a_killed_prefill_engine_fails_no_request(
    tiny_model_dir: Path, expected: dict[str, tuple[Any, ...]]
) -> None:
    """One P/D 1:1 engine start for two checks: it serves like one engine (every request
    prefilled on engine 0 and decoded on engine 1, its blocks moved); then its prefill engine
    is frozen and killed, and no request fails (formerly
    test_a_killed_prefill_engine_fails_no_request, see :func:`killed_prefill_fails_none`)."""
    stop = expected["a0-stop"][2]
    assert expected["a0-stop"][1] == "stop"  # the stop string ends the greedy output
    assert all(value[0] in CHOICE.structured_outputs.choice  # type: ignore[union-attr]
               for key, value in expected.items() if key.endswith("-choice"))  # fmt: skip

    async def body() -> None:
        async with pd_engine(tiny_model_dir) as (engine, router, pids):
            assert set(pids) == {"engine", "engine_1"}
            got = await outputs_of(engine, stop)
            assert got == expected
            # every request was prefilled on engine 0 and decoded on engine 1
            runs = 3 * len(PROMPTS)
            prefilled = [rid for rid, replica in router.recent if rid.endswith(PREFILL_SUFFIX)]
            assert len(prefilled) == runs and router.routed == {"0": runs, "1": runs}
            assert router.transfers == runs and router.fallbacks == 0
            moved = [t.num_blocks for t in router.recent_transfers]
            # each prompt's full blocks before its last token moved
            assert all(blocks >= 3 for blocks in moved), moved
            assert router.blocks_moved == sum(moved)
            per_block = router.bytes_moved // router.blocks_moved
            assert per_block * router.blocks_moved == router.bytes_moved
            # the tiny Llama: 2 layers, K and V, 16 tokens, 2 KV heads of 16, float32
            assert per_block == 2 * 2 * BLOCK * 2 * 16 * 4
            decode = engine.replica_stats["1"]
            assert decode.prefix_cache_hits >= BLOCK * router.blocks_moved
            assert not router._prefilling and not router._prefill_ids
            # one hop: from the prefill engine straight to the decode engine, none dropped
            assert {(t.source, t.target) for t in router.recent_transfers} == {("0", "1")}
            assert router.released == 0 and not router._parked
            await killed_prefill_fails_none(engine, router, pids, expected)

    run(body())


async def killed_prefill_fails_none(
    engine: AsyncEngine,
    router: PrefillDecodeRouterStage,
    pids: dict[str, int | None],
    expected: dict[str, tuple[Any, ...]],
) -> None:
    """The prefill engine is frozen (SIGSTOP), so the requests sent to it wait for their
    blocks (one of them is cancelled by its caller meanwhile: it is forgotten); then it is
    killed. They run whole on the decode engine, with one engine's tokens (``expected``);
    no caller sees an error."""
    assert router.fallbacks == 0
    names = ("a2", "b2")
    frozen = pids["engine"]
    assert frozen is not None
    os.kill(frozen, signal.SIGSTOP)
    try:
        tasks = {n: asyncio.create_task(final(engine, f"whole-{n}", PROMPTS[n], GREEDY))
                 for n in names}  # fmt: skip
        gone = asyncio.create_task(final(engine, "gone", PROMPTS["a0"], GREEDY))
        deadline = time.monotonic() + PROMPTLY
        while len(router._prefilling) < len(names) + 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # a caller that gives up while its request waits for its prefill: aborted
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        while any(rid.startswith("gone") for rid in router._prefilling):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert not any(rid.startswith("gone") for rid in router._prefill_ids)
    finally:
        killed = time.monotonic()
        os.kill(frozen, signal.SIGKILL)
    done = await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)
    assert time.monotonic() - killed < 30
    for name, out in zip(names, done):
        assert out.token_ids == expected[name][0]
    assert router.fallbacks == len(names) and router.live_replicas == ("1",)
    assert not process_alive(frozen)


@pytest.mark.slow
def test_prefill_decode_at_tensor_parallel_2_serves_like_one_engine(
    tiny_model_dir: Path, expected: dict[str, tuple[Any, ...]]
) -> None:
    """Each engine a tensor-parallel group of two ranks, each rank's cache one of the tiny
    Llama's two KV heads: the moved blocks carry both (gathered from the prefill engine's
    ranks), each decode rank keeps its own, and the outputs are one (TP=1) engine's."""

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), num_blocks=256, prefill_decode=(1, 1), tensor_parallel_size=2
        ) as engine:
            assert set(engine.running.pids) == {"engine", "engine_tp1", "engine_1", "engine_1_tp1"}
            got = await outputs_of(engine, expected["a0-stop"][2])
            assert got == expected
            router = engine.running.stage("router")
            runs = 3 * len(PROMPTS)
            assert router.transfers == runs and router.fallbacks == 0
            assert router.blocks_moved >= 3 * runs
            # both KV heads of every block moved (2 layers, K and V, 16 tokens, 2 heads of 16)
            assert router.bytes_moved == router.blocks_moved * 2 * 2 * BLOCK * 2 * 16 * 4
            assert engine.replica_stats["1"].prefix_cache_hits >= BLOCK * router.blocks_moved

    run(body())


@pytest.mark.slow
def test_one_prefill_engine_feeds_two_decode_engines_each_its_own_blocks(
    tiny_model_dir: Path, expected: dict[str, tuple[Any, ...]]
) -> None:
    """P/D 1:2: the prefill engine's ``kv`` port has a link to each decode engine, and each
    request's blocks go to the one the router chose for it (and only there): every request
    is decoded where its blocks went, both decode engines get some, outputs one engine's."""

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), num_blocks=256, prefill_decode=(1, 2)
        ) as engine:
            got = await outputs_of(engine, expected["a0-stop"][2])
            assert got == expected
            router = engine.running.stage("router")
            assert isinstance(router, PrefillDecodeRouterStage)
            runs = 3 * len(PROMPTS)
            assert router.transfers == runs and router.fallbacks == 0
            assert router.released == 0 and not router._parked
            decoded = {rid: replica for rid, replica in router.recent
                       if not rid.endswith(PREFILL_SUFFIX)}  # fmt: skip
            targets = {t.request_id: t.target for t in router.recent_transfers}
            assert targets == {rid: decoded[rid] for rid in targets}
            assert set(targets.values()) == {"1", "2"}, targets
            for replica in ("1", "2"):
                moved = sum(t.num_blocks for t in router.recent_transfers if t.target == replica)
                assert engine.replica_stats[replica].prefix_cache_hits >= BLOCK * moved

    run(body())


def test_the_options_refuse_what_does_not_combine() -> None:
    assert EngineOptions("m", prefill_decode="2:1").prefill_decode == (2, 1)
    for value in ("1", "0:1", "a:b", (1, 2, 3), 3):
        with pytest.raises(ValueError, match="prefill_decode must be None or"):
            EngineOptions("m", prefill_decode=value)  # type: ignore[arg-type]
    for fields, clash in (
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
        ({"transport": "memory"}, "transport 'memory'"),
        ({"enable_prefix_caching": False}, "enable_prefix_caching off"),
        ({"null_model": True}, "null_model"),
    ):
        with pytest.raises(ValueError, match=f"does not combine with {clash}"):
            EngineOptions("m", prefill_decode=(1, 1), **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"in place of data_parallel_size \(2\): give one"):
        EngineOptions("m", prefill_decode=(1, 1), data_parallel_size=2)


def test_the_pipeline_links_the_prefill_engines_straight_to_the_decode_engines() -> None:
    pipeline = llm_pipeline(EngineOptions("m", prefill_decode=(2, 2)))
    described = pipeline.describe()
    assert "stage router [PrefillDecodeRouterStage] on main" in described
    # one hop: every prefill engine's blocks to every decode engine, none through the router
    for source in ("execute", "execute_1"):
        for target in ("execute_2", "execute_3"):
            assert f"{source}.kv -> {target}.in" in described
    assert "router.kv ->" not in described and ".kv -> router" not in described
    for decode in ("execute_2", "execute_3"):
        assert f"{decode}.kv_arrived -> router.kv" in described
        assert f"router.kv_release -> {decode}.in" in described
        assert f"{decode}.kv ->" not in described  # a decode engine exports nothing
    assert "execute.kv_arrived" not in described  # nor is a prefill engine sent blocks
    assert "replica set engines (0: engine, 1: engine_1, 2: engine_2, 3: engine_3)" in described


@pytest.mark.slow
def test_a_late_transfer_runs_whole_and_a_killed_decode_engine_fails_only_what_it_streamed(
    tiny_model_dir: Path,
) -> None:
    """One P/D 1:1 engine start for two checks. The prefill engine frozen, a short transfer
    timeout: the request runs whole on the decode engine when it passes, with one engine's
    tokens (formerly test_a_transfer_that_does_not_come_runs_the_request_whole). Then the
    decode engine is SIGKILLed mid-stream: it fails only what it streamed, the prefill engine
    serves on (formerly test_a_killed_decode_engine_fails_only_what_it_streamed, see
    :func:`killed_decode_fails_its_streams`)."""

    async def body() -> None:
        async with pd_engine(
            tiny_model_dir, prefill_decode_timeout=1.0, heartbeat_timeout=120.0
        ) as (engine, router, pids):
            before = await final(engine, "before", PROMPTS["a1"], GREEDY)
            frozen = pids["engine"]
            assert frozen is not None
            os.kill(frozen, signal.SIGSTOP)
            try:
                late = await asyncio.wait_for(final(engine, "late", PROMPTS["a1"], GREEDY), 60)
            finally:
                os.kill(frozen, signal.SIGCONT)
            assert late.token_ids == before.token_ids
            assert router.fallbacks == 1
            # the engine thawed answers the next one through the transfer again
            again = await final(engine, "again", PROMPTS["a1"], GREEDY)
            assert again.token_ids == before.token_ids and router.transfers == 2
            await killed_decode_fails_its_streams(engine, pids)

    run(body())


async def killed_decode_fails_its_streams(engine: AsyncEngine, pids: dict[str, int | None]) -> None:
    """Two streams on the decode engine, which is SIGKILLed: both fail promptly with
    EngineDeadError naming replica 1; the prefill engine lives on and serves requests whole."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    progress: dict[str, int] = {}

    async def stream(name: str) -> BaseException | int:
        try:
            async for output in engine.generate(PROMPTS[name], params, request_id=name):
                progress[name] = len(output.token_ids)
        except EngineDeadError as error:
            return error
        return len(output.token_ids)

    tasks = {name: asyncio.create_task(stream(name)) for name in ("a0", "b0")}
    deadline = time.monotonic() + PROMPTLY
    while len(progress) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    victim = pids["engine_1"]
    assert victim is not None
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    ended = await asyncio.wait_for(asyncio.gather(*tasks.values()), 60)
    assert time.monotonic() - killed < 20
    for result in ended:
        assert isinstance(result, EngineDeadError), result
        assert "engine replica 1 failed" in str(result)
    assert not process_alive(victim)
    # the prefill engine lives on and now serves requests whole
    assert engine.failure is None
    again = await final(engine, "after", PROMPTS["a1"], GREEDY)
    assert len(again.token_ids) == GREEDY.max_tokens


@pytest.mark.slow
def test_smollm2_prefill_decode_is_one_engine(default_model_dir: Path) -> None:
    """The default model (30 layers; its KV cache as the engine chooses it by default):
    P/D 1:1 gives one engine's greedy tokens, each prompt's full blocks moved."""
    prompts = {name: PROMPTS[name] for name in ("a0", "a1", "b0")}

    async def outputs(**options: Any) -> tuple[dict[str, tuple[int, ...]], Any]:
        async with AsyncEngine(str(default_model_dir), **options) as engine:
            done = {}
            for name, prompt in prompts.items():
                done[name] = (await final(engine, name, prompt, GREEDY)).token_ids
            router = engine.running.stage("router") if options else None
            moved = None
            if isinstance(router, PrefillDecodeRouterStage):
                moved = (router.transfers, router.blocks_moved, router.fallbacks)
                hits = engine.replica_stats["1"].prefix_cache_hits
                assert hits >= BLOCK * router.blocks_moved
            return done, moved

    async def body() -> None:
        alone, _ = await outputs()
        disaggregated, moved = await outputs(prefill_decode=(1, 1))
        assert disaggregated == alone
        assert moved is not None and moved[0] == len(prompts) and moved[2] == 0
        assert moved[1] >= 3 * len(prompts)

    run(body(), timeout=1200)


@pytest.mark.slow
def test_a_restarted_prefill_engine_moves_blocks_again(tiny_model_dir: Path) -> None:
    """With ``restart_engine`` a killed prefill engine is restarted on its own; once it runs
    again its blocks reach the router over the restored link (no request runs whole)."""

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir),
            num_blocks=256,
            prefill_decode=(1, 1),
            restart_engine=True,
            restart_backoff=0.5,
        ) as engine:
            router = engine.running.stage("router")
            assert isinstance(router, PrefillDecodeRouterStage)
            first = await final(engine, "first", PROMPTS["b1"], GREEDY)
            victim = engine.running.pids["engine"]
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + PROMPTLY
            while "0" in router.live_replicas:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            while "0" not in router.live_replicas:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert not process_alive(victim)
            again = await final(engine, "again", PROMPTS["b1"], GREEDY)
            assert again.token_ids == first.token_ids
            assert router.transfers == 2 and router.fallbacks == 0

    run(body())


@pytest.mark.slow
def test_blocks_no_request_waits_for_are_dropped_by_the_decode_engine(
    tiny_model_dir: Path,
) -> None:
    """The decode engine frozen (SIGSTOP), so the blocks the prefill engine sends it wait in
    its sockets: one request is cancelled by its caller once its prefill finished, another
    runs whole once its transfer is late. Thawed, the decode engine gets the blocks of both,
    the router has it drop them (no request waits for them), the late request's tokens are
    one engine's, and the blocks of the next request find nothing else held there. The links
    compress (zstd), the direct one between the engines too."""

    async def body() -> None:
        async with pd_engine(
            tiny_model_dir, prefill_decode_timeout=5.0, heartbeat_timeout=120.0, compression="zstd"
        ) as (engine, router, pids):
            before = await final(engine, "before", PROMPTS["a1"], GREEDY)
            assert router.transfers == 1 and router.decode_held == {"1": (0, 0)}
            frozen = pids["engine_1"]
            assert frozen is not None
            deadline = time.monotonic() + PROMPTLY
            os.kill(frozen, signal.SIGSTOP)
            try:
                gone = asyncio.create_task(final(engine, "gone", PROMPTS["b1"], GREEDY))
                while not any(rid.startswith("gone") and state.finished is not None
                              for rid, state in router._prefilling.items()):  # fmt: skip
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                gone.cancel()  # its blocks are on their way to the frozen engine
                with pytest.raises(asyncio.CancelledError):
                    await gone
                while router._prefilling:  # its abort reached the router
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                assert router.fallbacks == 0
                late = asyncio.create_task(final(engine, "late", PROMPTS["a1"], GREEDY))
                while router.fallbacks < 1:  # its transfer was taken as late: runs whole
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
            finally:
                os.kill(frozen, signal.SIGCONT)
            assert (await asyncio.wait_for(late, 60)).token_ids == before.token_ids
            while router.released < 2:  # both sets of blocks came, and were dropped
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert router.released == 2 and router.transfers == 1 and router.fallbacks == 1
            # NOTE: the drops went out before the next request was sent to its prefill
            again = await final(engine, "again", PROMPTS["a1"], GREEDY)
            assert again.token_ids == before.token_ids
            assert router.transfers == 2 and router.fallbacks == 1
            assert router.decode_held == {"1": (0, 0)}  # nothing else held there: freed
            assert router.recent_transfers[-1].request_id.startswith("again")
            assert not router._parked and not router._prefilling

    run(body())
