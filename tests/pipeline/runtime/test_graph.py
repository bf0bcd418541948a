"""The pipeline graph: building, editing, placement and validation."""

from __future__ import annotations

import pytest

from pipeline import GraphError, Pipeline, Stage, handles
from pipeline.demo import Check, Split, Step, collatz_pipeline
from pipeline.runtime.spec import BOUNDARY, Endpoint


class Passthrough(Stage):
    @handles(object)
    async def forward(self, message: object) -> None:
        await self.emit("out", message)


class TwoInputs(Stage):
    inputs = ("left", "right")
    outputs = ("out",)


def link_pairs(pipeline: Pipeline) -> set[tuple[str, str]]:
    return {(str(link.source), str(link.target)) for link in pipeline.links}


def test_build_with_default_ports_and_feedback_edge() -> None:
    pipeline = collatz_pipeline()
    assert link_pairs(pipeline) == {
        ("split.out", "step.in"),
        ("step.out", "check.in"),
        ("check.again", "step.in"),
        ("check.credit", "split.credit"),
        (f"{BOUNDARY}.jobs", "split.in"),
        ("check.out", f"{BOUNDARY}.results"),
    }
    assert pipeline.entries == ["jobs"] and pipeline.exits == ["results"]
    pipeline.validate()
    assert "check.again -> step.in" in pipeline.describe()


def test_ambiguous_port_must_be_named() -> None:
    pipeline = Pipeline().add("check", Check).add("step", Step)
    with pytest.raises(GraphError, match=r"check.*3 output ports.*'check.<port>'"):
        pipeline.connect("check", "step")
    with pytest.raises(GraphError, match="no output port 'nope'"):
        pipeline.connect("check.nope", "step")
    with pytest.raises(GraphError, match=r"no stage named 'missing'.*stages: check, step"):
        pipeline.connect("missing", "step")


def test_duplicate_names_and_links_are_refused() -> None:
    pipeline = Pipeline().add("a", Passthrough).add("b", Passthrough)
    with pytest.raises(GraphError, match="already exists"):
        pipeline.add("a", Passthrough)
    pipeline.connect("a", "b")
    with pytest.raises(GraphError, match="already exists"):
        pipeline.connect("a", "b")
    with pytest.raises(GraphError, match="invalid stage name"):
        pipeline.add("a.b", Passthrough)
    with pytest.raises(GraphError, match="not a Stage subclass"):
        pipeline.add("c", int)  # type: ignore[arg-type]


def test_insert_after_rewires_every_outgoing_link() -> None:
    pipeline = collatz_pipeline().place("step", "worker")
    pipeline.insert("tap", Passthrough, after="step")
    pairs = link_pairs(pipeline)
    assert ("step.out", "tap.in") in pairs and ("tap.out", "check.in") in pairs
    assert ("step.out", "check.in") not in pairs
    assert pipeline["tap"].host == "worker"  # placed with its neighbour


def test_insert_before_and_remove_bypasses() -> None:
    pipeline = collatz_pipeline()
    pipeline.insert("tap", Passthrough, before="check")
    pairs = link_pairs(pipeline)
    assert ("step.out", "tap.in") in pairs and ("tap.out", "check.in") in pairs
    pipeline.remove("tap")
    assert link_pairs(pipeline) == link_pairs(collatz_pipeline())


def test_insert_needs_one_in_one_out() -> None:
    with pytest.raises(GraphError, match="one input and one output"):
        collatz_pipeline().insert("x", TwoInputs, after="step")
    with pytest.raises(GraphError, match="exactly one of"):
        collatz_pipeline().insert("x", Passthrough)


def test_replace_keeps_links_and_checks_ports() -> None:
    pipeline = collatz_pipeline().place("check", "worker")
    pipeline.replace("step", Passthrough)
    assert pipeline["step"].factory is Passthrough
    assert link_pairs(pipeline) == link_pairs(collatz_pipeline())
    with pytest.raises(GraphError, match="has no output port 'again'"):
        pipeline.replace("check", Passthrough)
    assert pipeline["check"].host == "worker"


