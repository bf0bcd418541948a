"""The draft model placed apart (docs/speculative.md, "Where the draft model runs"): a draft
stage on a host of its own feeds the target the same drafts as the drafter beside it, so
greedy outputs stay token-identical and sampling keeps the target's distribution; a draft
host that dies costs the drafts, never a request; with data parallelism each replica has its
own draft host. Real processes, the tiny random model."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM
from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.metrics import EngineMetrics
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline, start_options
from stages.params import SamplingParams
from tests.pipeline.engine.test_speculative import PROMPTS, check_same_distribution, generate_with

GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 7, 13, 64)]


def _spec(model: Path, k: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "method": "draft_model",
        "model": str(model),
        "num_speculative_tokens": k,
        "disable_by_batch_size": 256,
        **extra,
    }


def _apart(model: Path, k: int = 4, **extra: Any) -> dict[str, Any]:
    # a generous bound: the draft host must never miss a step on a loaded machine here
    return _spec(model, k, placement="host", draft_timeout=60, **extra)


def _generate(model: Path, params: Any, **options: Any) -> tuple[list[Any], Any]:
    outputs, stats, _ = _generate_info(model, params, **options)
    return outputs, stats


def _generate_info(model: Path, params: Any, **options: Any) -> tuple[list[Any], Any, Any]:
    """The outputs of PROMPTS, the engine's stats and its EngineInfo."""
    with LLM(str(model), transport="zmq", num_blocks=256, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return outputs, llm.engine.stats, llm.engine.info


#: the killed draft host's streams: long enough to run on well past the kill
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
#: the streams on Ray, drafted for before and after the draft host's actor is killed
ON_RAY = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Plain:
    """The reference: PROMPTS' outputs from one engine without speculation (the same engine
    options as :func:`_generate_info`'s), for GREEDY, LONG and ON_RAY, and its EngineInfo."""

    greedy: list[Any]
    info: Any
    long: list[Any]
    on_ray: list[Any]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Plain:
    """One engine start for every test's reference (each test used to start its own)."""
    with LLM(str(tiny_model_dir), transport="zmq", num_blocks=256) as llm:

        def outputs(params: Any) -> list[Any]:
            return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)

        return Plain(outputs(GREEDY), llm.engine.info, outputs(LONG), outputs(ON_RAY))


def test_the_draft_stage_is_a_node_of_the_pipeline_on_a_host_of_its_own(
    tiny_model_dir: Path,
) -> None:
    options = EngineOptions.create(
        str(tiny_model_dir), speculative_config=_apart(tiny_model_dir), data_parallel_size=2
    )
    text = llm_pipeline(options).describe()
    assert "stage draft [DraftStage] on engine_draft" in text
    assert "stage draft_1 [DraftStage] on engine_1_draft" in text
    for suffix in ("", "_1"):
        assert f"execute{suffix}.draft -> draft{suffix}.in" in text  # the target's info too
        assert f"execute{suffix}.info -> draft{suffix}.in" not in text
        assert f"draft{suffix}.out -> execute{suffix}.in" in text
    assert "replica set draft (0: engine_draft), expendable" in text
    # placed with the engine (the default): no stage of its own
    beside = EngineOptions.create(str(tiny_model_dir), speculative_config=_spec(tiny_model_dir))
    assert "DraftStage" not in llm_pipeline(beside).describe()


def test_on_ray_the_draft_host_is_its_replicas_last_bundle(tiny_model_dir: Path) -> None:
    options = EngineOptions.create(
        str(tiny_model_dir),
        ray=True,
        data_parallel_size=2,
        speculative_config=_apart(tiny_model_dir),
    )
    started = start_options(options)
    for index, engine in enumerate(("engine", "engine_1")):
        group = f"replica{index}"
        assert len(started.placement_groups[group].bundles) == 2
        assert started.hosts[engine].placement_group == group
        assert started.hosts[engine].bundle_index == 0
        draft = started.hosts[f"{engine}_draft"]
        assert (draft.placement_group, draft.bundle_index) == (group, 1)


