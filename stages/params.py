"""Sampling parameters, with vLLM's names and defaults.

Construction never raises for out-of-range values: a request from any source (Python, a gRPC
client, another stage) reaches admit, which validates it with :func:`validate_sampling` and
answers with an :class:`~stages.errors.InvalidRequestError` naming the field. The façade calls
the same function early so Python callers get the error before anything is queued.
"""

from __future__ import annotations

import dataclasses
import math

from stages.errors import InvalidRequestError
from transports.codec import message

__all__ = ["SamplingParams", "validate_sampling"]


@message(100)
@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens (vLLM names and defaults).

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those
    filters. ``logprobs``: return the log-probabilities of each sampled token plus this many
    top alternatives (0 = only the sampled token's). ``seed`` gives the request its own random
    generator, kept across preemption, so a seeded request samples the same tokens every run.
    ``priority``: smaller runs first under the ``priority`` scheduler (as in vLLM).
    ``max_tokens`` None: generate until the model's length (what is left of it after the
    prompt), as vLLM's ``max_tokens=None``; admit replaces it with that number.
    ``stop`` takes a list of strings or one string, ``stop_token_ids`` a list of ids; None
    means none for both (vLLM's defaults). They are stored as tuples.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0

    def __post_init__(self) -> None:
        # Accept what vLLM's SamplingParams accepts (vllm/sampling_params.py: ``stop: str |
        # list[str] | None = None``, ``stop_token_ids: list[int] | None = None``, None meaning
        # none); store tuples (hashable, frozen).
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


MAX_LOGPROBS = 20
#: stop strings per request, and characters per stop string: every step checks each one
#: against the new text, so a request must not make that cost (or the hold-back index, which
#: grows with their length) unbounded for everyone on the frontend
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024
#: float32's smallest normal value: a positive double below it is 0 in the sampler
_FLOAT32_TINY = 1.1754943508222875e-38


def validate_sampling(
    params: SamplingParams, *, vocab_size: int | None = None, request_id: str | None = None
) -> None:
    """Check every field of ``params``.

    Raises:
        InvalidRequestError: naming the first field that is out of range.
    """

    def fail(field: str, problem: str) -> None:
        raise InvalidRequestError(f"{field} {problem}", field=field, request_id=request_id)

    def check_int(field: str, value: object) -> None:
        if type(value) is not int:
            fail(field, f"must be an integer, got {type(value).__name__}")

    def check_float(field: str, value: object) -> float:
        if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
            fail(field, f"must be a finite number, got {value!r}")
        return float(value)  # type: ignore[arg-type]

    if params.max_tokens is not None:
        check_int("max_tokens", params.max_tokens)
        if params.max_tokens < 1:
            fail("max_tokens", f"must be >= 1 (or None), got {params.max_tokens}")
    if check_float("temperature", params.temperature) < 0:
        fail("temperature", f"must be >= 0, got {params.temperature}")
    top_p = check_float("top_p", params.top_p)
    if not _FLOAT32_TINY <= top_p <= 1.0:
        fail("top_p", f"must be in (0, 1] (and at least {_FLOAT32_TINY:.3g}), got {params.top_p}")
    check_int("top_k", params.top_k)
    if params.top_k < -1:
        fail("top_k", f"must be -1, 0 (disabled) or >= 1, got {params.top_k}")
    if not 0.0 <= check_float("min_p", params.min_p) <= 1.0:
        fail("min_p", f"must be in [0, 1], got {params.min_p}")
    if check_float("repetition_penalty", params.repetition_penalty) < _FLOAT32_TINY:
        fail(
            "repetition_penalty",
            f"must be > 0 (and at least {_FLOAT32_TINY:.3g}), got {params.repetition_penalty}",
        )
    if not -2.0 <= check_float("presence_penalty", params.presence_penalty) <= 2.0:
        fail("presence_penalty", f"must be in [-2, 2], got {params.presence_penalty}")
    if not -2.0 <= check_float("frequency_penalty", params.frequency_penalty) <= 2.0:
        fail("frequency_penalty", f"must be in [-2, 2], got {params.frequency_penalty}")
    if params.seed is not None:
        check_int("seed", params.seed)
        if not 0 <= params.seed < 2**63:
            fail("seed", f"must be in [0, 2**63), got {params.seed}")
    if not isinstance(params.stop, tuple) or not all(isinstance(s, str) for s in params.stop):
        fail("stop", "must be a list of strings")
    if any(s == "" for s in params.stop):
        fail("stop", "must not contain an empty string")
    if len(params.stop) > MAX_STOP_STRINGS:
        fail("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_STRING_LENGTH:
        fail(
            "stop",
            f"strings may be at most {MAX_STOP_STRING_LENGTH} characters, got one of {longest}",
        )
    if not isinstance(params.stop_token_ids, tuple):
        fail("stop_token_ids", "must be a list of token ids")
    for token_id in params.stop_token_ids:
        if type(token_id) is not int or token_id < 0:
            fail("stop_token_ids", f"must be non-negative integers, got {token_id!r}")
        if vocab_size is not None and token_id >= vocab_size:
            fail("stop_token_ids", f"token id {token_id} is outside the vocabulary ({vocab_size})")
    check_int("min_tokens", params.min_tokens)
    if params.min_tokens < 0:
        fail("min_tokens", f"must be >= 0, got {params.min_tokens}")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        fail(
            "min_tokens", f"({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    if params.logprobs is not None:
        check_int("logprobs", params.logprobs)
        if not 0 <= params.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {params.logprobs}")
    check_int("priority", params.priority)
    for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if type(getattr(params, flag)) is not bool:
            fail(flag, "must be a boolean")