def test_place_and_hosts() -> None:
    pipeline = collatz_pipeline().place("step", "engine").place("check", "engine")
    assert pipeline.hosts == ["main", "engine"]
    assert pipeline["split"].host == "main"


def test_copy_is_independent() -> None:
    original = collatz_pipeline()
    twin = original.copy().insert("tap", Passthrough, after="split")
    assert "tap" in twin and "tap" not in original
    assert link_pairs(original) == link_pairs(collatz_pipeline())


def test_disconnect_and_validate_entry() -> None:
    pipeline = Pipeline().add("split", Split).add("step", Step)
    pipeline.connect("split", "step").disconnect("split", "step")
    assert pipeline.links == []
    with pytest.raises(GraphError, match="no link"):
        pipeline.disconnect("split", "step")
    pipeline.entry("jobs")
    with pytest.raises(GraphError, match="entry 'jobs' is linked to no stage"):
        pipeline.validate()
    assert Endpoint("a", "b") < Endpoint("b", "a")


def snapshot(pipeline: Pipeline) -> tuple[object, ...]:
    """Everything a pipeline is made of, in order (specs and links compare by value)."""
    return (pipeline.stages, pipeline.links, pipeline.entries, pipeline.exits, pipeline.describe())


def test_remove_bypass_yields_distinct_links_in_order() -> None:
    pipeline = Pipeline().add("a", Passthrough).add("b", Passthrough).add("c", Passthrough)
    pipeline.connect("a", "b").connect("a", "c").connect("b", "c")
    pipeline.remove("b")
    assert [str(link) for link in pipeline.links] == ["a.out -> c.in"]

    # two feeders and two targets: each bypass link once, existing links first, then feeder by
    # feeder in link order; a new bypass link keeps the outgoing link's transport
    pipeline = Pipeline()
    for name in ("x", "y", "mid", "p", "q"):
        pipeline.add(name, Passthrough)
    pipeline.connect("x", "p").connect("x", "mid").connect("y", "mid")
    pipeline.connect("mid", "p", transport="grpc").connect("mid", "q", transport="zmq")
    pipeline.remove("mid")
    assert [(str(link), link.transport) for link in pipeline.links] == [
        ("x.out -> p.in", None),
        ("x.out -> q.in", "zmq"),
        ("y.out -> p.in", "grpc"),
        ("y.out -> q.in", "zmq"),
    ]
    assert "mid" not in pipeline


def test_remove_bypass_of_a_self_loop_and_of_the_boundary() -> None:
    pipeline = Pipeline().add("a", Passthrough).add("b", Passthrough)
    pipeline.connect("a", "b").connect("b", "b").connect("b", "a")
    pipeline.entry("in", "b").exit("out", "b")
    pipeline.remove("b")
    assert [str(link) for link in pipeline.links] == [
        "a.out -> a.in",
        f"a.out -> {BOUNDARY}.out",
        f"{BOUNDARY}.in -> a.in",
        f"{BOUNDARY}.in -> {BOUNDARY}.out",
    ]
    pipeline.validate()


def test_failed_entry_or_exit_leaves_the_graph_unchanged() -> None:
    pipeline = collatz_pipeline()
    before = snapshot(pipeline)
    with pytest.raises(GraphError, match="no stage named 'missing'"):
        pipeline.entry("more", "step", "missing")
    with pytest.raises(GraphError, match=r"3 output ports"):
        pipeline.exit("more", "split.out", "check")
    with pytest.raises(GraphError, match="already exists"):
        pipeline.entry("results", "step")
    with pytest.raises(GraphError, match="invalid exit name"):
        pipeline.exit("a.b", "split")
    assert snapshot(pipeline) == before
    # the failed names were not taken
    pipeline.entry("more", "step").exit("extra", "split.out")
    assert pipeline.entries == ["jobs", "more"] and pipeline.exits == ["results", "extra"]


def test_entry_and_exit_refuse_a_port_named_twice() -> None:
    pipeline = collatz_pipeline()
    before = snapshot(pipeline)
    with pytest.raises(GraphError, match=r"entry 'more' names step.in twice"):
        pipeline.entry("more", "step", "step.in")
    with pytest.raises(GraphError, match=r"exit 'extra' names check.out twice"):
        pipeline.exit("extra", "check.out", "check.out")
    assert snapshot(pipeline) == before


