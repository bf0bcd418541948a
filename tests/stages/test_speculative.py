"""stages/speculative.py: the config (vLLM's keys, typed errors), the n-gram proposer, the
back-off and the check of execute's answers (pure logic)."""

from __future__ import annotations

import pytest

import plugins
from pipeline.engine.option_fields import fed
from pipeline.engine.options import EngineOptions
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.params import SamplingParams
from stages.speculative import (
    PROPOSER_FREE_MISSES,
    Backoff,
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    accepted_drafts,
    draft_room,
    load_proposer,
    may_draft,
    parse_speculative_config,
)


def test_the_config_reads_vllms_keys_from_a_mapping_or_json() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=3)
    # neither bound given: 2 to 5 (vLLM's are 5 and 5; docs/speculative.md says why)
    assert parse_speculative_config({"num_speculative_tokens": 2}) == SpeculativeConfig(
        num_speculative_tokens=2, prompt_lookup_max=5, prompt_lookup_min=2
    )
    assert parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 3}) == (
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=3)
    )
    assert parse_speculative_config(config.to_json()) == config
    assert parse_speculative_config(None) is None
    # a model names the draft model's method (vLLM's rule); its own options ride along
    draft = parse_speculative_config(
        {"model": "smollm2-135m", "quantization": "gguf", "num_speculative_tokens": 3}
    )
    assert draft == SpeculativeConfig(
        "draft_model", 3, model="smollm2-135m", quantization="gguf", dtype="float32"
    )
    assert draft is not None and draft.drafts_in_execute
    assert parse_speculative_config(draft.to_json()) == draft


def test_the_draft_models_options_are_checked_as_execute_options() -> None:
    spec = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}
    options = EngineOptions(speculative_config={**spec, "quantization": "gguf"})
    draft = ExecuteConfig(**fed(options, "execute")).draft_config(num_blocks=7)
    assert (draft.model, draft.quantization, draft.dtype, draft.num_blocks) == (
        "smollm2-135m", "gguf", "float32", 7,
    )  # fmt: skip
    assert not draft.enable_prefix_caching and draft.speculative_config is None
    for bad, words in (("quantization", "q5"), ("dtype", "float8")):
        with pytest.raises(ExecuteConfigError, match="speculative_config") as caught:
            EngineOptions(speculative_config={**spec, bad: words})
        assert f"the draft model's) {bad}" in str(caught.value)
    with pytest.raises(ExecuteConfigError, match="names no draft model"):
        ExecuteConfig().draft_config()


def test_draft_model_drafts_come_from_the_step_results() -> None:
    config = SpeculativeConfig("draft_model", 3, model="smollm2-135m")
    speculator = Speculator(config)
    assert speculator.proposer is None
    speculator.receive(["a", "b"], {"a": (5, 6, 7), "c": (1,)})
    assert speculator.propose("a", [1, 2], 2) == (5, 6)  # cut to the limit, taken
    assert speculator.propose("a", [1, 2], 2) == ()
    speculator.receive(["b"], {"b": (9,)})
    speculator.receive(["b"], {})  # tokens came without a draft: the old one no longer follows
    assert speculator.propose("b", [1], 3) == ()
    speculator.receive(["b"], {"b": (4, 4, 4, 4)})
    speculator.forget("b")
    assert speculator.propose("b", [1], 3) == ()
    # no back-off here: the drafter in execute backs off itself
    speculator.observe("a", 3, 0)
    speculator.receive(["a"], {"a": (8,)})
    assert speculator.propose("a", [1], 3) == (8,)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a mapping"),
        ({"num_speculative_tokens": 3, "lookahead": 2}, "unknown key(s) 'lookahead'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min 4 must not exceed prompt_lookup_max 2"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs model"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3,
          "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3,
          "prompt_lookup_max": 3}, "'prompt_lookup_max' are the n-gram proposer's keys"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 3},
         "'model' are the draft model's keys"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "'eagle3' is not supported yet"),
        ({"method": "telepathy", "num_speculative_tokens": 3}, "names no installed proposer"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_key(value: object, words: str) -> None:
    with pytest.raises(ValueError, match="speculative_config") as caught:
        parse_speculative_config(value)
    assert words in str(caught.value)


def test_engine_options_take_the_config_and_refuse_what_is_not_verified() -> None:
    options = EngineOptions(speculative_config='{"num_speculative_tokens": 3}')
    assert options.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        EngineOptions(speculative_config={})
    # the target's tensor-parallel ranks verify together (docs/speculative.md)
    tp = EngineOptions(
        speculative_config={"num_speculative_tokens": 3}, tensor_parallel_size=2, transport="zmq"
    )
    assert tp.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="null_model"):
        EngineOptions(speculative_config={"num_speculative_tokens": 3}, null_model=True)
    # a draft model drafts unsharded (beside rank 0, or on its own host) for the rows the
    # ranks verify together
    for placement in ("engine", "host"):
        draft = EngineOptions(
            speculative_config={
                "model": "smollm2-135m", "num_speculative_tokens": 3, "placement": placement
            },
            tensor_parallel_size=2,
            transport="zmq",
        )  # fmt: skip
        assert draft.speculative_config is not None
        assert draft.speculative_config.drafts_in_execute