def test_placement_is_checked(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="placement must be one of engine, host"):
        EngineOptions.create(
            str(tiny_model_dir), speculative_config=_spec(tiny_model_dir, placement="ray")
        )
    with pytest.raises(ValueError, match="transport 'memory' keeps every stage"):
        EngineOptions.create(
            str(tiny_model_dir), transport="memory", speculative_config=_apart(tiny_model_dir)
        )
    with pytest.raises(ValueError, match="draft_timeout must be seconds"):
        EngineOptions.create(
            str(tiny_model_dir),
            speculative_config=_spec(tiny_model_dir, placement="host", draft_timeout=0),
        )
    with pytest.raises(ValueError, match="with placement 'engine' the draft model runs in"):
        EngineOptions.create(
            str(tiny_model_dir), speculative_config=_spec(tiny_model_dir, draft_timeout=5)
        )
    with pytest.raises(ValueError, match="draft model's keys"):
        EngineOptions.create(
            str(tiny_model_dir),
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "placement": "host",
            },
        )


@pytest.mark.slow
def test_greedy_outputs_identical_with_the_draft_model_on_its_own_host(
    tiny_model_dir: Path, plain: Plain
) -> None:
    plain_info = plain.info
    apart, stats, info = _generate_info(
        tiny_model_dir, GREEDY, speculative_config=_apart(tiny_model_dir)
    )
    assert [o.token_ids for o in apart] == [o.token_ids for o in plain.greedy]
    assert [o.text for o in apart] == [o.text for o in plain.greedy]
    # the engine's info reports the draft model's own KV cache and its host: as many blocks
    # as the target's, of the same size (the model drafting for itself)
    assert (plain_info.draft_model, plain_info.draft_num_blocks, plain_info.draft_host) == (
        "",
        0,
        "",
    )
    assert info.draft_model == str(tiny_model_dir) and info.draft_host == "engine_draft"
    assert info.draft_num_blocks == info.num_blocks == 256
    assert info.draft_kv_cache_bytes == info.kv_cache_bytes > 0
    # the model drafting for itself from another process: every draft token accepted
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_num_drafts_dropped == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sampling_with_the_draft_model_apart_keeps_the_target_distribution(
    tiny_model_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    count = 300

    def sampled(**options: Any) -> tuple[list[Any], Any]:
        with LLM(
            str(tiny_model_dir), transport="zmq", num_blocks=1024, max_num_seqs=64, **options
        ) as llm:
            outputs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * count, params)
            return [tuple(o.token_ids) for o in outputs], llm.engine.stats

    plain, _ = sampled()
    spec, stats = sampled(speculative_config=_apart(tiny_model_dir, 3))
    check_same_distribution(plain, spec, stats)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_draft_host_is_restarted_alone_and_drafts_again(
    tiny_model_dir: Path, plain: Plain
) -> None:
    # SIGKILLed mid-stream: the streams finish greedy-identical (without drafts meanwhile),
    # the draft host is restarted alone, and later requests are drafted for again
    params = LONG

    async def run() -> tuple[list[Any], list[Any], list[Any]]:
        engine = AsyncEngine(
            str(tiny_model_dir),
            transport="zmq",
            num_blocks=256,
            speculative_config=_apart(tiny_model_dir),
        )
        await engine.start()
        try:
            killed = asyncio.Event()
            old_pid = engine.running.pids["engine_draft"]
            assert old_pid is not None

            async def one(index: int) -> Any:
                final = None
                async for output in engine.generate(
                    {"prompt_token_ids": PROMPTS[index]}, params, request_id=f"r{index}"
                ):
                    final = output
                    if index == 0 and len(output.token_ids) >= 30 and not killed.is_set():
                        killed.set()
                        os.kill(old_pid, signal.SIGKILL)
                return final

            outputs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            assert killed.is_set()
            stats = [engine.stats]
            # restarted alone, on a fresh process (a generous bound: a loaded machine)
            for _ in range(1200):
                if engine.draft_restarts.get("draft") == 1:
                    break
                await asyncio.sleep(0.1)
            assert engine.draft_restarts == {"draft": 1}
            metrics = EngineMetrics(engine)
            sample = metrics.registry.get_sample_value
            assert sample("actorline_spec_decode_draft_host_restarts_total") == 1.0
            await metrics.aclose()
            assert engine.running.pids["engine_draft"] not in (None, old_pid)
            assert engine.restarts == 0 and engine.failure is None
            after = [o async for o in engine.generate({"prompt_token_ids": PROMPTS[2]}, params)]
            stats.append(engine.stats)
            return list(outputs), after, stats
        finally:
            await engine.close()

    outputs, after, (killed_stats, later) = asyncio.run(run())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.long]
    assert all(o.finish_reason == "length" for o in outputs)
    assert after[-1].token_ids == plain.long[2].token_ids
    assert killed_stats.spec_num_drafts > 0  # it drafted before the kill
    assert killed_stats.spec_num_drafts_dropped > 0  # and went without drafts after it
    # the fresh draft host drafts again: the counters rise, every draft accepted (the model
    # drafting for itself)
    assert later.spec_num_drafts > killed_stats.spec_num_drafts
    assert later.spec_num_accepted_tokens > killed_stats.spec_num_accepted_tokens


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_data_parallel_replica_drafts_with_its_own_draft_host(
    tiny_model_dir: Path, plain: Plain
) -> None:
    apart, stats = _generate(
        tiny_model_dir, GREEDY, data_parallel_size=2, speculative_config=_apart(tiny_model_dir)
    )
    assert [o.token_ids for o in apart] == [o.token_ids for o in plain.greedy]
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    beside, stats = _generate(
        tiny_model_dir, GREEDY, data_parallel_size=2, speculative_config=_spec(tiny_model_dir)
    )
    assert [o.token_ids for o in beside] == [o.token_ids for o in plain.greedy]
    assert stats.spec_num_drafts > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_replica_restarted_alone_drafts_with_its_draft_host_again(
    tiny_model_dir: Path, plain: Plain
) -> None:
    # data parallelism with restart_engine: engine_1 killed, restarted alone though its draft
    # host (a spawned host) links to it; that draft host drops the old engine's requests,
    # answers the fresh one, and drafts for it

    async def run() -> tuple[list[Any], Any]:
        engine = AsyncEngine(
            str(tiny_model_dir),
            transport="zmq",
            num_blocks=256,
            data_parallel_size=2,
            restart_engine=True,
            restart_backoff=0.2,
            speculative_config=_apart(tiny_model_dir),
        )
        await engine.start()
        try:
            restored = asyncio.Event()
            engine.add_replica_restart_callback(lambda replica: restored.set())
            draft_pid = engine.running.pids["engine_1_draft"]
            old_pid = engine.running.pids["engine_1"]
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            await asyncio.wait_for(restored.wait(), 120)
            assert engine.replica_restarts == {"1": 1} and engine.draft_restarts == {}
            assert engine.running.pids["engine_1_draft"] == draft_pid  # it lived on

            async def one(index: int) -> Any:
                final = None
                async for output in engine.generate(
                    {"prompt_token_ids": PROMPTS[index]}, GREEDY[index]
                ):
                    final = output
                return final

            outputs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            for _ in range(100):  # the replicas' last stats follow their last outputs
                fresh = engine.replica_stats.get("1")
                if fresh is not None and fresh.spec_num_drafts > 0:
                    break
                await asyncio.sleep(0.1)
            return list(outputs), engine.replica_stats.get("1")
        finally:
            await engine.close()

    outputs, fresh = asyncio.run(run())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.greedy]
    assert fresh is not None and fresh.spec_num_drafts > 0  # the fresh replica drafted
    assert fresh.spec_num_accepted_tokens == fresh.spec_num_draft_tokens