def test_failed_edits_leave_the_graph_unchanged() -> None:
    pipeline = collatz_pipeline().place("check", "worker")
    pipeline.connect("split", "check")
    before = snapshot(pipeline)
    failing = [
        lambda: pipeline.add("step", Passthrough),
        lambda: pipeline.add("new", Passthrough, host=""),
        lambda: pipeline.connect("split", "step"),
        lambda: pipeline.connect("split", "missing"),
        lambda: pipeline.disconnect("step", "split.in"),
        lambda: pipeline.disconnect("missing", "step"),
        lambda: pipeline.place("step", ""),
        lambda: pipeline.place("missing", "worker"),
        lambda: pipeline.insert("step", Passthrough, after="split"),
        lambda: pipeline.insert("tap", Passthrough, after="missing"),
        lambda: pipeline.insert("tap", Passthrough, before="check.again"),
        lambda: pipeline.insert("tap", Passthrough, after="split", host=""),
        lambda: pipeline.insert("a.b", Passthrough, before="check"),
        lambda: pipeline.replace("check", Passthrough),
        lambda: pipeline.replace("missing", Passthrough),
        lambda: pipeline.remove("missing"),
    ]
    for edit in failing:
        with pytest.raises(GraphError):
            edit()
        assert snapshot(pipeline) == before


def test_validate_refuses_an_exit_nothing_feeds() -> None:
    pipeline = Pipeline().add("split", Split).add("step", Step).connect("split", "step")
    pipeline.entry("jobs", "split.in").exit("results")
    with pytest.raises(GraphError, match="exit 'results' is fed by no stage"):
        pipeline.validate()
    # removing a stage that cannot be bypassed drops its links and can orphan an exit
    pipeline = collatz_pipeline().remove("check")
    with pytest.raises(GraphError, match="exit 'results' is fed by no stage"):
        pipeline.validate()


def test_an_output_linked_to_nothing_is_refused_unless_optional() -> None:
    pipeline = Pipeline().add("a", Passthrough).add("b", Passthrough)
    pipeline.entry("in", "a").exit("out", "b").connect("a", "b")
    pipeline.validate()
    lost = Pipeline().add("a", Passthrough).entry("in", "a")
    with pytest.raises(GraphError, match=r"output a\.out is linked to nothing"):
        lost.validate()

    class Sink(Stage):
        outputs = ("out", "debug")
        optional_outputs = ("debug",)

    fine = Pipeline().add("s", Sink).entry("in", "s").exit("out", "s.out")
    fine.validate()
    with pytest.raises(TypeError, match="optional output 'nope'"):
        type("Bad", (Stage,), {"optional_outputs": ("nope",)})


def test_removing_a_stage_that_cannot_be_bypassed_is_caught_before_start() -> None:
    class Fork(Stage):
        outputs = ("out", "side")

    pipeline = Pipeline().add("a", Passthrough).add("fork", Fork)
    pipeline.add("b", Passthrough).add("c", Passthrough).entry("in", "a")
    pipeline.connect("a", "fork").connect("fork.out", "b").connect("fork.side", "c")
    pipeline.exit("main", "b").exit("side", "c")
    pipeline.validate()
    # Two outputs: removing fork drops its links (no bypass), leaving a's output dangling.
    pipeline.remove("fork")
    with pytest.raises(GraphError, match=r"output a\.out is linked to nothing"):
        pipeline.validate()


def test_handler_signatures_are_checked_when_the_class_is_defined() -> None:
    with pytest.raises(TypeError, match="must be an 'async def'"):

        class Sync(Stage):
            @handles(int)
            def on_int(self, message: int) -> None: ...

    with pytest.raises(TypeError, match=r"must take \(self, message\)"):

        class NoMessage(Stage):
            @handles(int)
            async def on_int(self) -> None: ...

    with pytest.raises(TypeError, match=r"handle must take \(self, message, port\)"):

        class NoPort(Stage):
            async def handle(self, message: object) -> None:  # type: ignore[override]
                ...