def test_the_ngram_proposer_is_a_plugin_of_its_group() -> None:
    assert "ngram" in plugins.available(plugins.PROPOSERS)
    assert isinstance(load_proposer(SpeculativeConfig()), NgramProposer)


def _ngram(low: int, high: int) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(prompt_lookup_max=high, prompt_lookup_min=low))


def test_ngram_takes_the_longest_suffix_match_and_its_most_recent_occurrence() -> None:
    proposer = _ngram(1, 3)
    # suffix (1, 2): most recent earlier occurrence at 4..5, followed by 3, 5, 9
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2], 3) == (3, 5, 9)
    # the 3-gram (9, 1, 2) wins over the more recent 2-gram (1, 2)
    assert proposer.propose([9, 1, 2, 7, 7, 1, 2, 8, 9, 1, 2], 2) == (7, 7)
    # at most num_tokens; a continuation that reaches the end repeats (a loop goes on)
    assert proposer.propose([5, 6, 5], 4) == (6, 5, 6, 5)
    assert proposer.propose([3, 3, 3], 3) == (3, 3, 3)
    assert proposer.propose([1, 2, 3], 2) == ()  # no earlier occurrence
    assert proposer.propose([1, 1], 0) == ()
    # shorter than prompt_lookup_min: nothing
    assert _ngram(2, 3).propose([4, 5, 9, 5], 2) == ()
    assert _ngram(2, 3).propose([4, 5, 9, 4, 5], 2) == (9, 4)


def test_the_speculator_backs_off_after_misses_and_counts_per_position() -> None:
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                               prompt_lookup_max=2, disable_by_batch_size=4)  # fmt: skip
    speculator = Speculator(config)
    tokens = [1, 2, 3, 1, 2]
    assert speculator.propose("r", tokens, limit=10) == (3, 1, 2)
    assert speculator.propose("r", tokens, limit=2) == (3, 1)
    speculator.observe("r", 3, 0)  # a lone miss (an edit in copied text): drafts on
    assert speculator.propose("r", tokens, limit=10) == (3, 1, 2)
    speculator.observe("r", 3, 0)  # a second miss in a row: skip one step
    assert speculator.propose("r", tokens, limit=10) == ()
    assert speculator.propose("r", tokens, limit=10) == (3, 1, 2)
    speculator.observe("r", 3, 0)  # a third: skip three
    assert [speculator.propose("r", tokens, 10) for _ in range(4)] == [(), (), (), (3, 1, 2)]
    speculator.observe("r", 3, 2)  # accepted: no more skipping, the next miss is free again
    assert speculator.propose("r", tokens, limit=10) == (3, 1, 2)
    speculator.observe("r", 3, 0)
    assert speculator.propose("r", tokens, limit=10) == (3, 1, 2)
    stats = speculator.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 15, 2)
    assert stats.accepted_per_position == (1, 1, 0)
    assert stats.acceptance_rate == pytest.approx(2 / 15)
    assert speculator.enabled_for(3) and not speculator.enabled_for(4)


def test_the_back_off_skips_1_3_7_up_to_its_cap_after_its_free_misses() -> None:
    def skipped_between_drafts(backoff: Backoff, misses: int) -> list[int]:
        runs = []
        for _ in range(misses):
            backoff.observe("r", 0)
            skipped = 0
            while backoff.skips("r"):
                skipped += 1
            runs.append(skipped)
        return runs

    # the draft model's (none free) and a proposer's (one free)
    assert skipped_between_drafts(Backoff(), 7) == [1, 3, 7, 15, 31, 32, 32]
    assert skipped_between_drafts(Backoff(PROPOSER_FREE_MISSES), 7) == [0, 1, 3, 7, 15, 31, 32]
    # where nothing is ever accepted, a proposer's request drafts on 8 of its first 100 steps
    backoff, drafted, step = Backoff(PROPOSER_FREE_MISSES), 0, 0
    while step < 100:
        step += 1
        if not backoff.skips("r"):
            drafted += 1
            backoff.observe("r", 0)
    assert drafted == 8
    backoff.forget("r")
    assert not backoff.skips("r")
    with pytest.raises(ValueError, match="free_misses"):
        Backoff(-1)


