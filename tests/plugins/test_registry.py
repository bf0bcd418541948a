"""The plugin registry: discovery through real entry points, clear errors by group."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import plugins
from pipeline import AsyncEngine, Pipeline, SamplingParams, Stage
from pipeline.runtime.errors import GraphError
from stages.admit import AdmitStage
from stages.detokenize import DetokenizeStage
from stages.execute.null import NullExecuteStage
from stages.route import RouterStage
from stages.schedule import ScheduleStage
from stages.stop_check import StopCheckStage
from stages.tokenize import TokenizeConfig, TokenizeStage
from transports.memory import MemoryTransport

#: the built-in stages, by registered name; ``execute`` (which imports torch) is checked apart
BUILTIN_STAGES: dict[str, type[Stage]] = {
    "tokenize": TokenizeStage,
    "admit": AdmitStage,
    "schedule": ScheduleStage,
    "null_execute": NullExecuteStage,
    "detokenize": DetokenizeStage,
    "stop_check": StopCheckStage,
}


@pytest.fixture
def distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (``*.dist-info`` on sys.path) with entry points in every
    group: good ones, one that fails to import, one that breaks its group's protocol."""
    package = tmp_path / "regtest_plugins"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """
            from pipeline.runtime.stage import Stage

            class Echo(Stage):
                pass

            class NotAStage:
                api_version = 1
                inputs = ("in",)

            class OldTransport:
                name = "old"
                api_version = 0
                def listen(self): ...
                def connect(self): ...
                def aclose(self): ...
            """
        )
    )
    (package / "broken.py").write_text("raise RuntimeError('kaboom at import')\n")
    dist_info = tmp_path / "regtest_plugins-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: regtest-plugins\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [actorline.stages]
            echo = regtest_plugins:Echo
            not-a-stage = regtest_plugins:NotAStage
            broken = regtest_plugins.broken:Thing

            [actorline.transports]
            old = regtest_plugins:OldTransport
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("regtest_plugins")]:
        del sys.modules[name]


def test_builtins_come_from_our_own_entry_points() -> None:
    assert {"memory", "zmq", "grpc"} <= set(plugins.available(plugins.TRANSPORTS))
    assert {"fcfs", "priority", "sjf"} <= set(plugins.available(plugins.SCHEDULERS))
    assert plugins.load(plugins.TRANSPORTS, "memory") is MemoryTransport


def test_builtin_stages_are_registered_and_satisfy_the_protocol() -> None:
    assert {*BUILTIN_STAGES, "execute"} <= set(plugins.available(plugins.STAGES))
    for name, stage_class in BUILTIN_STAGES.items():
        assert plugins.load(plugins.STAGES, name) is stage_class  # load() checks the protocol
    from stages.execute.stage import ExecuteStage

    assert plugins.load(plugins.STAGES, "execute") is ExecuteStage
    pipeline = Pipeline().add("t", "tokenize", TokenizeConfig("smollm2-135m"))
    assert pipeline["t"].factory is TokenizeStage
    assert pipeline["t"].config == TokenizeConfig("smollm2-135m")