@pytest.mark.slow
def test_drafts_that_come_late_are_never_used(tiny_model_dir: Path, plain: Plain) -> None:
    # a bound no answer meets: each step goes on without its drafts, and a late answer is
    # dropped when it arrives (its drafts follow tokens the target has passed)
    late = _spec(tiny_model_dir, placement="host", draft_timeout=1e-4)
    apart, stats = _generate(tiny_model_dir, GREEDY, speculative_config=late)
    assert [o.token_ids for o in apart] == [o.token_ids for o in plain.greedy]
    assert stats.spec_num_drafts_dropped > 0


@pytest.mark.slow
def test_a_drafter_that_raises_costs_the_drafts_not_the_requests(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the draft model beside the target (one process, transport memory): its third call
    # that drafts raises; the target decodes on without speculation
    from stages.execute.drafter import Drafter

    calls = 0
    propose = Drafter.propose

    def failing(self: Drafter, queries: Any, forget: Any = ()) -> Any:
        nonlocal calls
        if queries:
            calls += 1
            if calls == 3:
                raise RuntimeError("a drafter bug")
        return propose(self, queries, forget)

    monkeypatch.setattr(Drafter, "propose", failing)
    plain, _ = generate_with(tiny_model_dir, GREEDY, num_blocks=256)
    spec, stats = generate_with(
        tiny_model_dir, GREEDY, num_blocks=256, speculative_config=_spec(tiny_model_dir)
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert calls == 3  # it drafts no more after the failure
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_drafts_dropped > 0


@pytest.mark.slow
def test_a_draft_stage_that_cannot_draft_for_the_target_costs_only_the_drafts(
    tiny_model_dir: Path, tiny_gguf: Path, plain: Plain
) -> None:
    # a draft model of another vocabulary (512 tokens): beside the target it is refused as
    # the engine starts; apart, the draft stage says why it cannot draft and the target
    # decodes on without speculation
    apart, stats, info = _generate_info(
        tiny_model_dir, GREEDY, speculative_config=_apart(tiny_gguf)
    )
    assert [o.token_ids for o in apart] == [o.token_ids for o in plain.greedy]
    assert (info.draft_model, info.draft_num_blocks, info.draft_kv_cache_bytes) == ("", 0, 0)
    assert stats.spec_num_drafts == 0
    assert stats.spec_num_drafts_dropped > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_ray_the_draft_host_is_an_actor_whose_death_costs_only_drafts(
    tiny_model_dir: Path, ray_cluster: object, plain: Plain
) -> None:
    from tests.pipeline.runtime.test_ray_hosts import pipeline_state, wait_until_gone
    from tests.pipeline.runtime.test_running import run

    params = ON_RAY

    async def on_ray() -> None:
        engine = AsyncEngine(
            str(tiny_model_dir),
            num_blocks=256,
            ray=True,
            ray_num_cpus=0.5,
            speculative_config=_apart(tiny_model_dir),
        )
        await engine.start()
        try:

            async def one(prompt: list[int]) -> Any:
                last = None
                async for output in engine.generate({"prompt_token_ids": prompt}, params):
                    last = output
                return last

            drafted = await asyncio.gather(*(one(p) for p in PROMPTS))
            assert [o.token_ids for o in drafted] == [o.token_ids for o in plain.on_ray]
            assert engine.stats is not None and engine.stats.spec_num_drafts > 0
            actors, groups = pipeline_state(ray_cluster, "llm")
            assert len(actors) == 2 and groups == ["actorline:llm:replica0"]
            ray_cluster.kill(engine.running.ray_actor("engine_draft"))  # type: ignore[attr-defined]
            after = await asyncio.gather(*(one(p) for p in PROMPTS))
            assert [o.token_ids for o in after] == [o.token_ids for o in plain.on_ray]
            assert engine.failure is None and engine.replicas == []
        finally:
            await engine.close()
        await wait_until_gone(ray_cluster, "llm")

    run(on_ray, timeout=500)