def test_only_requests_sampled_like_one_decode_row_draft() -> None:
    plain = SamplingParams(max_tokens=8)
    assert may_draft(plain, 1)
    assert not may_draft(plain, 0)  # the first token comes from the prompt's pass
    assert not may_draft(SamplingParams(max_tokens=8, logprobs=1), 3)
    assert not may_draft(SamplingParams(max_tokens=8, presence_penalty=0.5), 3)
    assert not may_draft(SamplingParams(max_tokens=8, bad_words=["x"]), 3)
    assert not may_draft(SamplingParams(max_tokens=8, min_tokens=4), 3)
    assert may_draft(SamplingParams(max_tokens=8, min_tokens=4), 4)


def test_accepted_drafts_must_begin_the_draft() -> None:
    drafts = {"a": (1, 2, 3), "b": (4,), "c": ()}
    assert accepted_drafts(drafts, {"a": (1, 2), "b": ()}, ()) == {"a": (1, 2), "b": ()}
    assert accepted_drafts(drafts, {"a": (1,)}, ("b",)) == {"a": (1,)}
    with pytest.raises(ValueError, match="no prefix"):
        accepted_drafts(drafts, {"a": (2,), "b": ()}, ())
    with pytest.raises(ValueError, match="no prefix"):
        accepted_drafts(drafts, {"a": ()}, ())  # b's answer is missing
    with pytest.raises(ValueError, match="drafted none"):
        accepted_drafts(drafts, {"a": (), "b": (), "c": ()}, ())


def test_draft_room_keeps_a_drafted_step_within_one_step_graph_pass() -> None:
    assert draft_room(16, 1) == 15
    assert draft_room(16, 4) == 3  # four streams of 1 + 3 rows: 16
    assert draft_room(16, 5) == 2
    assert draft_room(16, 16) == 0  # the plain step fills the graph: no room
    assert draft_room(0, 4) >= 1 << 20  # no step graph (CUDA, null model): no bound
    # 40 decode rows take the module path anyway: drafts cross no line there
    assert draft_room(16, 40) >= 1 << 20


@pytest.mark.parametrize(("step_graph_rows", "widest"), [(0, 4 * 7), (16, 16)])
def test_the_scheduler_drafts_within_the_step_graphs_rows(
    step_graph_rows: int, widest: int
) -> None:
    """Four streams drafting ``k`` 6 with the real scheduler (execute accepts every FILLER, as
    a greedy target that always samples it would): with the step graph's 16 rows (fp32 on a
    CPU) their all-decode steps stay within 16 rows (3 draft tokens each), without a graph
    they draft all 6."""
    import dataclasses

    from stages.messages import EngineRequest
    from stages.policies import FcfsPolicy
    from stages.scheduler import Scheduler, SchedulerConfig
    from tests.stages.test_scheduler import FILLER, FakeClock, engine_info
    from tests.stages.test_scheduler_prefix_cache import BookkeepingExecute

    info = dataclasses.replace(engine_info(256, 4, 128), step_graph_rows=step_graph_rows)
    spec = SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=3)
    scheduler = Scheduler(
        SchedulerConfig(8, 256, None, speculative_config=spec), FcfsPolicy(), clock=FakeClock()
    )
    scheduler.set_engine_info(info)
    execute = BookkeepingExecute(info.num_blocks, info.block_size, info.max_model_len)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    for index in range(4):
        scheduler.add_request(EngineRequest(f"r{index}", (FILLER,) * 8, params))
    widest_step = most_drafted = 0
    for _ in range(200):
        if not scheduler.has_work():
            break
        step = scheduler.schedule()
        assert step is not None
        if all(c.num_tokens == 1 + len(c.draft_token_ids) for c in step.chunks):
            widest_step = max(widest_step, sum(c.num_tokens for c in step.chunks))
            most_drafted = max([most_drafted, *(len(c.draft_token_ids) for c in step.chunks)])
        scheduler.update(execute.run(step))
    assert not scheduler.has_work()
    assert widest_step == widest
    assert most_drafted == (6 if step_graph_rows == 0 else 3)
