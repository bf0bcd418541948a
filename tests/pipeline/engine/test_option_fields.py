"""Options declared once (:mod:`pipeline.engine.option_fields`): the checks each field's
declaration runs, the copies into the stage configs, and one option added end to end as one
field: its flag, its row of the docs' table and its copy appear from the field alone."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from pipeline.engine.option_fields import (
    KINDS,
    add_option_arguments,
    fed,
    flag_problems,
    flag_values,
    option,
    option_specs,
    options_table,
)
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline, start_options
from pipeline.server.limits import ListenerLimits


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"transport": "carrier-pigeon"}, "transport must be one of ('zmq', 'grpc', 'memory')"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"block_size": True}, "block_size must be an integer >= 1, got True"),
        ({"tune_gc": "yes"}, "tune_gc must be a boolean, got 'yes'"),
        ({"log_level": "LOUD"}, "log_level must be one of"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
        ({"compression": "gzip"}, "compression must be one of ('zstd',) or None"),
        ({"scheduler": ""}, "scheduler must be a policy name"),
        ({"router": ""}, "router must be a routing policy name"),
        ({"model": " "}, "model must be a non-empty alias or path"),
        ({"ray_address": ""}, "ray_address must be a non-empty string"),
        ({"ray_num_cpus": -1}, "ray_num_cpus must be a number >= 0"),
        ({"tensor_parallel_timeout": float("nan")}, "tensor_parallel_timeout must be a number"),
        ({"restart_backoff": float("inf")}, "restart_backoff must be a number of seconds >= 0"),
        ({"rate_limit_burst": "2"}, "rate_limit_burst must be a number of seconds > 0"),
        ({"grammar_max_rules": 0}, "grammar_max_rules must be"),
    ],
)
def test_a_declared_check_refuses_naming_the_field(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        EngineOptions(**options)
    assert str(caught.value).startswith(message), caught.value


def test_none_passes_where_the_default_is_none_and_any_case_for_the_log_level() -> None:
    options = EngineOptions(quantization=None, log_level="debug", ray_address=None)
    assert options.log_level == "debug"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineOptions(dtype=None)  # type: ignore[arg-type]


def test_every_declared_kind_is_known_and_every_field_declared() -> None:
    for cls in (EngineOptions, ListenerLimits):
        specs = dict(option_specs(cls))
        assert len(specs) == len(dataclasses.fields(cls)), cls
        for spec in specs.values():
            assert spec.help and "\n" not in spec.help
            assert spec.kind is None or spec.kind in KINDS
    with pytest.raises(ValueError, match="unknown option kind 'int>=2'"):
        option(1, help="x", kind="int>=2")


def _configs() -> dict[str, type]:
    from pipeline.runtime.running import StartOptions
    from stages.admit import AdmitConfig
    from stages.execute.config import ExecuteConfig
    from stages.route import RouterConfig
    from stages.schedule import ScheduleConfig
    from stages.scheduler import SchedulerConfig
    from stages.tokenize import TokenizeConfig

    return {
        "tokenize": TokenizeConfig,
        "execute": ExecuteConfig,
        "scheduler": SchedulerConfig,
        "schedule": ScheduleConfig,
        "admit": AdmitConfig,
        "router": RouterConfig,
        "start": StartOptions,
    }


def test_each_copy_names_a_field_of_its_stage_config() -> None:
    configs = _configs()
    for field, spec in option_specs(EngineOptions):
        for target in spec.feeds:
            config, _, renamed = target.partition(".")
            assert config in configs, f"{field.name} feeds unknown config {config!r}"
            names = {each.name for each in dataclasses.fields(configs[config])}
            assert (renamed or field.name) in names, f"{field.name} → {target}"


def test_the_built_pipeline_carries_the_copies() -> None:
    """Options other than the defaults reach each stage config through ``feeds``."""
    options = EngineOptions(
        dtype="bfloat16", num_blocks=64, max_num_seqs=7, max_num_batched_tokens=99,
        scheduler="priority", max_queued_requests=11, seed=5, block_size=32,
        data_parallel_size=2, router="prefix-affinity", compression="zstd",
        start_timeout=12.0, tune_gc=False, heartbeat_timeout=3.0, tool_call_parser="mistral",
        reasoning_parser="qwen3",
    )  # fmt: skip
    stages = llm_pipeline(options).stages
    tokenize = stages["tokenize"].config
    assert (tokenize.tool_call_parser, tokenize.reasoning_parser) == ("mistral", "qwen3")
    execute, schedule = stages["execute"].config, stages["schedule"].config
    assert (execute.dtype, execute.num_blocks, execute.seed, execute.block_size) == (
        "bfloat16", 64, 5, 32,
    )  # fmt: skip
    assert (schedule.scheduler.max_num_seqs, schedule.scheduler.max_num_batched_tokens) == (7, 99)
    assert schedule.policy == "priority"
    assert stages["admit"].config.max_queued_requests == 11
    assert (stages["router"].config.policy, stages["router"].config.block_size) == (
        "prefix-affinity", 32,
    )  # fmt: skip
    start = start_options(options)
    assert (start.compression, start.start_timeout, start.tune_gc) == ("zstd", 12.0, False)
    assert (start.heartbeat_timeout, start.heartbeat_interval) == (3.0, 0.6)
    assert fed(options, "execute")["tensor_parallel_size"] == 1


def _with_max_logprobs() -> type:
    """EngineOptions and one more field, declared as a contributor would add it: the whole
    diff of a new option is this one field (plus its use in the stage that reads it)."""
    return dataclasses.make_dataclass(
        "WithMaxLogprobs",
        [
            (
                "max_logprobs",
                int,
                option(
                    20,
                    help="the most logprobs a request may ask for",
                    kind="int>=1",
                    feeds=("execute",),
                ),
            )
        ],
        bases=(EngineOptions,),
        frozen=True,
    )


def test_one_option_added_end_to_end_as_one_field() -> None:
    extended = _with_max_logprobs()
    # the flag, on both commands, and its value back
    for command in ("generate", "serve"):
        parser = argparse.ArgumentParser()
        add_option_arguments(parser, extended, command)
        assert flag_problems(parser, extended, command) == []
        args = parser.parse_args(["--max-logprobs", "5"])
        assert flag_values(args, extended, command)["max_logprobs"] == 5
        assert parser.parse_args([]).max_logprobs == 20
    # its check and its copy into the execute stage's config
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 1, got 0"):
        extended(max_logprobs=0)
    assert fed(extended(max_logprobs=3), "execute")["max_logprobs"] == 3
    # its row of the docs' table
    row = "| `max_logprobs` | `--max-logprobs` | `20` | the most logprobs a request may ask for |"
    assert row + " `execute` |" in options_table(extended).splitlines()
    # a parser built before the field was added disagrees with it
    old = argparse.ArgumentParser()
    add_option_arguments(old, EngineOptions, "generate")
    assert flag_problems(old, extended, "generate") == [
        "max_logprobs: generate has no flag --max-logprobs"
    ]


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_is_refused_naming_the_option(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: no actorline.*no-such"):
        EngineOptions(**{field: "no-such"})
