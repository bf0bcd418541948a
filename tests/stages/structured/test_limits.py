"""Issue 34: a grammar cannot hurt the engine. Tests of stages/structured/limits.py (what the
bounds count, the typed refusal naming the bound), of the compile thread (its own stack,
nobody else's), and the proof that the stack is sized to the bounds: the largest grammar the
default bounds admit, in each shape that makes llguidance recurse (a chain of Lark rules, of
GBNF rules (a quarter as many), of ``$ref`` / ``allOf`` / property ``$ref`` links),
compiles on it, and its
masks fill on llguidance's executor threads token after token; the same chain on an 8 MiB
thread kills its process, which is why the stack is sized."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from stages.errors import InvalidRequestError
from stages.structured.backend import BITMASK_DTYPE, GrammarCompileError, bitmask_width
from stages.structured.limits import (
    DEFAULT_MAX_RULES,
    GBNF_SHARE,
    MAX_RULES_LIMIT,
    GrammarLimits,
    check_grammar_limits,
    compile_stack_bytes,
    count_rules,
)
from stages.structured.llguidance import LLGuidanceBackend
from stages.structured.manager import CompileThread, GrammarConfig, GrammarManager
from stages.structured.params import MAX_SPEC_CHARS, StructuredOutputsParams
from tests.stages.structured.grammar_chains import (
    chain_schema,
    gbnf_chain,
    lark_chain,
    schema_objects_per_link,
)

EOS = 2


def test_what_the_bound_counts() -> None:
    lark = 'start: item+\n?item: WORD | NUM\n!op.2: "+"\nWORD: /[a-z]+/\nNUM{x}: /[0-9]+/\n| "x"'
    assert count_rules(StructuredOutputsParams(grammar=lark)) == 5
    gbnf = 'root ::= a b\na ::= "x"\n  | "y"\nb-c ::= [0-9]+'
    assert count_rules(StructuredOutputsParams(grammar=gbnf)) == 3
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "x": [{}]}'
    assert count_rules(StructuredOutputsParams(json=schema)) == 4  # 2 schemas, a map, an {}
    # an embedded schema counts every brace, conservatively
    nested = 'start: %json { "type": "object", "properties": { "a": {} } }'
    assert count_rules(StructuredOutputsParams(grammar=nested)) == 1 + 3
    for params in (
        StructuredOutputsParams(regex="a{1000000}"),
        StructuredOutputsParams(choice=("a", "b")),
        StructuredOutputsParams(json_object=True),
    ):
        assert count_rules(params) == 0
    assert count_rules(StructuredOutputsParams(grammar=lark_chain(3000))) == 3000
    assert count_rules(StructuredOutputsParams(grammar=gbnf_chain(12000))) == 12000
    for link, per in schema_objects_per_link.items():
        params = StructuredOutputsParams(json=chain_schema(3000, link))
        assert count_rules(params) == 3 + 2999 * per  # the root, $defs, the links, the end


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        (
            StructuredOutputsParams(grammar=lark_chain(12000)),
            "structured_outputs.grammar",
            ["12000 rules", "at most 4000", "grammar_max_rules"],
        ),
        (
            StructuredOutputsParams(grammar=gbnf_chain(3000)),
            "structured_outputs.grammar",
            ["3000 GBNF rules", "at most 1000", "a quarter of the engine's grammar_max_rules"],
        ),
        (
            StructuredOutputsParams(json=chain_schema(3000, "allOf")),
            "structured_outputs.json",
            ["6001 objects", "at most 4000", "grammar_max_rules"],
        ),
        (
            StructuredOutputsParams(json=chain_schema(3000, "property")),
            "structured_outputs.json",
            ["9000 objects"],
        ),
    ],
)
def test_over_a_bound_is_an_invalid_request_naming_it(
    params: StructuredOutputsParams, field: str, words: list[str]
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_grammar_limits(params, GrammarLimits(), request_id="r1")
    assert caught.value.field == field
    assert caught.value.request_id == "r1"
    for word in words:
        assert word in str(caught.value)


def test_the_size_bound_and_the_options_validation() -> None:
    small = GrammarLimits(max_chars=100)
    with pytest.raises(InvalidRequestError, match=r"at most 100 characters .*grammar_max_chars"):
        check_grammar_limits(StructuredOutputsParams(regex="a" * 101), small)
    check_grammar_limits(StructuredOutputsParams(regex="a" * 100), small)
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.choice"):
        check_grammar_limits(StructuredOutputsParams(choice=("x" * 60, "y" * 60)), small)
    for bad in (
        {"max_rules": 0},
        {"max_rules": MAX_RULES_LIMIT + 1},
        {"max_rules": True},
        {"max_chars": MAX_SPEC_CHARS + 1},
        {"max_chars": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GrammarLimits(**bad)
    with pytest.raises(ValueError, match="limits"):
        GrammarConfig("m", limits=1000)  # type: ignore[arg-type]
    assert compile_stack_bytes(GrammarLimits(max_rules=1000)) < compile_stack_bytes(
        GrammarLimits(max_rules=2000)
    )


def test_the_compile_thread_has_its_own_stack_and_leaves_everyone_elses() -> None:
    before = threading.stack_size()
    pool = CompileThread(64 * 1024 * 1024, name="test-grammar")
    try:
        names = {pool.submit(lambda: threading.current_thread().name).result(timeout=30)}
        names.add(pool.submit(lambda: threading.current_thread().name).result(timeout=30))
        assert names == {"test-grammar"}  # one thread, reused
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 // 0).result(timeout=30)
    finally:
        pool.shutdown(wait=True)
    assert threading.stack_size() == before
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)


def allowed(backend: LLGuidanceBackend, matchers: list[Any]) -> list[set[int]]:
    bitmask = np.zeros((len(matchers), bitmask_width(backend.vocab_size)), BITMASK_DTYPE)
    backend.fill_bitmask(matchers, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return [set(np.flatnonzero(row).tolist()) for row in bits]


def at_the_bound() -> list[tuple[str, StructuredOutputsParams]]:
    """The largest constraint of each recursive shape that the default bound admits."""
    shapes = [("lark", StructuredOutputsParams(grammar=lark_chain(DEFAULT_MAX_RULES)))]
    for link, per in schema_objects_per_link.items():
        depth = (DEFAULT_MAX_RULES - 3) // per + 1
        shapes.append((link, StructuredOutputsParams(json=chain_schema(depth, link))))
    gbnf = gbnf_chain(DEFAULT_MAX_RULES // GBNF_SHARE)
    shapes.append(("gbnf", StructuredOutputsParams(grammar=gbnf)))
    return shapes


@pytest.mark.slow
def test_the_largest_grammars_the_bounds_admit_compile_and_match_on_the_compile_thread(
    tokenizer: Any,
) -> None:
    manager = GrammarManager(GrammarConfig("smollm2-135m"), tokenizer_loader=lambda _: tokenizer)
    manager.set_engine_info(49152, [2])
    pool = manager.compile_thread()
    try:
        for name, params in at_the_bound():
            count = count_rules(params)
            most = DEFAULT_MAX_RULES // GBNF_SHARE if name == "gbnf" else DEFAULT_MAX_RULES
            assert most - 3 <= count <= most, (name, count)
            compiled = pool.submit(manager.compile, params, request_id=name).result(timeout=300)
            backend = manager.backend()
            assert isinstance(backend, LLGuidanceBackend)
            # a batch of two matchers, on the executor's threads, for a few tokens each
            matchers = [compiled.matcher(), compiled.matcher()]
            for _ in range(3):
                rows = allowed(backend, matchers)
                for matcher, row in zip(matchers, rows, strict=True):
                    assert row, name
                    if name in ("lark", "gbnf"):
                        assert EOS not in row, name  # the chain is not complete yet
                    assert matcher.accept_token(min(row)), name
                    assert matcher.error() is None
    finally:
        pool.shutdown()


CRASH = """
import sys, threading
sys.path.insert(0, {root!r})
import llguidance, llguidance.hf
from stages.tokenize import load_tokenizer
from tests.stages.structured.grammar_chains import lark_chain
wrapped = llguidance.hf.from_tokenizer(load_tokenizer({model!r}), n_vocab=49152, eos_token=[2])
grammar = llguidance.grammar_from("grammar", lark_chain(3000))
threading.stack_size(8 * 1024 * 1024)  # a default thread's stack on Linux
thread = threading.Thread(target=lambda: llguidance.LLMatcher(wrapped, grammar, log_level=0))
thread.start()
thread.join()
print("survived")
"""


@pytest.mark.slow
def test_a_3000_rule_chain_on_an_8_mib_stack_kills_its_process(default_model_dir: Any) -> None:
    """Why the compile thread's stack is sized: llguidance overflows a default stack on issue
    34's chain, and a native stack overflow is the whole process's death (here a child's)."""
    root = str(__import__("pathlib").Path(__file__).resolve().parents[3])
    script = CRASH.format(root=root, model=str(default_model_dir))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode < 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "survived" not in result.stdout


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (StructuredOutputsParams(regex=r"[^\s\S]"), "NoExtension"),
        (StructuredOutputsParams(json='{"type": "integer", "minimum": 5, "maximum": 3}'), "5"),
    ],
)
def test_a_grammar_that_fails_at_its_first_mask_does_not_compile(
    llguidance_backend: LLGuidanceBackend, params: StructuredOutputsParams, reason: str
) -> None:
    with pytest.raises(GrammarCompileError) as caught:
        llguidance_backend.compile(params)
    assert reason in str(caught.value)
    assert "<state>" not in str(caught.value)  # llguidance's parser dump is cut off


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (StructuredOutputsParams(regex="a{1000000}"), "lexer error: too many expressions"),
        (StructuredOutputsParams(grammar='start: "a" start'), "parser error: Too many items"),
    ],
)
def test_a_matcher_that_fails_mid_way_says_why(
    llguidance_backend: LLGuidanceBackend, params: StructuredOutputsParams, reason: str
) -> None:
    """llguidance hits its lexer's limit (``a{1000000}``) or its parser's (a language without
    a finite sentence) once it has a token or at its first mask (the lexer's budget is shared
    by the copies of a compiled grammar, and the compile's probe spent it): the matcher's
    error says which, where before only its all-EOS mask did (and the request looked
    finished)."""
    matcher = llguidance_backend.compile(params).matcher()
    assert matcher.error() is None
    for _ in range(3):
        (row,) = allowed(llguidance_backend, [matcher])
        if matcher.error() is not None:
            break
        assert row and EOS not in row
        if not matcher.accept_token(min(row)):
            break
    error = matcher.error()
    assert error is not None and reason in error and "<state>" not in error


