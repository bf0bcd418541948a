"""Sampling parameters, with vLLM's names and defaults.

Construction never raises for out-of-range values: every request, from any front end (Python,
HTTP, gRPC), is checked once where it enters the engine by the validation core
(:func:`stages.validation.validate_generate_request`), which calls :func:`validate_sampling`
and raises an :class:`~stages.errors.InvalidRequestError` naming the field before anything is
queued (docs/architecture.md §7.1). The stages trust what it passed.
"""

from __future__ import annotations

import dataclasses

from stages.checks import check_bool, check_int, check_number, check_text, check_token_ids, describe
from stages.errors import InvalidRequestError
from stages.structured.params import StructuredOutputsParams, validate_structured_outputs
from transports.codec import message

__all__ = [
    "MAX_ALLOWED_TOKEN_IDS",
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_LENGTH",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LENGTH",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
    "validate_sampling",
]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens (vLLM names and defaults).

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those
    filters. ``logprobs``: return the log-probabilities of each sampled token plus this many
    top alternatives (0 = only the sampled token's). ``seed`` gives the request its own random
    generator, kept across preemption, so a seeded request samples the same tokens every run.
    ``priority``: smaller runs first under the ``priority`` scheduler (as in vLLM).
    ``structured_outputs``: a constraint the output must match (a JSON schema, a regex, a
    choice, a grammar; see :mod:`stages.structured.params`), as vLLM's field of that name.
    ``max_tokens`` None: generate until the model's length (what is left of it after the
    prompt), as vLLM's ``max_tokens=None``; admit replaces it with that number.
    ``stop`` takes a list of strings or one string, ``stop_token_ids`` a list of ids; None
    means none for both (vLLM's defaults). They are stored as tuples.
    ``logit_bias`` (OpenAI's): token id → a bias in [-100, 100] added to the token's logit
    before sampling (-100 in effect bans it, +100 in effect forces it); a dict or (id, bias)
    pairs, stored as pairs sorted by id. ``allowed_token_ids`` (vLLM's): only these tokens may
    be sampled (None: any). ``bad_words`` (vLLM's): words whose tokens must not be generated
    (with and without a leading space, as vLLM tokenizes them: the tokenize stage does).
    ``truncate_prompt_tokens`` (vLLM's): keep only the prompt's last k tokens (after the
    chat template), -1 the last ``max_model_len``; None: the whole prompt.
    ``prompt_logprobs`` (vLLM's): score the prompt too: for each prompt token after the first,
    its log-probability given the tokens before it, plus this many top alternatives (0: only
    the token's own; -1: the whole vocabulary, allowed only where it is at most
    :data:`MAX_LOGPROBS` tokens, as vLLM bounds it by ``max_logprobs``). The output's
    ``prompt_logprobs`` then holds them (None first, for the first token). Such a request
    reads nothing from the prefix cache while its prompt is scored (as vLLM v1), so every
    position is computed and scored.
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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None

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
        # vLLM's ``logit_bias: dict[int, float] | None``, ``allowed_token_ids: list[int] |
        # None``, ``bad_words: list[str] | None``
        if self.logit_bias is None:
            object.__setattr__(self, "logit_bias", ())
        elif isinstance(self.logit_bias, dict):
            pairs = list(self.logit_bias.items())
            if all(type(token_id) is int for token_id, _ in pairs):
                pairs.sort()
            object.__setattr__(self, "logit_bias", tuple(pairs))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(map(_pair, self.logit_bias)))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.bad_words is None:
            object.__setattr__(self, "bad_words", ())
        elif isinstance(self.bad_words, list):
            object.__setattr__(self, "bad_words", tuple(self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _pair(item: object) -> object:
    return tuple(item) if isinstance(item, list) else item


MAX_LOGPROBS = 20
#: logit_bias entries per request (OpenAI allows 300; each is one write per step)
MAX_LOGIT_BIAS = 1024
#: logit_bias values are in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0
#: allowed_token_ids per request (more than any vocabulary served; each is checked once)
MAX_ALLOWED_TOKEN_IDS = 2**18
#: bad words per request, and characters per word: every step compares each one's tokens
#: with the output's last tokens
MAX_BAD_WORDS = 128
MAX_BAD_WORD_LENGTH = 256
#: stop strings per request, and characters per stop string: every step checks each one
#: against the new text, so a request must not make that cost (or the hold-back index, which
#: grows with their length) unbounded for everyone on the frontend
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024
#: stop token ids per request: the scheduler looks each sampled token up in them every step
MAX_STOP_TOKEN_IDS = 1024
#: float32's smallest normal value: a positive double below it is 0 in the sampler
_FLOAT32_TINY = 1.1754943508222875e-38


def validate_sampling(
    params: SamplingParams, *, vocab_size: int | None = None, request_id: str | None = None
) -> None:
    """Check every field of ``params``: its type (a bool is not an int, a str is not a
    number), its range, and that every stage and transport can carry it (integers in int64,
    text with a UTF-8 form: :mod:`stages.checks`). ``vocab_size``: also check token ids
    against the vocabulary.

    Raises:
        InvalidRequestError: naming the first field that is wrong.
    """
    rid = request_id

    def fail(field: str, problem: str) -> None:
        raise InvalidRequestError(f"{field} {problem}", field=field, request_id=rid)

    if params.max_tokens is not None:
        check_int("max_tokens", params.max_tokens, minimum=1, request_id=rid)
    if check_number("temperature", params.temperature, request_id=rid) < 0:
        fail("temperature", f"must be >= 0, got {params.temperature}")
    top_p = check_number("top_p", params.top_p, request_id=rid)
    if not _FLOAT32_TINY <= top_p <= 1.0:
        fail("top_p", f"must be in (0, 1] (and at least {_FLOAT32_TINY:.3g}), got {params.top_p}")
    # -1 and 0 both disable top-k (vLLM's -1, and 0 as in the OpenAI-style servers)
    check_int("top_k", params.top_k, minimum=-1, request_id=rid)
    if not 0.0 <= check_number("min_p", params.min_p, request_id=rid) <= 1.0:
        fail("min_p", f"must be in [0, 1], got {params.min_p}")
    if check_number("repetition_penalty", params.repetition_penalty, request_id=rid) < (
        _FLOAT32_TINY
    ):
        fail(
            "repetition_penalty",
            f"must be > 0 (and at least {_FLOAT32_TINY:.3g}), got {params.repetition_penalty}",
        )
    for penalty in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= check_number(penalty, getattr(params, penalty), request_id=rid) <= 2.0:
            fail(penalty, f"must be in [-2, 2], got {getattr(params, penalty)}")
    if params.seed is not None:
        check_int("seed", params.seed, minimum=0, request_id=rid)
    _check_stop(params.stop, rid)
    if not isinstance(params.stop_token_ids, tuple):
        fail(
            "stop_token_ids", f"must be a list of token ids, got {describe(params.stop_token_ids)}"
        )
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        fail(
            "stop_token_ids",
            f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}",
        )
    check_token_ids(
        "stop_token_ids",
        params.stop_token_ids,
        vocab_size=vocab_size,
        allow_empty=True,
        request_id=rid,
    )
    check_int("min_tokens", params.min_tokens, minimum=0, request_id=rid)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        fail(
            "min_tokens", f"({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    if params.logprobs is not None:
        check_int("logprobs", params.logprobs, minimum=0, maximum=MAX_LOGPROBS, request_id=rid)
    if params.prompt_logprobs is not None:
        _check_prompt_logprobs(params.prompt_logprobs, vocab_size, rid)
    check_int("priority", params.priority, request_id=rid)
    validate_structured_outputs(params.structured_outputs, request_id=rid)
    _check_logit_bias(params.logit_bias, vocab_size, rid)
    if params.allowed_token_ids is not None:
        if isinstance(params.allowed_token_ids, tuple) and (
            len(params.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS
        ):
            fail(
                "allowed_token_ids",
                f"may hold at most {MAX_ALLOWED_TOKEN_IDS} ids, "
                f"got {len(params.allowed_token_ids)}",
            )
        check_token_ids(
            "allowed_token_ids", params.allowed_token_ids, vocab_size=vocab_size, request_id=rid
        )
        if not isinstance(params.allowed_token_ids, tuple):
            fail("allowed_token_ids", f"must be a list, got {describe(params.allowed_token_ids)}")
    _check_bad_words(params.bad_words, rid)
    if params.truncate_prompt_tokens is not None:
        check_int(
            "truncate_prompt_tokens", params.truncate_prompt_tokens, minimum=-1, request_id=rid
        )
        if params.truncate_prompt_tokens == 0:
            fail("truncate_prompt_tokens", "must be -1 (the model's length) or at least 1, got 0")
    for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        check_bool(flag, getattr(params, flag), request_id=rid)


def _check_prompt_logprobs(value: int, vocab_size: int | None, request_id: str | None) -> None:
    """``prompt_logprobs``: -1 (the whole vocabulary) or 0 to :data:`MAX_LOGPROBS` top
    alternatives; -1 only where the vocabulary (when known) is at most that many tokens, as
    vLLM's processor bounds it by ``max_logprobs`` (``vllm/v1/engine/processor.py``).

    Raises:
        InvalidRequestError: naming ``prompt_logprobs``.
    """
    check_int("prompt_logprobs", value, minimum=-1, maximum=MAX_LOGPROBS, request_id=request_id)
    if value == -1 and vocab_size is not None and vocab_size > MAX_LOGPROBS:
        raise InvalidRequestError(
            f"prompt_logprobs -1 asks for the whole vocabulary ({vocab_size} tokens) at every "
            f"prompt position; at most {MAX_LOGPROBS} are returned per position",
            field="prompt_logprobs",
            request_id=request_id,
        )


def _check_strings(
    field: str, values: object, *, most: int, noun: str, max_length: int, request_id: str | None
) -> tuple[str, ...]:
    """A request's list of strings ``field``: a tuple of at most ``most`` non-empty strings
    (``noun`` names them in the message) with a UTF-8 form, each of at most ``max_length``
    characters.

    Raises:
        InvalidRequestError: naming ``field``.
    """
    if not isinstance(values, tuple):
        raise InvalidRequestError(
            f"{field} must be a list of strings, got {describe(values)}",
            field=field,
            request_id=request_id,
        )
    if len(values) > most:
        raise InvalidRequestError(
            f"{field} may hold at most {most} {noun}, got {len(values)}",
            field=field,
            request_id=request_id,
        )
    for index, text in enumerate(values):
        check_text(
            field,
            text,
            max_length=max_length,
            allow_empty=False,
            request_id=request_id,
            where=f"{field}[{index}]",
        )
    return values


def _check_stop(stop: object, request_id: str | None) -> None:
    """Stop strings: at most MAX_STOP_STRINGS, each of at most MAX_STOP_STRING_LENGTH
    characters (:func:`_check_strings`).

    Raises:
        InvalidRequestError: naming ``stop``.
    """
    _check_strings(
        "stop",
        stop,
        most=MAX_STOP_STRINGS,
        noun="strings",
        max_length=MAX_STOP_STRING_LENGTH,
        request_id=request_id,
    )


def _check_logit_bias(bias: object, vocab_size: int | None, request_id: str | None) -> None:
    """``logit_bias``: at most MAX_LOGIT_BIAS (token id, bias) pairs of distinct ids, each
    bias a finite number in [-100, 100].

    Raises:
        InvalidRequestError: naming ``logit_bias``.
    """

    def fail(problem: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"logit_bias {problem}", field="logit_bias", request_id=request_id
        )

    if not isinstance(bias, tuple) or not all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in bias
    ):
        raise fail(f"must map token ids to biases, got {describe(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise fail(f"may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    token_ids = [token_id for token_id, _ in bias]
    check_token_ids(
        "logit_bias", token_ids, vocab_size=vocab_size, allow_empty=True, request_id=request_id
    )
    if len(set(token_ids)) != len(token_ids):
        raise fail("names a token id twice")
    for token_id, value in bias:
        number = check_number("logit_bias", value, request_id=request_id)
        if not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT:
            raise fail(f"of token {token_id} must be in [-100, 100], got {value}")


def _check_bad_words(words: object, request_id: str | None) -> None:
    """``bad_words``: at most MAX_BAD_WORDS words of at most MAX_BAD_WORD_LENGTH characters
    (:func:`_check_strings`), none only whitespace.

    Raises:
        InvalidRequestError: naming ``bad_words``.
    """
    checked = _check_strings(
        "bad_words",
        words,
        most=MAX_BAD_WORDS,
        noun="words",
        max_length=MAX_BAD_WORD_LENGTH,
        request_id=request_id,
    )
    for index, word in enumerate(checked):
        if not word.strip():
            raise InvalidRequestError(
                f"bad_words[{index}] must not be only whitespace",
                field="bad_words",
                request_id=request_id,
            )