def test_listing_stages_imports_neither_stages_nor_torch() -> None:
    """Listing names nothing to import; loading the light stages does not pull in torch."""
    script = textwrap.dedent(
        """
        import sys
        import plugins
        from pipeline import Pipeline

        names = plugins.available(plugins.STAGES)
        described = dict(plugins.describe()[plugins.STAGES])
        assert described["execute"] == "stages.execute.stage:ExecuteStage", described
        assert not [m for m in sys.modules if m == "stages" or m.startswith("stages.")]
        for name in names:
            if name != "execute":
                plugins.load(plugins.STAGES, name)
        Pipeline().add("t", "tokenize").add("n", "null_execute")
        assert "torch" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_unknown_name_lists_group_and_available_names() -> None:
    with pytest.raises(plugins.PluginNotFoundError) as error:
        plugins.load(plugins.TRANSPORTS, "pigeon")
    message = str(error.value)
    assert "actorline.transports" in message and "'pigeon'" in message
    assert "grpc, memory, zmq" in message
    with pytest.raises(plugins.PluginError, match="unknown plugin group"):
        plugins.load("actorline.nothing", "x")


def test_third_party_stage_loads_and_is_usable_by_name(distribution: Path) -> None:
    echo = plugins.load(plugins.STAGES, "echo")
    assert issubclass(echo, Stage)
    pipeline = Pipeline().add("e", "echo")
    assert pipeline["e"].factory is echo


def test_import_failure_names_plugin_and_cause(distribution: Path) -> None:
    with pytest.raises(plugins.PluginLoadError) as error:
        plugins.load(plugins.STAGES, "broken")
    assert "'broken'" in str(error.value) and "RuntimeError: kaboom at import" in str(error.value)
    with pytest.raises(GraphError, match="kaboom"):
        Pipeline().add("b", "broken")


def test_protocol_violations_are_named(distribution: Path) -> None:
    with pytest.raises(plugins.PluginProtocolError) as error:
        plugins.load(plugins.STAGES, "not-a-stage")
    message = str(error.value)
    assert "'not-a-stage'" in message
    assert "lacks method start()" in message and "lacks attribute 'outputs'" in message
    with pytest.raises(plugins.PluginProtocolError, match="api_version 0, the group needs 1"):
        plugins.load(plugins.TRANSPORTS, "old")


def test_describe_lists_without_importing(distribution: Path) -> None:
    described = plugins.describe()
    assert ("broken", "regtest_plugins.broken:Thing") in described[plugins.STAGES]
    assert "regtest_plugins.broken" not in sys.modules


# -- names registered twice -------------------------------------------------------------------


def _fake_distribution(root: Path, name: str, entry_points: str, package_source: str) -> None:
    """An installed distribution ``name`` (a ``*.dist-info`` under ``root``) whose package
    ``<name>_pkg`` holds ``package_source``."""
    package = root / f"{name}_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(package_source))
    dist_info = root / f"{name}-0.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (dist_info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


POLICY_SOURCE = """
    class Policy:
        api_version = 1
        name = "impostor"
        def order_waiting(self): ...
        def select_victim(self): ...
        def on_arrival(self): ...
        def on_step(self): ...
        def on_finish(self): ...
"""


@pytest.fixture
def conflicting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Two third-party distributions: each registers ``fcfs`` (a built-in name) and ``twin``
    (a name neither built-in nor unique); the first ``solo`` too. Their order on sys.path
    is the order they were made in, and must not matter."""
    for name in ("shadowplug", "otherplug"):
        lines = ["[actorline.schedulers]", f"fcfs = {name}_pkg:Policy", f"twin = {name}_pkg:Policy"]
        if name == "shadowplug":
            lines.append("solo = shadowplug_pkg:Policy")
        entry_points = "\n".join(lines) + "\n"
        _fake_distribution(tmp_path, name, entry_points, POLICY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in [m for m in sys.modules if m.endswith("plug_pkg")]:
        del sys.modules[module]


def test_a_builtin_name_resolves_to_the_builtin_and_the_shadowed_plugin_is_logged(
    conflicting: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stages.policies import FcfsPolicy

    with caplog.at_level(logging.WARNING, logger="actorline.plugins"):
        assert plugins.load(plugins.SCHEDULERS, "fcfs") is FcfsPolicy
    warnings = [record.getMessage() for record in caplog.records]
    for name in ("shadowplug", "otherplug"):
        assert any(
            f"{name}_pkg:Policy ({name} 0.3)" in message and "shadowed" in message
            for message in warnings
        ), warnings
    assert dict(plugins.describe()[plugins.SCHEDULERS])["fcfs"] == "stages.policies:FcfsPolicy"


def test_a_name_two_other_distributions_register_is_ambiguous(conflicting: Path) -> None:
    with pytest.raises(plugins.PluginConflictError) as error:
        plugins.load(plugins.SCHEDULERS, "twin")
    message = str(error.value)
    assert "'twin' is ambiguous" in message
    assert "shadowplug_pkg:Policy (shadowplug 0.3)" in message
    assert "otherplug_pkg:Policy (otherplug 0.3)" in message
    assert isinstance(error.value, plugins.PluginError)
    assert "twin" in plugins.available(plugins.SCHEDULERS)
    assert "twin" not in dict(plugins.describe()[plugins.SCHEDULERS])
    # a name only one of them registers loads as usual
    assert plugins.load(plugins.SCHEDULERS, "solo").name == "impostor"


def test_conflicts_are_the_same_whatever_the_order_on_sys_path(
    conflicting: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.policies import FcfsPolicy

    before = plugins.conflicts(plugins.SCHEDULERS)
    monkeypatch.syspath_prepend(str(conflicting))  # now also before actorline's own
    monkeypatch.setattr(sys, "path", list(reversed(sys.path)))
    assert plugins.conflicts(plugins.SCHEDULERS) == before
    assert plugins.load(plugins.SCHEDULERS, "fcfs") is FcfsPolicy
    by_name = {conflict.name: conflict for conflict in before}
    assert set(by_name) == {"fcfs", "twin"}
    assert by_name["fcfs"].chosen is not None
    assert by_name["fcfs"].chosen.startswith("stages.policies:FcfsPolicy (actorline ")
    assert len(by_name["fcfs"].others) == 2 and not by_name["fcfs"].ambiguous
    assert by_name["twin"].ambiguous and len(by_name["twin"].others) == 2


def test_the_cli_lists_shadowed_and_ambiguous_plugins(conflicting: Path) -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(conflicting), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "plugins"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(
        "fcfs" in line and "shadowplug_pkg:Policy (shadowplug 0.3)" in line and "shadowed" in line
        for line in lines
    ), result.stdout
    assert any(
        "twin" in line
        and "AMBIGUOUS" in line
        and "otherplug 0.3" in line
        and "shadowplug 0.3" in line
        for line in lines
    ), result.stdout
    assert any(line.split() == ["fcfs", "stages.policies:FcfsPolicy"] for line in lines)


# -- a third-party routing policy --------------------------------------------------------------

ROUTER_SOURCE = """
    class LastReplica:
        '''Every request to the replica whose name sorts last.'''

        api_version = 1
        name = "last-replica"

        def __init__(self):
            self.chosen = []
            self.forgotten = []

        def choose(self, request, replicas):
            name = max(replica.name for replica in replicas)
            self.chosen.append((request.request_id, name))
            return name

        def forget_replica(self, name):
            self.forgotten.append(name)
"""


@pytest.fixture
def router_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An installed distribution ``routerplug`` registering the routing policy
    ``last-replica`` in ``actorline.routers``."""
    entry_points = "[actorline.routers]\nlast-replica = routerplug_pkg:LastReplica\n"
    _fake_distribution(tmp_path, "routerplug", entry_points, ROUTER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("routerplug_pkg", None)


@pytest.mark.slow
def test_a_third_party_router_is_chosen_by_name(router_plugin: Path, tiny_model_dir: Path) -> None:
    """``router="last-replica"`` on a DP=2 engine (null model) loads the plugin from its entry
    point (docs/parallelism.md, "Policies are plugins"), and the router stage routes by it:
    every request to replica 1, none to replica 0."""
    assert "last-replica" in plugins.available(plugins.ROUTERS)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = {f"r{index}": f"question {index} about rivers" for index in range(4)}

    async def body() -> None:
        async with AsyncEngine(
            str(tiny_model_dir), null_model=True, data_parallel_size=2, router="last-replica"
        ) as engine:

            async def complete(name: str) -> int:
                last = None
                async for output in engine.generate(prompts[name], params, request_id=name):
                    last = output
                assert last is not None and last.finish_reason == "length"
                return len(last.token_ids)

            lengths = await asyncio.gather(*(complete(name) for name in prompts))
            assert lengths == [params.max_tokens] * len(prompts)
            router = engine.running.stage("router")
            assert isinstance(router, RouterStage)
            policy = router.policy
            assert type(policy).__module__ == "routerplug_pkg"
            chosen: list[tuple[str, str]] = vars(policy)["chosen"]  # the plugin's own record
            assert sorted(rid.partition("#")[0] for rid, _ in chosen) == sorted(prompts)
            assert {replica for _, replica in chosen} == {"1"}
            assert router.routed == {"1": len(prompts)}
            assert set(engine.replica_stats) == {"1"}  # replica 0 never sent an output

    asyncio.run(asyncio.wait_for(body(), 300))