def test_the_engine_options_and_cli_flags_reach_the_schedule_stage() -> None:
    from pipeline.cli.llm import engine_options_from
    from pipeline.cli.main import build_parser
    from pipeline.engine.options import EngineOptions
    from pipeline.engine.presets import llm_pipeline

    flags = ["--grammar-max-rules", "1234", "--grammar-max-chars", "5000"]
    args = build_parser().parse_args(["serve", "--transport", "memory", *flags])
    options = EngineOptions.create(**engine_options_from(args))
    assert (options.grammar_max_rules, options.grammar_max_chars) == (1234, 5000)
    defaults = build_parser().parse_args(["serve"])
    assert EngineOptions.create(**engine_options_from(defaults)).grammar_max_rules == (
        DEFAULT_MAX_RULES
    )
    assert EngineOptions().grammar_max_chars == MAX_SPEC_CHARS
    configs = [
        stage.config
        for stage in llm_pipeline(options).stages.values()
        if getattr(stage.config, "grammar", None) is not None
    ]
    assert [c.grammar.limits for c in configs] == [GrammarLimits(1234, 5000)]
    for bad in ({"grammar_max_rules": 0}, {"grammar_max_chars": MAX_SPEC_CHARS + 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineOptions(**bad)  # type: ignore[arg-type]
