"""The plugin registry: discovery through real entry points, clear errors by group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import plugins
from pipeline import Pipeline, Stage
from pipeline.errors import GraphError
from stages.admit import AdmitStage
from stages.detokenize import DetokenizeStage
from stages.execute.null import NullExecuteStage
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
            from pipeline.stage import Stage

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
