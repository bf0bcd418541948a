"""The CLI's flags and the declared option fields agree (pipeline.engine.option_fields): every
field a command takes has its flag with the field's default, choices and type, and no flag of
an option group sets a field nobody declared; an injected disagreement is caught. The docs'
option tables are the ones the fields render."""

from __future__ import annotations

import argparse

import pytest

from pipeline.cli.main import build_parser
from pipeline.cli.options_doc import DOC, REGENERATE, render
from pipeline.engine.option_fields import add_option_arguments, flag_problems
from pipeline.engine.options import EngineOptions
from pipeline.server.limits import ListenerLimits


def _command(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        (commands,) = [
            action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
        ]
        parser = commands.choices[name]
    return parser


@pytest.mark.parametrize(
    ("command", "cls"),
    [("generate", EngineOptions), ("serve", EngineOptions), ("serve", ListenerLimits)],
)
def test_each_commands_flags_agree_with_the_fields(command: str, cls: type) -> None:
    assert flag_problems(_command(build_parser(), command), cls, command) == []


@pytest.mark.parametrize(("benchmark", "names"), [
    ("ceiling", ("model", "transport", "tune_gc")),
    ("online", ("model", "transport")),
    ("offline", ("model",)),
])  # fmt: skip
def test_the_benchmarks_engine_flags_are_the_fields(benchmark: str, names: tuple[str]) -> None:
    parser = _command(build_parser(), "bench", benchmark)
    actions = {action.dest: action for action in parser._actions}
    reference = argparse.ArgumentParser()
    add_option_arguments(reference, EngineOptions, "generate")
    from pipeline.engine.option_fields import add_option_argument

    add_option_argument(reference, EngineOptions, "tune_gc")
    expected = {action.dest: action for action in reference._actions}
    for name in names:
        got, want = actions[name], expected[name]
        assert (got.option_strings, got.default, got.choices, got.type) == (
            want.option_strings, want.default, want.choices, want.type,
        ), name  # fmt: skip


def test_an_injected_disagreement_is_caught() -> None:
    def parser() -> argparse.ArgumentParser:
        built = argparse.ArgumentParser()
        add_option_arguments(built, EngineOptions, "serve")
        return built

    def action(built: argparse.ArgumentParser, dest: str) -> argparse.Action:
        return next(each for each in built._actions if each.dest == dest)

    assert flag_problems(parser(), EngineOptions, "serve") == []
    changed = parser()
    action(changed, "max_num_seqs").default = 128
    assert flag_problems(changed, EngineOptions, "serve") == [
        "max_num_seqs: flag default 128, field default 256"
    ]
    changed = parser()
    action(changed, "transport").choices = ("zmq", "memory")
    assert flag_problems(changed, EngineOptions, "serve")[0].startswith(
        "transport: flag choices ('zmq', 'memory')"
    )
    changed = parser()
    action(changed, "max_num_batched_tokens").type = float
    assert "max_num_batched_tokens: flag type" in flag_problems(changed, EngineOptions, "serve")[0]
    changed = parser()
    (engine,) = [group for group in changed._action_groups if group.title == "engine"]
    engine.add_argument("--max-batch", type=int, dest="max_batch")
    assert flag_problems(changed, EngineOptions, "serve") == [
        "--max-batch: sets 'max_batch', which no field declares"
    ]
    # a flag of the field's name that sets something else, and a field with no flag at all
    changed = argparse.ArgumentParser()
    add_option_arguments(changed, ListenerLimits, "serve")
    changed.add_argument("--max-num-seqs", dest="seqs", type=int, default=256)
    problems = flag_problems(changed, EngineOptions, "generate")
    assert "--max-num-seqs: sets 'seqs', which no field declares" in problems
    assert "model: generate has no flag --model" in problems
    # a serve-only flag on generate
    changed = parser()
    assert "restart_engine: generate has its flag, the field says not" in flag_problems(
        changed, EngineOptions, "generate"
    )


def test_the_docs_option_tables_are_the_generated_ones() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "<!-- options-table: EngineOptions -->" in text
    assert render(text) == text, f"docs/options.md is stale; regenerate it: {REGENERATE}"


def test_every_flag_spelled_before_still_parses() -> None:
    """The flags the CLI had before they were derived, each still spelled the same."""
    generate = _command(build_parser(), "generate")
    args = generate.parse_args([
        "hi", "--model", "m", "--transport", "grpc", "--compression", "zstd", "--scheduler",
        "priority", "--dtype", "bfloat16", "--device", "cuda", "--quantization", "int8",
        "--model-impl", "native", "--attention-backend", "flex", "--max-model-len", "64",
        "--max-num-seqs", "3", "--max-num-batched-tokens", "9", "--num-blocks", "4",
        "--kv-cache-memory", "1024", "--no-prefix-caching", "--grammar-max-rules", "5",
        "--grammar-max-chars", "6", "--tensor-parallel-size", "2", "--data-parallel-size", "2",
        "--router", "round-robin", "--ray", "--ray-num-cpus", "2", "--ray-num-gpus", "0.5",
    ])  # fmt: skip
    from pipeline.cli.llm import engine_options_from

    values = engine_options_from(args)
    assert values["enable_prefix_caching"] is False and values["ray"] is True
    assert values["ray_address"] is None and values["ray_num_gpus"] == 0.5
    assert values["max_num_seqs"] == 3 and values["dtype"] == "bfloat16"
    serve = _command(build_parser(), "serve")
    args = serve.parse_args([
        "--ray", "auto", "--log-level", "debug", "--requests-per-second", "2",
        "--tokens-per-second", "3", "--rate-limit-burst", "4", "--no-restart-engine",
        "--restart-backoff", "1", "--restart-limit", "2", "--restart-window", "9",
        "--heartbeat-timeout", "5", "--max-connections", "7", "--header-timeout", "1",
        "--body-timeout", "2", "--keep-alive-timeout", "3", "--grpc-idle-timeout", "4",
        "--max-streams-per-connection", "5", "--max-streams", "6", "--max-logprob-entries", "8",
    ])  # fmt: skip
    values = engine_options_from(args)
    assert (values["ray"], values["ray_address"], values["log_level"]) == (True, "auto", "DEBUG")
    assert values["restart_engine"] is False and values["rate_limit_burst"] == 4.0
    assert serve.parse_args([]).restart_engine is True  # on under serve
    assert args.max_logprob_entries == 8 and args.grpc_idle_timeout == 4.0
