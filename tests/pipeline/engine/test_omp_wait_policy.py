"""``omp_wait_policy`` end to end: the option reaches the spawned engine process's environment
before torch loads there (pipeline.runtime.omp_policy), the engine reports the policy in
effect (``EngineInfo``, the model-info RPC) and the thread count its steps run on
(``EngineStats.execute_threads``, the ``actorline_execute_threads`` gauge), and a bad value is
refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline import AsyncEngine, SamplingParams
from pipeline.runtime.omp_policy import POLICY_ENV, USER_VARIABLES

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def no_user_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*USER_VARIABLES, POLICY_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow  # an engine process each
@pytest.mark.usefixtures("no_user_setting")
@pytest.mark.parametrize(
    ("policy", "in_effect"),
    [("passive", "passive (OMP_WAIT_POLICY=PASSIVE)"), ("auto", "auto (GOMP_SPINCOUNT=")],
)
def test_the_engine_process_runs_the_policy(
    tiny_model_dir: Path, policy: str, in_effect: str
) -> None:
    async def run() -> tuple[str, int]:
        async with AsyncEngine(
            str(tiny_model_dir),
            transport="zmq",
            num_blocks=64,
            omp_wait_policy=policy,
            heartbeat_timeout=120.0,
        ) as engine:
            async for _ in engine.generate("Hello there", GREEDY):
                pass
            assert engine.info is not None and engine.stats is not None
            return engine.info.omp_wait_policy, engine.stats.execute_threads

    reported, threads = asyncio.run(asyncio.wait_for(run(), 300))
    assert reported.startswith(in_effect), reported
    assert threads >= 1


@pytest.mark.slow
@pytest.mark.usefixtures("no_user_setting")
def test_a_variable_the_user_set_wins(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "1234")

    async def run() -> str:
        async with AsyncEngine(
            str(tiny_model_dir), transport="zmq", num_blocks=64, heartbeat_timeout=120.0
        ) as engine:
            assert engine.info is not None
            return engine.info.omp_wait_policy

    assert asyncio.run(asyncio.wait_for(run(), 300)) == "user (GOMP_SPINCOUNT=1234)"


def test_a_bad_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="omp_wait_policy must be one of"):
        AsyncEngine("smollm2-135m", omp_wait_policy="spin")
