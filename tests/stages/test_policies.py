"""Tests of stages/policies.py: built-in orders and victims, sjf learning, plugin loading."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugins import (
    SCHEDULERS,
    PluginLoadError,
    PluginNotFoundError,
    PluginProtocolError,
    available,
)
from stages.policies import (
    API_VERSION,
    FcfsPolicy,
    PolicyConstructionError,
    PriorityPolicy,
    RequestView,
    SchedulingPolicy,
    ShortestJobFirstPolicy,
    StepObservation,
    load_policy,
)


@dataclasses.dataclass(frozen=True)
class View:
    """A plain RequestView for the tests."""

    request_id: str
    arrival_time: float = 0.0
    arrival_index: int = 0
    priority: int = 0
    num_prompt_tokens: int = 10
    num_output_tokens: int = 0
    max_tokens: int = 16
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    tenant: str = ""

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def ids(views: object) -> list[str]:
    return [view.request_id for view in views]  # type: ignore[attr-defined]


def test_view_satisfies_the_protocol() -> None:
    assert isinstance(View("a"), RequestView)
    for policy in (FcfsPolicy(), PriorityPolicy(), ShortestJobFirstPolicy()):
        assert isinstance(policy, SchedulingPolicy)
        assert policy.api_version == API_VERSION


def test_fcfs_orders_by_arrival_and_preempts_the_latest() -> None:
    policy = FcfsPolicy()
    waiting = [
        View("c", arrival_time=3.0, arrival_index=2),
        View("a", arrival_time=1.0, arrival_index=0),
        View("b", arrival_time=1.0, arrival_index=1),  # same time: the index decides
    ]
    assert ids(policy.order_waiting(waiting)) == ["a", "b", "c"]
    assert policy.select_victim(waiting).request_id == "c"
    assert policy.select_victim(waiting[1:]).request_id == "b"


def test_priority_orders_by_value_then_arrival_and_preempts_the_largest_value() -> None:
    policy = PriorityPolicy()
    waiting = [
        View("late-urgent", arrival_time=5.0, arrival_index=4, priority=-1),
        View("early-normal", arrival_time=1.0, arrival_index=0, priority=0),
        View("late-normal", arrival_time=2.0, arrival_index=1, priority=0),
        View("early-low", arrival_time=0.5, arrival_index=2, priority=7),
    ]
    order = ids(policy.order_waiting(waiting))
    assert order == ["late-urgent", "early-normal", "late-normal", "early-low"]
    assert policy.select_victim(waiting).request_id == "early-low"
    assert policy.select_victim(waiting[:3]).request_id == "late-normal"


def test_sjf_orders_by_predicted_remaining_work() -> None:
    policy = ShortestJobFirstPolicy(seconds_per_prefill_token=1.0, seconds_per_decode_token=10.0)
    short_prompt_long_output = View("a", num_prompt_tokens=5, max_tokens=100)  # 5 + 1000
    long_prompt_short_output = View("b", num_prompt_tokens=500, max_tokens=2)  # 500 + 20
    half_done = View(
        "c", num_prompt_tokens=400, num_output_tokens=98, max_tokens=100, num_computed_tokens=497
    )  # 1 + 20
    assert policy.predict_remaining(short_prompt_long_output) == pytest.approx(1005.0)
    assert policy.predict_remaining(half_done) == pytest.approx(21.0)
    views = [short_prompt_long_output, long_prompt_short_output, half_done]
    assert ids(policy.order_waiting(views)) == ["c", "b", "a"]
    assert policy.select_victim(views).request_id == "a"


def test_sjf_learning_changes_its_predictions() -> None:
    policy = ShortestJobFirstPolicy(
        seconds_per_prefill_token=1e-3, seconds_per_decode_token=1e-3, smoothing=0.5
    )
    prompt_heavy = View("prompt-heavy", num_prompt_tokens=1000, max_tokens=1)
    output_heavy = View("output-heavy", num_prompt_tokens=1, max_tokens=200)
    # With equal priors the 1000-token prompt looks like more work.
    assert ids(policy.order_waiting([prompt_heavy, output_heavy]))[0] == "output-heavy"
    # Observe cheap prefill (1e-5 s/token) and expensive decode (2e-2 s/token).
    for _ in range(30):
        policy.on_step(StepObservation(duration=0.01, num_prefill_tokens=1000, num_decode_tokens=0))
        policy.on_step(StepObservation(duration=0.2, num_prefill_tokens=0, num_decode_tokens=10))
    assert policy.seconds_per_prefill_token == pytest.approx(1e-5, rel=1e-3)
    assert policy.seconds_per_decode_token == pytest.approx(2e-2, rel=1e-3)
    assert ids(policy.order_waiting([prompt_heavy, output_heavy]))[0] == "prompt-heavy"


def test_sjf_mixed_steps_scale_both_rates() -> None:
    policy = ShortestJobFirstPolicy(
        seconds_per_prefill_token=1e-3, seconds_per_decode_token=1e-2, smoothing=1.0
    )
    predicted = 100 * 1e-3 + 10 * 1e-2
    policy.on_step(
        StepObservation(duration=2 * predicted, num_prefill_tokens=100, num_decode_tokens=10)
    )
    assert policy.seconds_per_prefill_token == pytest.approx(2e-3)
    assert policy.seconds_per_decode_token == pytest.approx(2e-2)
    # Empty or zero-length steps teach nothing.
    policy.on_step(StepObservation(duration=0.0, num_prefill_tokens=5, num_decode_tokens=0))
    policy.on_step(StepObservation(duration=1.0, num_prefill_tokens=0, num_decode_tokens=0))
    assert policy.seconds_per_prefill_token == pytest.approx(2e-3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seconds_per_prefill_token": 0.0},
        {"seconds_per_decode_token": -1.0},
        {"smoothing": 0.0},
        {"smoothing": 1.5},
    ],
)
def test_sjf_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ShortestJobFirstPolicy(**kwargs)


def test_step_observation_is_validated() -> None:
    with pytest.raises(ValueError, match="duration"):
        StepObservation(duration=-1.0, num_prefill_tokens=0, num_decode_tokens=0)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        StepObservation(duration=0.0, num_prefill_tokens=0, num_decode_tokens=-1)


def test_builtins_are_registered_entry_points() -> None:
    assert {"fcfs", "priority", "sjf"} <= set(available(SCHEDULERS))
    assert isinstance(load_policy("fcfs"), FcfsPolicy)
    assert isinstance(load_policy("priority"), PriorityPolicy)
    assert isinstance(load_policy("sjf"), ShortestJobFirstPolicy)


def test_unknown_policy_lists_the_available_ones() -> None:
    with pytest.raises(PluginNotFoundError, match=r"no-such-policy.*fcfs"):
        load_policy("no-such-policy")


# --------------------------------------------------------------- third-party plugins

PLUGIN_MODULE = "actorline_test_policies"

PLUGIN_SOURCE = textwrap.dedent(
    """
    class LastComeFirstServed:
        api_version = 1
        name = "lcfs"

        def order_waiting(self, waiting):
            return sorted(waiting, key=lambda r: -r.arrival_index)

        def select_victim(self, running):
            return min(running, key=lambda r: r.arrival_index)

        def on_arrival(self, request):
            pass

        def on_step(self, observation):
            pass

        def on_finish(self, request):
            pass


    class LacksVictim:
        api_version = 1
        name = "lacks-victim"

        def order_waiting(self, waiting):
            return list(waiting)

        def on_arrival(self, request):
            pass

        def on_step(self, observation):
            pass

        def on_finish(self, request):
            pass


    class ExplodingConstructor(LastComeFirstServed):
        name = "exploding"

        def __init__(self):
            raise RuntimeError("no GPU budget configured")
    """
)


@pytest.fixture
def plugin_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (a ``*.dist-info`` directory on sys.path) declaring
    scheduler entry points; removed again after the test."""
    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "actorline_test_broken.py").write_text("import module_that_does_not_exist\n")
    dist_info = tmp_path / "actorline_test_policies-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: actorline-test-policies\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""
            [{SCHEDULERS}]
            test-lcfs = {PLUGIN_MODULE}:LastComeFirstServed
            test-lacks-victim = {PLUGIN_MODULE}:LacksVictim
            test-exploding = {PLUGIN_MODULE}:ExplodingConstructor
            test-broken-import = actorline_test_broken:Policy
            test-missing-attr = {PLUGIN_MODULE}:NoSuchClass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield tmp_path
    finally:
        for module in (PLUGIN_MODULE, "actorline_test_broken"):
            sys.modules.pop(module, None)


