"""Speculative decoding's pure half: the config, the proposer protocol and the built-in n-gram
proposer, and the scheduler's :class:`Speculator` (which requests draft, how many tokens, the
back-off and the counters). No asyncio, zmq, grpc or torch (docs/speculative.md).

A proposer is a plugin of the ``actorline.proposers`` entry-point group (protocol version 1,
checked by :mod:`plugins`): a class constructed with the :class:`SpeculativeConfig` whose
``method`` names it, with a ``name`` and ``propose(token_ids, num_tokens)``. The built-in
``ngram`` is registered the same way. The scheduler asks the :class:`Speculator` for a draft
when it plans a request's decode; execute verifies the draft in the same forward pass
(:mod:`stages.execute.speculative`) and the scheduler reports back how much was accepted.

The n-gram proposer is prompt lookup as vLLM's (``vllm/v1/spec_decode/ngram_proposer.py``):
the longest suffix of the request's tokens (prompt and output) of ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens that occurred earlier, and the tokens that followed its most recent
earlier occurrence (repeating, where they reach the end of the tokens: a loop goes on); the
config keys and their defaults as vLLM's ``SpeculativeConfig`` (``vllm/config/speculative.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from plugins import PROPOSERS, PluginError, available, load
from stages.params import SamplingParams

__all__ = [
    "API_VERSION",
    "NOT_BUILT_METHODS",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "SpeculativeStats",
    "Speculator",
    "accepted_drafts",
    "load_proposer",
    "may_draft",
    "parse_speculative_config",
]

API_VERSION = 1

#: vLLM's methods that actorline does not run yet: refused by name
NOT_BUILT_METHODS = (
    "draft_model",
    "eagle",
    "eagle3",
    "medusa",
    "mlp_speculator",
    "mtp",
    "suffix",
)

#: a request whose drafts were all rejected this many times in a row skips at most this many
#: steps before it drafts again (the skip doubles with each miss: 1, 3, 7, ...)
MAX_BACKOFF_STEPS = 32

_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)
#: the default of disable_by_batch_size: at this many running requests or more no one drafts
#: (a CPU step there is no longer bound by reading the weights once)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding as vLLM's ``speculative_config`` (its keys).

    ``method``: the proposer (a name of the ``actorline.proposers`` group; built in:
    ``"ngram"``). ``num_speculative_tokens``: the most tokens drafted per step.
    ``prompt_lookup_max`` / ``prompt_lookup_min``: the longest and shortest n-gram the n-gram
    proposer matches (vLLM's defaults: 5 and 5 when neither is given, one the other when one
    is). ``disable_by_batch_size``: no request drafts while this many requests or more run.

    Raises:
        ValueError: naming the key that is wrong.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(
                f"speculative_config: method must be a proposer name, got {self.method!r}"
            )
        if self.method in NOT_BUILT_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported yet; actorline "
                "runs 'ngram' (prompt lookup) for now"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            _positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} must not "
                f"exceed prompt_lookup_max {self.prompt_lookup_max}"
            )

    def to_json(self) -> str:
        """The config as the JSON object ``--speculative-config`` takes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """Read ``speculative_config`` as given: None, a :class:`SpeculativeConfig`, a mapping of
    vLLM's keys or its JSON text (the CLI's ``--speculative-config``).

    Raises:
        ValueError: not JSON, not an object, an unknown key, a missing
            ``num_speculative_tokens``, a method not built yet or not installed, or a bad
            value (the message names the key).
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(
            "speculative_config must be a mapping (or its JSON text) of "
            f"{', '.join(_KEYS)}, got {type(value).__name__}"
        )
    fields: dict[str, Any] = dict(value)
    method = fields.get("method", "ngram")
    if method in NOT_BUILT_METHODS or "model" in fields:
        shown = method if method in NOT_BUILT_METHODS else "draft_model"
        raise ValueError(
            f"speculative_config: method {shown!r} is not supported yet; actorline runs "
            "'ngram' (prompt lookup) for now"
        )
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(_KEYS)}"
        )
    if "num_speculative_tokens" not in fields:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    # vLLM's defaults (vllm/config/speculative.py): one lookup bound gives the other
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    elif low is None:
        low = high
    elif high is None:
        high = low
    fields["prompt_lookup_min"], fields["prompt_lookup_max"] = low, high
    if fields.get("disable_by_batch_size") is None:
        fields["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
    config = SpeculativeConfig(**fields)
    if config.method not in available(PROPOSERS):
        raise ValueError(
            f"speculative_config: method {config.method!r} names no installed proposer; "
            f"available: {', '.join(available(PROPOSERS)) or '(none)'}"
        )
    return config


def may_draft(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a decoding request with ``params`` and this many output tokens may draft: the
    sampler must treat every verified row as it treats one decode row, so not with logprobs
    (one entry per step), penalties or bad words (they read the output so far), structured
    outputs (the grammar's matcher advances one token a step), before ``min_tokens`` (EOS is
    masked by the output's length), nor before its first token. Such a request decodes one
    token a step, exactly as without speculation (docs/speculative.md)."""
    return (
        num_output_tokens >= max(1, params.min_tokens)
        and params.logprobs is None
        and params.structured_outputs is None
        and not params.bad_words
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


@runtime_checkable
class Proposer(Protocol):
    """A plugin of ``actorline.proposers``: constructed with the :class:`SpeculativeConfig`,
    it drafts the tokens that may follow a request's tokens."""

    name: str

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """Up to ``num_tokens`` tokens that may follow ``token_ids`` (prompt then output);
        empty when it has no guess."""
        ...


class NgramProposer:
    """Prompt lookup (see the module docstring)."""

    name = "ngram"
    api_version: ClassVar[int] = API_VERSION

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """The tokens after the most recent earlier occurrence of the longest suffix n-gram
        (``max_n`` down to ``min_n`` tokens), at most ``num_tokens``."""
        length = len(token_ids)
        if num_tokens < 1 or length < self.min_n + 1:
            return ()
        last = token_ids[-1]
        best_length, best_end = 0, -1
        # NOTE: an occurrence ends at j < length - 1 (the suffix itself is no earlier
        # occurrence); scanning back from the most recent, only a strictly longer match
        # replaces the one found, so ties go to the most recent.
        for j in range(length - 2, -1, -1):
            if token_ids[j] != last:
                continue
            matched = 1
            while (
                matched < self.max_n
                and matched <= j
                and token_ids[j - matched] == token_ids[length - 1 - matched]
            ):
                matched += 1
            if matched > best_length:
                best_length, best_end = matched, j
                if matched == self.max_n:
                    break
        if best_length < self.min_n:
            return ()
        # NOTE: where the continuation reaches the end of the tokens it repeats itself (the
        # match ran into a loop: "a b a b" continues "a b a b ..."), instead of stopping short
        start = best_end + 1
        period = length - start
        return tuple(token_ids[start + index % period] for index in range(num_tokens))


def load_proposer(config: SpeculativeConfig) -> Proposer:
    """Load the ``actorline.proposers`` plugin ``config.method`` and construct it with
    ``config``.

    Raises:
        plugins.PluginError: no such proposer, it failed to import, it breaks the protocol,
            its constructor raised, or its ``name`` is not a string.
    """
    component = load(PROPOSERS, config.method)
    try:
        proposer = component(config)
    except Exception as exc:
        raise PluginError(
            f"{PROPOSERS} plugin {config.method!r} failed to construct: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(getattr(proposer, "name", None), str):
        raise PluginError(f"{PROPOSERS} plugin {config.method!r} has a non-string name")
    result: Proposer = proposer
    return result


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """Cumulative counters (vLLM's ``spec_decode`` metrics): verified drafts, their tokens,
    the tokens accepted, and for each draft position how often it was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def engine_stats(self) -> dict[str, Any]:
        """The counters as :class:`stages.messages.EngineStats` fields (``spec_*``)."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_position": self.accepted_per_position,
        }


def accepted_drafts(
    drafts: Mapping[str, tuple[int, ...]],
    accepted: Mapping[str, tuple[int, ...]],
    preempted: Collection[str],
) -> dict[str, tuple[int, ...]]:
    """Check execute's answer to a step's drafts: each drafting request that was not
    ``preempted`` has accepted tokens (maybe none) that begin its draft, and no other has.

    Returns:
        request id -> accepted draft tokens, for those requests.
    Raises:
        ValueError: naming the request whose answer is missing or wrong.
    """
    for request_id in accepted:
        if not drafts.get(request_id) or request_id in preempted:
            raise ValueError(f"accepted draft tokens of {request_id!r}, which drafted none")
    checked: dict[str, tuple[int, ...]] = {}
    for request_id, draft in drafts.items():
        if not draft or request_id in preempted:
            continue
        taken = accepted.get(request_id)
        if taken is None or tuple(draft[: len(taken)]) != tuple(taken):
            raise ValueError(
                f"accepted tokens {taken!r} of {request_id!r} are no prefix of its draft {draft!r}"
            )
        checked[request_id] = tuple(taken)
    return checked


@dataclasses.dataclass(slots=True)
class _Backoff:
    misses: int = 0  # drafts in a row with no token accepted
    skip: int = 0  # steps left before it drafts again


class Speculator:
    """The scheduler's side of speculative decoding: a proposer, the per-request back-off and
    the counters. A request whose draft is wholly rejected skips 1, 3, 7, ... steps (up to
    :data:`MAX_BACKOFF_STEPS`) before drafting again; any accepted token resets it."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else load_proposer(config)
        self._backoff: dict[str, _Backoff] = {}
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._per_position = [0] * config.num_speculative_tokens

    def enabled_for(self, num_running: int) -> bool:
        """Whether requests draft at all with ``num_running`` requests running."""
        return num_running < self.config.disable_by_batch_size

    def propose(self, request_id: str, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``min(num_speculative_tokens, limit)`` tokens for the request
        (empty while it backs off)."""
        backoff = self._backoff.get(request_id)
        if backoff is not None and backoff.skip > 0:
            backoff.skip -= 1
            return ()
        num_tokens = min(self.config.num_speculative_tokens, limit)
        if num_tokens < 1:
            return ()
        draft = tuple(self.proposer.propose(token_ids, num_tokens))[:num_tokens]
        return draft

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """Count a verified draft of ``num_drafted`` tokens of which the first
        ``num_accepted`` were accepted, and back off after a total miss."""
        if num_drafted < 1:
            return
        self._num_drafts += 1
        self._num_draft_tokens += num_drafted
        self._num_accepted += num_accepted
        for position in range(min(num_accepted, len(self._per_position))):
            self._per_position[position] += 1
        backoff = self._backoff.setdefault(request_id, _Backoff())
        if num_accepted == 0:
            backoff.misses += 1
            backoff.skip = min(2**backoff.misses - 1, MAX_BACKOFF_STEPS)
        else:
            backoff.misses = backoff.skip = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's back-off."""
        self._backoff.pop(request_id, None)

    def stats(self) -> SpeculativeStats:
        """The counters so far."""
        return SpeculativeStats(
            self._num_drafts,
            self._num_draft_tokens,
            self._num_accepted,
            tuple(self._per_position),
        )
