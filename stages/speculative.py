"""Speculative decoding's pure half: the config, the proposer protocol and the built-in n-gram
proposer, and the scheduler's :class:`Speculator` (which requests draft, how many tokens, the
back-off and the counters). No asyncio, zmq, grpc or torch (docs/speculative.md).

A proposer is a plugin of the ``actorline.proposers`` entry-point group (protocol version 1,
checked by :mod:`plugins`): a class constructed with the :class:`SpeculativeConfig` whose
``method`` names it, with a ``name`` and ``propose(token_ids, num_tokens)``. The built-in
``ngram`` is registered the same way. The scheduler asks the :class:`Speculator` for a draft
when it plans a request's decode; execute verifies the draft in the same forward pass
(:mod:`stages.execute.speculative`) and the scheduler reports back how much was accepted.

The ``draft_model`` method is built in and is no plugin: a second, smaller model drafts, and it
runs in the execute stage beside the target (:mod:`stages.execute.drafter`), whose step results
bring each request's next draft (:attr:`stages.messages.StepResult.draft_token_ids`); the
:class:`Speculator` hands those out instead of asking a proposer (as vLLM V1's drafters,
``vllm/v1/spec_decode/draft_model.py``, run in its model runner after the target samples).

The n-gram proposer is prompt lookup as vLLM's (``vllm/v1/spec_decode/ngram_proposer.py``):
the longest suffix of the request's tokens (prompt and output) of ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens that occurred earlier, and the tokens that followed its most recent
earlier occurrence (repeating, where they reach the end of the tokens: a loop goes on); the
config keys as vLLM's ``SpeculativeConfig`` (``vllm/config/speculative.py``), and its defaults
but for the n-gram bounds given neither (:data:`DEFAULT_PROMPT_LOOKUP_MIN`).
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
    "DEFAULT_DRAFT_TIMEOUT",
    "DEFAULT_PROMPT_LOOKUP_MAX",
    "DEFAULT_PROMPT_LOOKUP_MIN",
    "DRAFT_MODEL",
    "DRAFT_PLACEMENTS",
    "NOT_BUILT_METHODS",
    "PROPOSER_FREE_MISSES",
    "Backoff",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "SpeculativeStats",
    "Speculator",
    "accepted_drafts",
    "draft_room",
    "load_proposer",
    "may_draft",
    "parse_speculative_config",
]

API_VERSION = 1

#: the built-in method whose drafts come from a draft model run by the execute stage
DRAFT_MODEL = "draft_model"

#: vLLM's methods that actorline does not run yet: refused by name
NOT_BUILT_METHODS = (
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
#: the wholly rejected drafts in a row a proposer's request makes before it backs off at all:
#: in copy-heavy text a lone miss is an edit (the model changed a word), and the copy goes on
#: right after it, while a miss costs only the draft's extra rows of one step (about 2% of a
#: one-row step per row on a CPU, docs/speculative.md)
PROPOSER_FREE_MISSES = 1
#: the n-gram bounds when neither ``prompt_lookup_min`` nor ``prompt_lookup_max`` is given
#: (vLLM's are 5 and 5, "arbitrarily chosen" in ``vllm/config/speculative.py``): a 2-gram
#: matches again two tokens after an edit where a 5-gram needs five: 10% fewer steps over the
#: latency bench's greedy outputs, copy and chat prompts alike (docs/speculative.md)
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5

_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
    "quantization",
    "dtype",
    "draft_tensor_parallel_size",
    "placement",
    "draft_timeout",
)
#: the keys of the n-gram proposer alone / of the draft model alone
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
_DRAFT_KEYS = (
    "model",
    "quantization",
    "dtype",
    "draft_tensor_parallel_size",
    "placement",
    "draft_timeout",
)
#: where the draft model runs (``placement``): in the execute stage (``engine``) or as a
#: draft stage on a host of its own (``host``: a process, or a Ray actor under ``ray``)
DRAFT_PLACEMENTS = ("engine", "host")
#: how long the execute stage waits for a draft host's answer by default, in seconds
DEFAULT_DRAFT_TIMEOUT = 1.0
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
    proposer matches (2 and 5 when neither is given, where vLLM's are 5 and 5: see
    :data:`DEFAULT_PROMPT_LOOKUP_MIN`; one the other when one is, as vLLM's).
    ``disable_by_batch_size``: no request drafts while this many requests or more run.

    With ``method`` ``"draft_model"``: ``model`` (an alias, HF directory or ``.gguf`` file of
    the same vocabulary as the target), the draft model's own ``quantization`` (``"gguf"``,
    ``"int8"`` or None) and ``dtype`` (``"float32"`` unless given); ``draft_tensor_parallel_size``
    may only be 1 (the draft runs unsharded). ``placement`` (actorline's): where the draft
    model runs, ``"engine"`` (in the execute stage, the default) or ``"host"`` (a draft stage
    on a host of its own, :mod:`stages.execute.draft_stage`); ``draft_timeout``: how many
    seconds the execute stage waits for a draft host's proposals before it goes on without
    them. Its values are checked as the execute stage's own
    (:class:`stages.execute.config.ExecuteConfig`) when the engine's config is built.

    Raises:
        ValueError: naming the key that is wrong.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None
    quantization: str | None = None
    dtype: str = "float32"
    draft_tensor_parallel_size: int = 1
    placement: str = "engine"
    draft_timeout: float = DEFAULT_DRAFT_TIMEOUT

    @property
    def drafts_apart(self) -> bool:
        """Whether the draft model runs as a stage of its own (``placement`` ``"host"``)."""
        return self.drafts_in_execute and self.placement == "host"

    @property
    def drafts_in_execute(self) -> bool:
        """Whether the drafts come from a draft model in the execute stage (``draft_model``)
        rather than from a proposer the scheduler asks."""
        return self.method == DRAFT_MODEL

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(
                f"speculative_config: method must be a proposer name, got {self.method!r}"
            )
        if self.method in NOT_BUILT_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported yet; actorline "
                "runs 'ngram' (prompt lookup) and 'draft_model' for now"
            )
        if self.method == DRAFT_MODEL:
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError(
                    "speculative_config: method 'draft_model' needs model, the draft model's "
                    f"alias or path, got {self.model!r}"
                )
            if self.draft_tensor_parallel_size != 1:
                raise ValueError(
                    "speculative_config: draft_tensor_parallel_size must be 1 (the draft model "
                    f"runs unsharded), got {self.draft_tensor_parallel_size!r}"
                )
            if not isinstance(self.dtype, str):
                raise ValueError(f"speculative_config: dtype must be a string, got {self.dtype!r}")
            if self.placement not in DRAFT_PLACEMENTS:
                raise ValueError(
                    f"speculative_config: placement must be one of {', '.join(DRAFT_PLACEMENTS)}"
                    f" (where the draft model runs), got {self.placement!r}"
                )
            if type(self.draft_timeout) not in (int, float) or not 0 < self.draft_timeout <= 600:
                raise ValueError(
                    "speculative_config: draft_timeout must be seconds in (0, 600], got "
                    f"{self.draft_timeout!r}"
                )
        elif self.model is not None or self.quantization is not None or self.placement != "engine":
            raise ValueError(
                "speculative_config: model, quantization and placement are the draft model's "
                f"keys; method {self.method!r} takes none (use method 'draft_model')"
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
        """The config as the JSON object ``--speculative-config`` takes (its method's keys)."""
        fields = dataclasses.asdict(self)
        for key in _NGRAM_KEYS if self.drafts_in_execute else _DRAFT_KEYS:
            del fields[key]
        if self.method == DRAFT_MODEL and self.placement == "engine":
            del fields["draft_timeout"]  # a draft host's key (refused beside 'engine')
        return json.dumps(fields, sort_keys=True)


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
    method = fields.get("method", DRAFT_MODEL if "model" in fields else "ngram")
    fields["method"] = method
    if method in NOT_BUILT_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported yet; actorline runs "
            "'ngram' (prompt lookup) and 'draft_model' for now"
        )
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(_KEYS)}"
        )
    if "num_speculative_tokens" not in fields:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    if method == DRAFT_MODEL:
        given = sorted(set(fields) & set(_NGRAM_KEYS))
        if given:
            raise ValueError(
                f"speculative_config: {', '.join(map(repr, given))} are the n-gram proposer's "
                "keys; method 'draft_model' takes none"
            )
        if fields.get("dtype") is None:
            fields["dtype"] = "float32"
        if fields.get("draft_tensor_parallel_size") is None:
            fields["draft_tensor_parallel_size"] = 1
        if fields.get("disable_by_batch_size") is None:
            fields["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
        if fields.get("placement") is None:
            fields["placement"] = "engine"
        if fields.get("draft_timeout") is not None and fields["placement"] == "engine":
            # accepted and ignored would be a lie: in the execute stage nothing waits
            raise ValueError(
                "speculative_config: draft_timeout is how long the execute stage waits for a "
                "draft host's answer; with placement 'engine' the draft model runs in the "
                "execute stage and nothing waits (use placement 'host', or drop draft_timeout)"
            )
        if fields.get("draft_timeout") is None:
            fields["draft_timeout"] = DEFAULT_DRAFT_TIMEOUT
        return SpeculativeConfig(**fields)
    given = sorted(set(fields) & set(_DRAFT_KEYS))
    if given:
        raise ValueError(
            f"speculative_config: {', '.join(map(repr, given))} are the draft model's keys; "
            f"method {method!r} takes none (use method 'draft_model')"
        )
    # as vLLM's (vllm/config/speculative.py) one lookup bound gives the other; neither: ours
    low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
    if low is None and high is None:
        low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
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


def draft_room(step_graph_rows: int, num_decoding: int) -> int:
    """The most draft tokens each of ``num_decoding`` decoding requests may add so that a step
    of their rows stays within one step graph pass of ``step_graph_rows`` rows. A step of more
    rows takes the model's module path, many times slower per step on a CPU (fp32's graph runs
    16 rows: four streams of ``k`` 4 are 20 rows), so drafting across that line costs more
    than it saves. No bound (a large number) with no step graph (0 rows) or where the plain
    decode rows exceed it already (the step takes the module path with or without drafts).
    """
    if step_graph_rows < 1 or num_decoding > step_graph_rows:
        return 1 << 30
    return max(0, step_graph_rows // max(1, num_decoding) - 1)


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
    #: drafts the draft model failed to deliver (it raised, or its host answered late or died)
    num_drafts_dropped: int = 0

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
            "spec_num_drafts_dropped": self.num_drafts_dropped,
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


class Backoff:
    """Per-request back-off after wholly rejected drafts: after ``free_misses`` wholly
    rejected drafts in a row, each further one makes the request skip 1, 3, 7, ... steps (up
    to :data:`MAX_BACKOFF_STEPS`) before drafting again; any accepted token resets it. The
    scheduler keeps one for its proposers (:data:`PROPOSER_FREE_MISSES`), the execute stage's
    drafter one for the draft model (none free: a draft model's miss costs its ``k`` steps).

    Raises:
        ValueError: ``free_misses`` below 0.
    """

    def __init__(self, free_misses: int = 0) -> None:
        if type(free_misses) is not int or free_misses < 0:
            raise ValueError(f"free_misses must be an integer >= 0, got {free_misses!r}")
        self.free_misses = free_misses
        self._states: dict[str, _Backoff] = {}

    def skips(self, request_id: str) -> bool:
        """Whether the request skips drafting this step (counting the step down)."""
        state = self._states.get(request_id)
        if state is not None and state.skip > 0:
            state.skip -= 1
            return True
        return False

    def observe(self, request_id: str, num_accepted: int) -> None:
        """A verified draft of the request had ``num_accepted`` tokens accepted."""
        state = self._states.setdefault(request_id, _Backoff())
        if num_accepted == 0:
            state.misses += 1
            if state.misses > self.free_misses:
                state.skip = min(2 ** (state.misses - self.free_misses) - 1, MAX_BACKOFF_STEPS)
        else:
            state.misses = state.skip = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._states.pop(request_id, None)


class Speculator:
    """The scheduler's side of speculative decoding: a proposer, the per-request
    :class:`Backoff` and the counters. With ``draft_model`` there is no proposer here: the
    drafts come with execute's step results (:meth:`receive`) and the drafter there backs
    off itself."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer: Proposer | None = None
        if not config.drafts_in_execute:
            self.proposer = proposer if proposer is not None else load_proposer(config)
        self._backoff = Backoff(0 if config.drafts_in_execute else PROPOSER_FREE_MISSES)
        #: request id -> the draft execute proposed after its last step (draft_model)
        self._received: dict[str, tuple[int, ...]] = {}
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._per_position = [0] * config.num_speculative_tokens
        self._num_dropped = 0

    def enabled_for(self, num_running: int) -> bool:
        """Whether requests draft at all with ``num_running`` requests running."""
        return num_running < self.config.disable_by_batch_size

    def propose(self, request_id: str, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``min(num_speculative_tokens, limit)`` tokens for the request
        (empty while it backs off). With ``draft_model``: the draft execute proposed with the
        request's last step, if any (taken: it follows the tokens as they are now)."""
        if self.proposer is None:
            received = self._received.pop(request_id, ())
            return received[: max(0, min(self.config.num_speculative_tokens, limit))]
        if self._backoff.skips(request_id):
            return ()
        num_tokens = min(self.config.num_speculative_tokens, limit)
        if num_tokens < 1:
            return ()
        draft = tuple(self.proposer.propose(token_ids, num_tokens))[:num_tokens]
        return draft

    def receive(
        self,
        request_ids: Collection[str],
        drafts: Mapping[str, tuple[int, ...]],
        dropped: int = 0,
    ) -> None:
        """Take execute's drafts for the requests that got tokens in a step (``request_ids``;
        ``draft_model``): each replaces the request's last one, and a request that got tokens
        and no draft has none (a draft follows the tokens it was made after). ``dropped``:
        the step's drafts the draft model failed to deliver (counted)."""
        self._num_dropped += dropped
        for request_id in request_ids:
            draft = drafts.get(request_id)
            if draft:
                self._received[request_id] = tuple(draft)
            else:
                self._received.pop(request_id, None)

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
        self._backoff.observe(request_id, num_accepted)

    def forget(self, request_id: str) -> None:
        """Drop a finished or preempted request's back-off and received draft."""
        self._backoff.forget(request_id)
        self._received.pop(request_id, None)

    def stats(self) -> SpeculativeStats:
        """The counters so far."""
        return SpeculativeStats(
            self._num_drafts,
            self._num_draft_tokens,
            self._num_accepted,
            tuple(self._per_position),
            self._num_dropped,
        )