def test_third_party_plugin_loads_and_works(plugin_distribution: Path) -> None:
    assert "test-lcfs" in available(SCHEDULERS)
    policy = load_policy("test-lcfs")
    assert policy.name == "lcfs"
    views = [View("a", arrival_index=0), View("b", arrival_index=1)]
    assert ids(policy.order_waiting(views)) == ["b", "a"]
    assert policy.select_victim(views).request_id == "a"


def test_plugin_lacking_a_method_is_refused(plugin_distribution: Path) -> None:
    with pytest.raises(PluginProtocolError, match=r"'test-lacks-victim'.*select_victim"):
        load_policy("test-lacks-victim")


def test_plugin_that_fails_to_import_is_refused(plugin_distribution: Path) -> None:
    with pytest.raises(
        PluginLoadError, match=r"'test-broken-import'.*module_that_does_not_exist"
    ) as info:
        load_policy("test-broken-import")
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(PluginLoadError, match=r"'test-missing-attr'.*NoSuchClass"):
        load_policy("test-missing-attr")


def test_plugin_whose_constructor_raises_is_refused(plugin_distribution: Path) -> None:
    with pytest.raises(
        PolicyConstructionError,
        match=r"'test-exploding'.*ExplodingConstructor.*RuntimeError: no GPU budget",
    ) as info:
        load_policy("test-exploding")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("test-exploding", PolicyConstructionError),
        ("test-lacks-victim", PluginProtocolError),
        ("test-broken-import", PluginLoadError),
    ],
)
def test_an_engine_with_a_bad_policy_fails_to_start_with_the_plugin_error(
    plugin_distribution: Path, tiny_model_dir: Path, name: str, error: type[Exception]
) -> None:
    """The engine checks its policy before anything starts: the caller gets the typed
    plugin error naming the plugin, not a stage failure from another process."""
    from pipeline import AsyncEngine

    async def body() -> None:
        engine = AsyncEngine(str(tiny_model_dir), scheduler=name)
        with pytest.raises(error, match=repr(name)):
            await engine.start()
        with pytest.raises(Exception, match="not started"):
            engine.running  # noqa: B018 - nothing was started

    asyncio.run(body())
