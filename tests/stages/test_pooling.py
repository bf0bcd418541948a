"""Tests of stages/pooling.py (the checks of an embedding request) and of how the scheduler
finishes one (stages/scheduler.py): pure logic, hand-made steps and results."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stages.errors import InvalidRequestError
from stages.messages import EngineRequest, GenerateRequest, StepResult
from stages.params import SamplingParams
from stages.policies import FcfsPolicy
from stages.pooling import (
    PoolingParams,
    check_dimensions,
    embedding_sampling_params,
    validate_pooling,
)
from stages.scheduler import Scheduler, SchedulerConfig, SchedulerError
from stages.validation import validate_generate_request
from tests.stages.test_scheduler import engine_info


def embedding_request(request_id: str, num_prompt: int) -> EngineRequest:
    return EngineRequest(
        request_id,
        tuple(10 + i for i in range(num_prompt)),
        embedding_sampling_params(),
        pooling=PoolingParams(),
    )


def test_a_valid_embedding_request_passes_the_validation_core() -> None:
    request = GenerateRequest(
        "r", embedding_sampling_params(truncate_prompt_tokens=5), prompt="hi",
        pooling=PoolingParams(dimensions=8, normalize=False),
    )  # fmt: skip
    validate_generate_request(request)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"max_tokens": 4}, "max_tokens"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ("x",)}, "stop"),
    ],
)
def test_sampling_fields_on_an_embedding_are_refused_by_name(
    change: dict[str, object], field: str
) -> None:
    """An embedding samples nothing: a sampling field set is refused, never ignored."""
    params = dataclasses.replace(embedding_sampling_params(), **change)  # type: ignore[arg-type]
    request = GenerateRequest("r", params, prompt="hi", pooling=PoolingParams())
    with pytest.raises(InvalidRequestError) as refused:
        validate_generate_request(request)
    assert refused.value.field == field


@pytest.mark.parametrize(
    ("pooling", "field"),
    [
        (PoolingParams(dimensions=0), "dimensions"),
        (PoolingParams(dimensions=True), "dimensions"),  # type: ignore[arg-type]
        (PoolingParams(normalize="yes"), "normalize"),  # type: ignore[arg-type]
        ("last", "pooling"),
    ],
)
def test_bad_pooling_fields_are_refused_by_name(pooling: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        validate_pooling(pooling, embedding_sampling_params())
    assert refused.value.field == field


def test_tools_on_an_embedding_are_refused() -> None:
    from stages.messages import ToolSpec

    request = GenerateRequest(
        "r", embedding_sampling_params(), messages=(), pooling=PoolingParams(),
        tools=(ToolSpec("f"),), tool_choice="auto",
    )  # fmt: skip
    with pytest.raises(InvalidRequestError):
        validate_generate_request(request)


def test_dimensions_against_the_model() -> None:
    def check(dimensions: int | None, sizes: tuple[int, ...] | None, size: int = 64) -> None:
        check_dimensions(
            PoolingParams(dimensions=dimensions), model="m", embedding_size=size,
            matryoshka_dimensions=sizes,
        )  # fmt: skip

    check(None, None)
    check(8, ())  # is_matryoshka: any size up to the hidden size
    check(32, (16, 32))
    for dimensions, sizes, words in (
        (8, None, "does not support Matryoshka"),
        (65, (), "at most the model's embedding size"),
        (20, (16, 32), "one of the model's Matryoshka sizes: 16, 32"),
    ):
        with pytest.raises(InvalidRequestError, match=words) as refused:
            check(dimensions, sizes)
        assert refused.value.field == "dimensions"
    with pytest.raises(InvalidRequestError, match="computes no embeddings") as none:
        check(None, None, size=0)
    assert none.value.field == "input"


def result(step_id: int, **fields: object) -> StepResult:
    base: dict[str, object] = {"request_ids": (), "token_ids": (), "free_blocks": 60,
                               "total_blocks": 64}  # fmt: skip
    return StepResult(step_id, **{**base, **fields})  # type: ignore[arg-type]


def test_the_scheduler_finishes_an_embedding_with_its_vector_and_no_token() -> None:
    """A prompt of 10 tokens in chunks of 4: no vector until its last chunk, then it
    finishes ("stop", no tokens) with the vector, and its blocks are freed in the next step,
    beside a generation that goes on."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=4), FcfsPolicy(), clock=lambda: 1.0
    )
    scheduler.set_engine_info(engine_info())
    scheduler.add_request(embedding_request("e", 10))
    vector = np.arange(4, dtype=np.float32)
    outputs = None
    for _ in range(3):
        step = scheduler.schedule()
        assert step is not None
        chunk = step.chunks[0]
        ends = chunk.start + chunk.num_tokens == 10
        outputs = scheduler.update(result(step.step_id, embeddings={"e": vector} if ends else {}))
        if ends:
            break
        assert outputs.request_ids == ()
    assert outputs is not None
    assert outputs.request_ids == ("e",)
    assert outputs.new_token_ids == ((),)
    assert outputs.finish_reasons == ("stop",)
    assert outputs.embeddings["e"] is vector
    assert "e" in outputs.scheduler_times
    step = scheduler.schedule()
    assert step is not None and step.finished == ("e",)


def test_the_scheduler_refuses_a_token_for_an_embedding_and_a_vector_for_a_generation() -> None:
    scheduler = Scheduler(SchedulerConfig(), FcfsPolicy(), clock=lambda: 1.0)
    scheduler.set_engine_info(engine_info())
    scheduler.add_request(embedding_request("e", 3))
    step = scheduler.schedule()
    assert step is not None
    with pytest.raises(SchedulerError, match="an embedding request"):
        scheduler.update(result(step.step_id, request_ids=("e",), token_ids=(7,)))

    scheduler = Scheduler(SchedulerConfig(), FcfsPolicy(), clock=lambda: 1.0)
    scheduler.set_engine_info(engine_info())
    scheduler.add_request(
        EngineRequest("g", (10, 11, 12), SamplingParams(max_tokens=4, temperature=0.0))
    )
    step = scheduler.schedule()
    assert step is not None
    with pytest.raises(SchedulerError, match="no embedding request"):
        scheduler.update(result(step.step_id, embeddings={"g": np.zeros(4, np.float32)}))
