"""The null-model streaming load: many concurrent streaming requests of exactly ``max_tokens``
tokens each through an engine with the null model. :mod:`pipeline.bench.ceiling` measures one
engine on it; :mod:`pipeline.bench.parallel`'s data-parallel comparison measures N replicas
against one on the same load. Its configuration, prompts, KV budget and streaming live here, so
neither of those benchmarks imports the other's module for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.bench.workload import WorkloadSpec, make_workload

if TYPE_CHECKING:
    from pipeline.engine.async_engine import AsyncEngine
    from stages.params import SamplingParams

__all__ = ["CeilingConfig", "ceiling_prompts", "null_engine_blocks", "stream_all"]

#: the prompts: short ("Write about <topic>." plus 5-20 filler words)
_PROMPT_FILLER = (5, 20)
#: the KV blocks a request's prompt is given beyond its output (prompts are a few dozen tokens)
_PROMPT_ROOM_TOKENS = 64
#: KV headroom per request beyond prompt + output (blocks), so the null model never preempts
_SPARE_BLOCKS_PER_REQUEST = 2
_BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class CeilingConfig:
    """``num_requests`` concurrent streaming requests of exactly ``max_tokens`` tokens each
    (ignore_eos), ``repeats`` times on one engine; ``transport`` "zmq" (engine process) or
    "memory" (one process). ``model`` provides the tokenizer and config only. ``tune_gc``: the
    engine's garbage-collector policy (off to measure what it is worth).

    Raises:
        ValueError: a count is not positive.
    """

    model: str = "smollm2-135m"
    num_requests: int = 256
    max_tokens: int = 256
    transport: str = "zmq"
    repeats: int = 3
    profile: bool = False
    seed: int = 0
    tune_gc: bool = True

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def quick(cls, **overrides: object) -> CeilingConfig:
        """A small configuration for smoke tests."""
        values: dict[str, object] = {"num_requests": 32, "max_tokens": 32, "repeats": 1}
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def ceiling_prompts(config: CeilingConfig) -> list[str]:
    """The load's prompts: short ones, drawn from ``config.seed``."""
    spec = WorkloadSpec(
        num_requests=config.num_requests,
        min_filler=_PROMPT_FILLER[0],
        max_filler=_PROMPT_FILLER[1],
        max_tokens_choices=(config.max_tokens,),
        seed=config.seed,
    )
    return [request.prompt for request in make_workload(spec)]


def null_engine_blocks(config: CeilingConfig) -> int:
    """The KV blocks that hold every request at once, each with room for all of its tokens, so
    the null model never preempts (``num_blocks`` of each engine on the load)."""
    per_request = -(-(config.max_tokens + _PROMPT_ROOM_TOKENS) // _BLOCK_SIZE)
    return (per_request + _SPARE_BLOCKS_PER_REQUEST) * config.num_requests


async def stream_all(engine: AsyncEngine, prompts: Sequence[str], params: SamplingParams) -> int:
    """Stream every prompt concurrently; the number of tokens that reached the callers."""

    async def consume(prompt: str) -> int:
        received = 0
        async for output in engine.generate(prompt, params):
            received = len(output.token_ids)  # cumulative: the new tokens are the growth
        return received

    return sum(await asyncio.gather(*(consume(prompt) for prompt in prompts)))
