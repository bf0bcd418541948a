"""The benchmark workloads: fixed mixed prompts and Poisson arrival times (pure logic).

A request's prompt is ``"Write about <topic>."`` followed by a run of filler words; topic,
filler length and ``max_tokens`` are drawn from a :class:`random.Random` with a fixed seed, so
every run (and every system compared in one run) sees exactly the same requests.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

__all__ = [
    "FILLER_WORDS",
    "TOPICS",
    "BenchRequest",
    "WorkloadSpec",
    "blocks_to_hold",
    "make_workload",
    "percentile",
    "poisson_arrivals",
]

TOPICS = (
    "the ocean",
    "volcanoes",
    "honeybees",
    "the history of printing",
    "black holes",
    "bread baking",
    "the Roman empire",
    "electric cars",
    "jazz",
    "mountain climbing",
    "the water cycle",
    "chess openings",
    "coral reefs",
    "the moon landing",
    "origami",
    "rainforests",
    "the stock market",
    "glaciers",
    "medieval castles",
    "photosynthesis",
    "lighthouses",
    "coffee",
    "the Silk Road",
    "submarines",
    "desert animals",
    "typography",
    "solar panels",
    "ancient Egypt",
    "migratory birds",
    "the printing press",
    "tea ceremonies",
    "public libraries",
)

FILLER_WORDS = (
    "please",
    "include",
    "several",
    "details",
    "about",
    "its",
    "history",
    "and",
    "how",
    "people",
    "see",
    "it",
    "today",
    "with",
    "examples",
    "from",
    "different",
    "places",
    "times",
    "also",
    "mention",
    "some",
    "surprising",
    "facts",
    "that",
    "most",
    "readers",
    "would",
    "not",
    "know",
    "keep",
    "the",
    "tone",
    "friendly",
    "clear",
    "simple",
    "for",
    "a",
    "general",
    "audience",
    "explain",
    "why",
    "matters",
    "what",
    "changed",
    "over",
    "years",
    "who",
    "made",
    "important",
    "discoveries",
    "where",
    "one",
    "can",
    "learn",
    "more",
    "in",
    "short",
    "paragraphs",
    "using",
    "plain",
    "words",
    "only",
    "thanks",
)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to draw: ``num_requests`` prompts with ``min_filler``..``max_filler`` filler words
    (inclusive) and ``max_tokens`` from ``max_tokens_choices``, all from ``seed``.

    Raises:
        ValueError: a count or range is out of order or not positive.
    """

    num_requests: int = 64
    min_filler: int = 5
    max_filler: int = 120
    max_tokens_choices: tuple[int, ...] = (16, 32, 64, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 <= self.min_filler <= self.max_filler:
            raise ValueError(
                f"need 0 <= min_filler <= max_filler, got {self.min_filler}..{self.max_filler}"
            )
        if not self.max_tokens_choices or min(self.max_tokens_choices) < 1:
            raise ValueError(f"max_tokens_choices must be positive, got {self.max_tokens_choices}")


@dataclasses.dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: its prompt text and how many tokens it generates."""

    prompt: str
    max_tokens: int


def make_workload(spec: WorkloadSpec) -> tuple[BenchRequest, ...]:
    """The requests of ``spec`` (the same for the same spec, on every machine)."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        topic = rng.choice(TOPICS)
        num_filler = rng.randint(spec.min_filler, spec.max_filler)
        filler = " ".join(rng.choice(FILLER_WORDS) for _ in range(num_filler))
        max_tokens = rng.choice(spec.max_tokens_choices)
        requests.append(BenchRequest(f"Write about {topic}. {filler}", max_tokens))
    return tuple(requests)


def poisson_arrivals(rate: float, count: int, seed: int) -> tuple[float, ...]:
    """Arrival times (seconds from 0) of ``count`` requests of a Poisson process of ``rate``
    requests per second: exponential gaps drawn from ``seed``.

    Raises:
        ValueError: ``rate`` is not positive or ``count`` is negative.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(seed)
    now = 0.0
    times = []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return tuple(times)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation (numpy's
    default); NaN when ``values`` is empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def blocks_to_hold(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], block_size: int
) -> int:
    """KV blocks of ``block_size`` tokens that hold every request (prompt + ``max_tokens``)
    at once: how the offline benchmarks size each system's cache so that none preempts."""
    return sum(
        -(-(len(prompt) + limit) // block_size) for prompt, limit in zip(prompts, max_tokens)
    )
