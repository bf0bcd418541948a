"""The last pipeline shard samples (issue 39; stages/execute/pp_sampling.py): with real shard
processes, every sampling feature gives the tokens of one engine, and what comes back to the
first shard is tokens and logprobs, not logits.

- the messages round-trip the codec (nothing pickled), and the first shard's outbox tells the
  last shard of each request once, forgetting one that finished before it was sent;
- on the 6-layer tiny Llama at PP=2 and PP=3 (several steps in flight), seeded random sampling
  (temperature, top-k, top-p, min-p), penalties with logprobs and prompt logprobs, token rules
  (logit bias, bad words, min_tokens) and structured outputs (a regex, a JSON schema) give
  PP=1's tokens, logprobs and prompt logprobs; the structured outputs match their constraint;
- the answers that come back per engine step are smaller than a single row of logits.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline import AsyncEngine, SamplingParams
from pipeline.engine.options import EngineOptions
from stages.execute.config import ExecuteConfig
from stages.execute.pp_messages import (
    PipelineRequest,
    PipelineSampled,
    PipelineSampling,
    PipelineStep,
)
from stages.execute.pp_sampling import FirstShardOutbox, take_sampled
from stages.execute.rank_messages import ShardStep
from stages.messages import EngineRequest, Logprobs, RequestOutput, SchedulerStep
from stages.structured.params import StructuredOutputsParams
from transports.codec import Codec

VOCAB = 49152  # the tiny Llama's (SmolLM2's tokenizer)
SILENCE = dict(heartbeat_timeout=60.0)
REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
#: (prompt, params): every sampling feature the last shard computes
CASES: list[tuple[str, SamplingParams]] = [
    (
        "alpha beta gamma delta seeded top-k top-p",
        SamplingParams(
            max_tokens=14, temperature=0.9, top_k=50, top_p=0.9, seed=11, ignore_eos=True
        ),
    ),
    (
        "rivers and mountains, seeded min-p",
        SamplingParams(max_tokens=14, temperature=1.3, min_p=0.02, seed=5, ignore_eos=True),
    ),
    (
        "penalties with logprobs and prompt logprobs over a longer prompt of words",
        SamplingParams(
            max_tokens=14,
            temperature=0.8,
            seed=3,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            logprobs=3,
            prompt_logprobs=2,
            ignore_eos=True,
        ),
    ),
    (
        "greedy under token rules",
        SamplingParams(
            max_tokens=10,
            temperature=0.0,
            min_tokens=6,
            logit_bias={100: 8.0, 200: 4.0},
            bad_words=["the", "and"],
            logprobs=0,
        ),
    ),
    (
        "a regex, seeded",
        SamplingParams(
            max_tokens=24,
            temperature=0.7,
            seed=9,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        ),
    ),
    (
        "a JSON schema",
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(
                json=json.dumps(SCHEMA), disable_any_whitespace=True
            ),
        ),
    ),
]


def run(coroutine: Any, timeout: float = 900) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


async def outputs_of(model: str, **options: Any) -> tuple[list[RequestOutput], Any]:
    """The last output of each case, all at once."""

    async def one(prompt: str, params: SamplingParams) -> RequestOutput:
        last = None
        async for output in engine.generate(prompt, params):
            last = output
        assert last is not None and last.finished
        return last

    async with AsyncEngine(model, num_blocks=256, **SILENCE, **options) as engine:
        outputs = await asyncio.gather(*(one(prompt, params) for prompt, params in CASES))
        return list(outputs), engine.stats


def same_logprobs(got: Logprobs | None, expected: Logprobs | None) -> None:
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.token_id, got.rank, got.top_token_ids) == (
        expected.token_id,
        expected.rank,
        expected.top_token_ids,
    )
    assert got.logprob == pytest.approx(expected.logprob, rel=1e-4, abs=1e-5)
    assert got.top_logprobs == pytest.approx(expected.top_logprobs, rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def one_engine(tiny6_model_dir: Path) -> list[RequestOutput]:
    outputs, _ = run(outputs_of(str(tiny6_model_dir)))
    return outputs


# -- the messages and the outbox --------------------------------------------------------------


def test_the_messages_round_trip_the_codec() -> None:
    params = SamplingParams(seed=4, temperature=0.5, logit_bias={7: 1.5}, logprobs=2)
    sampling = PipelineSampling(
        request_ids=("a", "b"),
        new_requests=(PipelineRequest("a", (1, 2, 3), params, ((5, 6),)),),
        released=("z",),
        grammar_request_ids=("b",),
        grammar_bitmask=np.arange(8, dtype=np.int32).reshape(1, 8),
        score_chunks=((2, 3),),
        score_targets=(2, 3),
    )
    shard = ShardStep(
        step_id=3,
        token_ids=np.arange(4, dtype=np.int64),
        query_starts=np.zeros(2, dtype=np.int64),
        query_lens=np.array([1, 3], dtype=np.int64),
        num_decode=1,
        block_tables=np.ones((2, 1), dtype=np.int64),
    )
    step = PipelineStep(
        shard, np.zeros((4, 8), np.float32), np.array([0, 3, 1, 2]), sampling=sampling
    )
    answer = PipelineSampled(
        3,
        token_ids=(9, 10),
        logprob_rows=(1,),
        logprobs=(Logprobs(10, -0.5, 1, (10, 9), (-0.5, -1.0)),),
        prompt_logprobs=(Logprobs(2, -3.0, 4), Logprobs(3, -2.0, 2)),
    )
    codec = Codec()
    for message in (step, answer):
        decoded = codec.decode(*codec.encode(message))
        assert type(decoded) is type(message)
    back = codec.decode(*codec.encode(step))
    assert isinstance(back, PipelineStep)
    assert back.sampling.new_requests == sampling.new_requests
    assert back.sampling.score_chunks == ((2, 3),)
    assert np.array_equal(back.sampling.grammar_bitmask, sampling.grammar_bitmask)
    assert codec.decode(*codec.encode(answer)) == answer
    remote = take_sampled(answer)
    assert remote.result.token_ids == [9, 10]
    assert remote.result.logprobs == [None, answer.logprobs[0]]
    with pytest.raises(ValueError, match="logprobs row 5 of 2"):
        take_sampled(PipelineSampled(3, (9, 10), (5,), answer.logprobs))


def test_the_outbox_tells_of_each_request_once_and_drops_one_finished_unsent() -> None:
    params = SamplingParams()
    outbox = FirstShardOutbox()

    def sent() -> PipelineSampling:
        class Prepared:  # what FirstShardOutbox.sampling reads: a step that samples nothing
            step = SchedulerStep(step_id=0, new_requests=(), chunks=())
            works: list[Any] = []

        return outbox.sampling(Prepared())  # type: ignore[arg-type]

    outbox.note(SchedulerStep(1, new_requests=(EngineRequest("a", (1,), params),), chunks=()))
    # registered and finished before a step computed anything: the last shard never hears of it
    outbox.note(SchedulerStep(2, new_requests=(EngineRequest("b", (2,), params),), chunks=()))
    outbox.note(SchedulerStep(3, new_requests=(), chunks=(), finished=("b",)))
    first = sent()
    assert [r.request_id for r in first.new_requests] == ["a"] and first.released == ()
    assert first.new_requests[0].prompt_token_ids == (1,)
    outbox.note(SchedulerStep(4, new_requests=(), chunks=(), finished=("a",)))
    second = sent()
    assert second.new_requests == () and second.released == ("a",)
    assert sent() == PipelineSampling()


def test_the_last_shards_states_sample_as_one_engines_and_refuse_what_does_not_match(
    tiny_model_dir: Path,
) -> None:
    """LastShardStates on a loaded runner (its sampler, EOS ids, vocabulary): a seeded row
    and a penalized greedy row give the tokens the runner's own sampler gives states built
    as the first shard builds them, and keep sampling as one engine's history grows."""
    import torch

    from stages.execute.pp_sampling import LastShardStates
    from stages.execute.runner import ModelRunner
    from stages.execute.sampler import new_sampling_state

    runner = ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=16))
    info = runner.load()
    sampler = runner.sampler
    assert sampler is not None
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=21, logprobs=2)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=3)
    requests = (
        PipelineRequest("s", (5, 6, 7), seeded),
        PipelineRequest("p", (8, 9), penalized, ((11, 12),)),
    )
    states = LastShardStates()
    states.update(runner, PipelineSampling(new_requests=requests))
    reference = [
        new_sampling_state(
            r.params, r.prompt_token_ids, info.eos_token_ids, runner.device,
            vocab_size=sampler.vocab_size, bad_words_token_ids=r.bad_words_token_ids,
        )
        for r in requests
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    step = PipelineSampling(request_ids=("s", "p"), score_chunks=((1, 2),), score_targets=(7,))
    for step_id in range(4):
        logits = torch.randn(3, info.vocab_size, generator=generator)
        answer = states.sample(runner, step_id, logits, step)
        expected = sampler.sample(logits[:2], reference)
        assert list(answer.token_ids) == expected.token_ids
        assert answer.logprob_rows == (0,) and answer.logprobs[0] == expected.logprobs[0]
        assert len(answer.prompt_logprobs) == 1 and answer.prompt_logprobs[0].token_id == 7
        for state, token in zip(reference, expected.token_ids, strict=True):
            state.output_token_ids.append(token)
    with pytest.raises(ValueError, match="already registered"):
        states.update(runner, PipelineSampling(new_requests=requests[:1]))
    with pytest.raises(ValueError, match="holds no sampling state for \\['x'\\]"):
        states.sample(runner, 9, torch.zeros(1, info.vocab_size), PipelineSampling(("x",)))
    with pytest.raises(ValueError, match="3 logits rows for 2 sampling and 0 prompt-logprob"):
        states.sample(runner, 9, torch.zeros(3, info.vocab_size), PipelineSampling(("s", "p")))
    states.update(runner, PipelineSampling(released=("s", "p")))
    assert len(states) == 0


# -- exactness against one engine -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("size", [2, 3])
def test_every_sampling_feature_gives_the_outputs_of_one_engine(
    tiny6_model_dir: Path, one_engine: list[RequestOutput], size: int
) -> None:
    got, stats = run(outputs_of(str(tiny6_model_dir), pipeline_parallel_size=size))
    for (prompt, params), output, expected in zip(CASES, got, one_engine, strict=True):
        assert output.token_ids == expected.token_ids, prompt
        assert output.finish_reason == expected.finish_reason, prompt
        if params.logprobs is not None:
            assert output.logprobs is not None and expected.logprobs is not None
            assert len(output.logprobs) == len(output.token_ids)
            for mine, theirs in zip(output.logprobs, expected.logprobs, strict=True):
                same_logprobs(mine, theirs)
        if params.prompt_logprobs is not None:
            assert output.prompt_logprobs is not None and expected.prompt_logprobs is not None
            assert len(output.prompt_logprobs) == len(expected.prompt_logprobs) > 5
            for mine, theirs in zip(output.prompt_logprobs, expected.prompt_logprobs, strict=True):
                same_logprobs(mine, theirs)
    by_prompt = dict(zip((prompt for prompt, _ in CASES), got, strict=True))
    assert re.fullmatch(REGEX, by_prompt["a regex, seeded"].text)
    document = json.loads(by_prompt["a JSON schema"].text)
    assert set(document) == {"ok", "tag"} and document["tag"] in ("x", "y")
    ruled = by_prompt["greedy under token rules"]
    assert len(ruled.token_ids) >= 6  # min_tokens held EOS back
    # what came back per step: tokens, logprobs and prompt logprobs, far less than a single
    # row of float32 logits (VOCAB x 4 bytes; the shards used to send one per sampling row)
    assert stats.num_steps > 0 and stats.pipeline_answer_bytes > 0
    assert stats.pipeline_answer_bytes / stats.num_steps < VOCAB * 4 / 10
    assert len(stats.shard_busy_seconds) == size


def test_the_options_still_refuse_speculation_and_lora_with_pipeline_parallelism() -> None:
    with pytest.raises(ValueError, match="speculative_config and enable_lora"):
        EngineOptions(pipeline_parallel_size=2, enable_lora=True)
