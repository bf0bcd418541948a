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
from typing import Any

__all__ = [
    "FILLER_WORDS",
    "ORDER_SCHEMA",
    "TOPICS",
    "BenchRequest",
    "WorkloadSpec",
    "WorkloadWork",
    "blocks_to_hold",
    "make_workload",
    "percentile",
    "poisson_arrivals",
    "prompt_ids",
    "workload_work",
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


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids every system gets for ``prompt``: the chat template applied (with the
    generation prompt) when ``tokenizer`` has one, else the plain encoding."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadWork:
    """What any engine must compute for a workload, the same for every system: the decoder
    layers run over ``layer_tokens`` tokens (the prompts less ``cached_prompt_tokens`` that
    block-level prefix caching serves, plus every generated token but each request's last,
    which is never fed back) and the LM head over ``head_rows`` rows (one per generated
    token). Memory: at least ``forward_passes`` forward passes (each request needs one per
    token it generates), each reading every weight, and decode rows reading
    ``decode_context_tokens`` tokens of keys and values in all (each fed-back token attends
    its whole context).

    Step by step, with every request in one batch from the start (the fewest passes):
    ``decode_rows[t - 1]`` requests feed back their ``t``-th token in decode step ``t`` and
    together attend ``decode_step_contexts[t - 1]`` tokens of keys and values."""

    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    layer_tokens: int
    head_rows: int
    forward_passes: int = 0
    decode_context_tokens: int = 0
    decode_rows: tuple[int, ...] = ()
    decode_step_contexts: tuple[int, ...] = ()


def workload_work(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], block_size: int = 16
) -> WorkloadWork:
    """The work of ``prompts`` generating exactly ``max_tokens`` each (EOS ignored).

    A prompt's leading full blocks of ``block_size`` tokens that an earlier prompt of the
    workload began with count as cached (vLLM's and actorline's block-level prefix caching),
    never its last token (its logits must be computed).

    Raises:
        ValueError: the lengths differ, a prompt is empty, a limit is below 1, or
            ``block_size`` is below 1.
    """
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[tuple[int, ...]] = set()
    cached = 0
    for prompt, limit in zip(prompts, max_tokens):
        if not prompt or limit < 1:
            raise ValueError("every prompt needs a token and every max_tokens must be >= 1")
        hit = True
        for end in range(block_size, len(prompt) + 1, block_size):
            prefix = tuple(prompt[:end])
            if hit and prefix in seen and end < len(prompt):
                cached = cached + block_size
            else:
                hit = False
            seen.add(prefix)
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    generated = sum(max_tokens)
    # Fed-back token t (1 .. limit - 1) of a request attends its prompt and t outputs.
    contexts = sum(
        (limit - 1) * len(prompt) + (limit - 1) * limit // 2
        for prompt, limit in zip(prompts, max_tokens)
    )
    steps = range(1, max(max_tokens, default=1))
    return WorkloadWork(
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached,
        generated_tokens=generated,
        layer_tokens=prompt_tokens - cached + generated - len(prompts),
        head_rows=generated,
        forward_passes=max(max_tokens, default=0),
        decode_context_tokens=contexts,
        decode_rows=tuple(sum(1 for limit in max_tokens if limit > t) for t in steps),
        decode_step_contexts=tuple(
            sum(len(prompt) + t for prompt, limit in zip(prompts, max_tokens) if limit > t)
            for t in steps
        ),
    )


#: the JSON schema of ``actorline bench offline --structured``'s constrained requests (and of
#: the grammar-engine comparison, ``python -m benchmarks.grammars``): an order with nested
#: objects, formats, a pattern and bounded arrays, which needs more tokens than any request may
#: generate, so its mask applies at every step
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64},
                "email": {"type": "string", "format": "email"},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 10,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "placed": {"type": "string", "format": "date-time"},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["id", "customer", "items", "placed", "status"],
    "additionalProperties": False,
}
