"""Every message the LLM stages exchange, registered with the codec under
their tags in :data:`transports.tags.WIRE_TAGS` (100-199).

Flow of the default pipeline::

    api ─GenerateRequest─▶ tokenize ─EngineRequest─▶ admit ─EngineRequest─▶ schedule
                              │                        │ RequestRejected        ▲  │
                              │ EngineRequest (track)  ▼                        │  │ SchedulerStep
                              └──────────────────▶ detokenize ◀─EngineOutputs───┘  ▼
                                                       │ TextOutputs         execute
                                                       ▼                 (StepResult, EngineInfo)
    api ◀─RequestOutputs──────────────────────── stop_check ─AbortRequests─▶ schedule

Hot messages (one per engine step, covering every running request) are columnar: parallel
tuples instead of one object per request, which keeps encoding cheap at hundreds of requests.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.errors import RequestError
from stages.kv_transfer import KvBlocks
from stages.lora import LoRARequest
from stages.params import SamplingParams
from stages.pooling import PoolingParams
from transports.codec import message

__all__ = [
    "AbortRequests",
    "ChatMessage",
    "ChatRendering",
    "EngineInfo",
    "EngineOutputs",
    "EngineRequest",
    "EngineStats",
    "GenerateRequest",
    "Logprobs",
    "OutputParsing",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputs",
    "RequestRejected",
    "ScheduledChunk",
    "SchedulerStep",
    "StepResult",
    "TextOutputs",
    "ToolCall",
    "ToolSpec",
]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: in an assistant message of a chat's history, or made by the model
    (parsed from its output by the parse stage). ``arguments``: JSON text (in a streamed
    output, the text generated so far)."""

    id: str
    name: str
    arguments: str


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call (OpenAI's ``tools[i].function``): its name, what it does
    and its ``parameters`` as JSON-schema text ("" when none was given)."""

    name: str
    description: str = ""
    parameters: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message. ``tool_calls``: the calls an assistant message made;
    ``tool_call_id``: the call a ``tool`` message answers ("" in other messages)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ChatRendering:
    """How the chat template renders a request's messages, as vLLM's request fields
    (``vllm/entrypoints/openai/chat_completion/protocol.py``, ``ChatCompletionRequest``):
    ``template``, a Jinja chat template used instead of the model's ("": the model's);
    ``template_kwargs``, a JSON object (text; "": none) whose keys the template reads as
    variables (``enable_thinking``); ``add_generation_prompt``, end with the assistant's
    opening; ``continue_final_message``, leave the last message open for the model to
    continue (not with ``add_generation_prompt``). Checked by
    :func:`stages.chat_template.check_rendering`."""

    template: str = ""
    template_kwargs: str = ""
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class OutputParsing:
    """How the parse stage reads a request's output (docs/architecture.md §2.8):
    ``tool_parser``, the tool-call parser plugin (``actorline.tool_parsers``; "" none);
    ``tool_choice``: ``"auto"`` (calls parsed from the model's own format), ``"required"``
    (a JSON list of calls, enforced by the request's grammar) or ``"function"`` (the output is
    the arguments of ``function``, enforced likewise); ``reasoning_parser``: the reasoning
    parser plugin (``actorline.reasoning_parsers``; "" none); ``parallel``: several calls may
    be kept (else only the first)."""

    tool_parser: str = ""
    tool_choice: str = "auto"
    function: str = ""
    reasoning_parser: str = ""
    parallel: bool = True


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A request as the API receives it: exactly one of ``prompt``, ``messages`` or
    ``prompt_token_ids`` is set. ``chat_template``: apply the model's chat template to
    ``messages`` (always) or to a plain ``prompt`` (when True). ``tools``: the functions the
    model may call (rendered into the prompt by the chat template); ``tool_choice``:
    ``"none"``, ``"auto"``, ``"required"`` or the name of the one function to call ("" with no
    tools); ``parallel_tool_calls``: whether several calls may be made at once.
    ``rendering``: how the chat template renders (None: the model's template, with the
    generation prompt). ``parent_id`` and ``n``: the request is one of the ``n`` choices of
    the caller's request ``parent_id`` ("" and 1: a request of its own), as vLLM's parallel
    sampling children (``vllm/v1/engine/parallel_sampling.py``); metrics count the parent
    once (``vllm:request_params_n``). ``pooling``: an embedding
    request (prefill only: its output carries the pooled vector, no tokens;
    docs/architecture.md §12); None: a generation request."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    chat_template: bool = False
    tenant: str = ""
    arrival_time: float = 0.0
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = ""
    parallel_tool_calls: bool = True
    rendering: ChatRendering | None = None
    parent_id: str = ""
    n: int = 1
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class EngineRequest:
    """A tokenized request, from tokenize to admit and schedule (and to detokenize, which
    registers the request's text state). ``parsing``: how the parse stage reads its output
    (None: it passes through). ``bad_words_token_ids``: the token sequences of
    ``params.bad_words``, tokenized by the tokenize stage (vLLM's ``_bad_words_token_ids``).
    ``pooling``: an embedding request, ``lora`` its adapter (see :class:`GenerateRequest`).
    ``kv_blocks``: its prompt's leading blocks as a prefill engine computed them, which the
    execute stage imports into its prefix cache before the request's first step
    (disaggregated prefill and decode, :mod:`stages.kv_transfer`). ``kv_to``: on a prefill
    engine, the decode engine's execute stage its prompt's blocks go to; ``kv_from``: on a
    decode engine, the prefill engine's execute stage whose blocks wait for it in this
    engine's execute stage (:class:`~stages.kv_transfer.KvInbox`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = ""
    arrival_time: float = 0.0
    prompt: str | None = None
    parsing: OutputParsing | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None
    kv_blocks: KvBlocks | None = None
    kv_to: str = ""
    kv_from: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class RequestRejected:
    """A request refused before running (or failed). ``kind`` is a
    :data:`stages.errors.ERROR_KINDS` key; ``field`` names the offending input;
    ``retry_after``: seconds until a retry may be accepted, when known. ``abort``: the
    request failed in a frontend stage after it entered the engine, which may still run it:
    stop-check aborts it there."""

    request_id: str
    kind: str
    message: str
    field: str | None = None
    retry_after: float | None = None
    abort: bool = False

    @classmethod
    def of(cls, request_id: str, error: RequestError, *, abort: bool = False) -> RequestRejected:
        """The rejection that carries ``error`` to the caller of ``request_id``."""
        return cls(request_id, type(error).kind, str(error), error.field, error.retry_after, abort)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequests:
    """Stop these requests and free their KV blocks at once (from the API or stop-check)."""

    request_ids: tuple[str, ...]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the execute stage reports once its model and KV cache are ready."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    kv_cache_bytes: int
    enable_prefix_caching: bool
    # The window every layer attends within (None: some layer sees the whole context): the
    # blocks behind it are freed as a request advances (docs/architecture.md §6.2).
    sliding_window: int | None = None
    # Weight-only quantization in use ("gguf", "int8"; None: fp32 weights) and the bytes of
    # the model's weights as loaded (docs/architecture.md §6.3).
    quantization: str | None = None
    weight_bytes: int = 0
    # Embeddings (docs/architecture.md §12): the size of the pooled vector (the hidden size;
    # 0: this engine computes none), how it pools, and the sizes a request's `dimensions` may
    # take (None: not a Matryoshka model; (): any size up to embedding_size).
    embedding_size: int = 0
    pooling_type: str = ""
    matryoshka_dimensions: tuple[int, ...] | None = None
    # What the KV cache stores ("float32", "bfloat16", ...; kv_cache_dtype resolved): with
    # native bf16 weights on CPU the activations are fp32 and the cache bf16.
    kv_cache_dtype: str = "float32"
    # How the engine process's OpenMP threads wait between regions, in words
    # (pipeline.runtime.omp_policy.wait_policy_in_effect; "" where not reported).
    omp_wait_policy: str = ""
    # With enable_lora (docs/lora.md): the projections an adapter may target, each
    # ``(name, in_features, out_features)``, and the layers they are in (the frontend checks
    # an adapter against them before sending its request; empty: no LoRA).
    lora_targets: tuple[tuple[str, int, int], ...] = ()
    lora_layers: int = 0
    # The most rows one CPU step graph pass runs (0: no step graph): a step of more decode rows
    # takes the module path, so the scheduler keeps drafted steps within it
    # (docs/speculative.md).
    step_graph_rows: int = 0
    # The draft model of speculative decoding (docs/speculative.md; "" and 0: none, or none
    # loaded): its name, its own KV cache (blocks of block_size tokens, bytes) and the host
    # it runs on (the engine's host beside the target, or its draft stage's host).
    draft_model: str = ""
    draft_num_blocks: int = 0
    draft_kv_cache_bytes: int = 0
    draft_host: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of a request this step. When the chunk
    reaches the end of the request's known tokens, execute samples the next token.

    ``draft_token_ids``: speculative decoding (docs/speculative.md): the chunk's last
    ``len(draft_token_ids)`` tokens are these drafted ones, which follow the request's known
    tokens; execute verifies them in the same pass and answers in
    :attr:`StepResult.accepted_token_ids`.
    """

    request_id: str
    start: int
    num_tokens: int
    draft_token_ids: tuple[int, ...] = ()


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStep:
    """One batch for execute. Execute first frees the blocks of ``finished`` (done or aborted:
    request state dropped) and ``preempted`` (state kept, recomputed later), then registers
    ``new_requests``, then runs ``chunks``. An empty ``chunks`` is a free-only step.

    Structured outputs: ``grammar_request_ids[i]`` samples this step under row ``i`` of
    ``grammar_bitmask`` (``int32``, the tokens its grammar allows next; the layout of
    :mod:`stages.structured.backend`), which the sampler applies
    (:mod:`stages.execute.grammar_mask`).
    """

    step_id: int
    new_requests: tuple[EngineRequest, ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    finished: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    grammar_request_ids: tuple[str, ...] = ()
    grammar_bitmask: np.ndarray | None = None
    # whether execute's prefix cache may serve a chunk past its end with free blocks no chunk
    # of this step needs (False with several steps in flight: the later ones were planned on
    # those blocks; stages.steps_in_flight)
    spare_blocks: bool = True


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class Logprobs:
    """Log-probabilities for one sampled token: the token's own, then the top alternatives
    (``top_token_ids[i]`` has ``top_logprobs[i]``; highest first)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """Execute's answer to a :class:`SchedulerStep`.

    ``request_ids[i]`` sampled ``token_ids[i]``. ``logprobs`` lists entries only for requests
    that asked (matched by ``logprob_request_ids``). ``cached_tokens`` maps requests whose
    prefix-cache hit started or grew this step to the tokens served from the cache so far;
    ``computed_tokens`` maps requests the cache served past their chunk's end to the tokens
    they have computed now (the next chunk starts there).
    ``preempted``: requests execute had to drop for lack of blocks (not computed this step).
    ``shared_blocks``: for each request holding blocks that other requests hold too (shared
    prefixes), how many; freeing it frees only its other blocks. Prefix-cache counters are
    cumulative, in tokens. ``communication_seconds``: time rank 0 spent in tensor-parallel
    collectives this step (waiting for the slowest rank included; 0 without tensor
    parallelism). ``prompt_logprobs``: for each request that asked for them
    (``params.prompt_logprobs``) and sampled its first token this step, the scores of its
    prompt tokens after the first (one entry per token, in order; computed over the steps
    its prompt took).
    ``embeddings``: the pooled vector (``float32 [dimensions]``) of each embedding request
    whose last chunk ran this step, instead of a token.
    ``accepted_token_ids``: for each request whose chunk carried a draft, the leading draft
    tokens the target accepted (maybe none); its new tokens are these, then its entry of
    ``token_ids`` (the corrected or bonus token). Its computed tokens are the chunk's start
    plus one plus the accepted ones: the rejected tokens' KV slots are rolled back.
    ``draft_token_ids``: with a draft model (docs/speculative.md), for requests that got
    tokens this step, the draft the execute stage's drafter proposes to follow them (the
    scheduler may send it, cut shorter, with the request's next chunk). ``drafts_dropped``:
    how many requests asked the draft model for a draft this step and got none because it
    failed or answered too late (a draft stage placed apart, :mod:`stages.execute.draft_stage`).
    """

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    free_blocks: int
    total_blocks: int
    logprob_request_ids: tuple[str, ...] = ()
    logprobs: tuple[Logprobs, ...] = ()
    cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    computed_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    preempted: tuple[str, ...] = ()
    shared_blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_computed_tokens: int = 0
    forward_seconds: float = 0.0
    communication_seconds: float = 0.0
    prompt_logprobs: dict[str, tuple[Logprobs, ...]] = dataclasses.field(default_factory=dict)
    embeddings: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # the thread count execute steps on from now, where it changed (stages.execute.contention;
    # 0: unchanged)
    threads: int = 0
    accepted_token_ids: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    draft_token_ids: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    drafts_dropped: int = 0
    # pipeline micro-batches (stages.steps_in_flight): the last step execute had prepared
    # when it counted free_blocks (-1: this one), and each shard's busy seconds in this step
    prepared_through: int = -1
    shard_seconds: tuple[float, ...] = ()
    # pipeline parallelism: the bytes of the last shard's answer on the wire (its sampled
    # tokens and logprobs: stages.execute.pp_sampling)
    pipeline_answer_bytes: int = 0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """Scheduler and KV gauges after a step (cumulative counters are totals since start).
    ``step_seconds`` and ``forward_seconds`` are the last step's; ``communication_seconds``
    is the total time rank 0 spent in tensor-parallel collectives since start. ``replica``:
    the engine replica these are of, with data parallelism ("" with one). ``step_tokens``: the
    tokens the last step computed (its prompt chunks' tokens plus one per decoding request).
    ``spec_*``: speculative decoding's counters (:class:`stages.speculative.SpeculativeStats`:
    verified drafts, drafted and accepted tokens, acceptances per draft position, and drafts
    the draft model failed to deliver)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    communication_seconds: float = 0.0
    replica: str = ""
    step_tokens: int = 0
    # the threads the execute stage steps on (contention fallback: one while the machine is
    # oversubscribed; stages.execute.contention); 0 until it reports
    execute_threads: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_num_drafts_dropped: int = 0
    # each pipeline shard's busy seconds since start (stages.steps_in_flight; () with one)
    shard_busy_seconds: tuple[float, ...] = ()
    # the bytes the last pipeline shard's answers took on the wire since start (0 with one)
    pipeline_answer_bytes: int = 0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class EngineOutputs:
    """New tokens of one engine step, columnar: ``request_ids[i]`` got ``new_token_ids[i]``
    and, when it finished this step, ``finish_reasons[i]`` ("stop", "length", "abort")
    with ``stop_reasons[i]`` (the stop token id, if a stop token ended it).
    ``scheduler_times``: for each request whose first token this is, ``(queue_seconds,
    prefill_seconds)`` on the scheduler's clock: from its arrival at the scheduler to its first
    scheduled chunk, and from there to this token (vLLM's queued and prefill intervals).
    ``prompt_logprobs``: with a request's first token, its prompt's scores when it asked for
    them (:class:`StepResult`).
    ``embeddings``: the vector of each embedding request that finished this step (with no
    new tokens and ``"stop"``)."""

    request_ids: tuple[str, ...]
    new_token_ids: tuple[tuple[int, ...], ...]
    finish_reasons: tuple[str | None, ...]
    stop_reasons: tuple[int | None, ...]
    logprobs: dict[str, tuple[Logprobs, ...]] = dataclasses.field(default_factory=dict)
    num_cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: EngineStats | None = None
    scheduler_times: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[Logprobs, ...]] = dataclasses.field(default_factory=dict)
    embeddings: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class TextOutputs:
    """Detokenized step outputs for stop-check: per request the new text (complete UTF-8
    characters only), same columns as :class:`EngineOutputs` plus ``texts``."""

    request_ids: tuple[str, ...]
    new_token_ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    finish_reasons: tuple[str | None, ...]
    stop_reasons: tuple[int | None, ...]
    logprobs: dict[str, tuple[Logprobs, ...]] = dataclasses.field(default_factory=dict)
    num_cached_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: EngineStats | None = None
    scheduler_times: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[Logprobs, ...]] = dataclasses.field(default_factory=dict)
    embeddings: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timing of one request as its caller saw it (seconds). ``arrival_time`` is wall-clock
    time; ``time_to_first_token`` is None until the first token, ``total_time`` until the end."""

    arrival_time: float
    time_to_first_token: float | None = None
    total_time: float | None = None


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """What a caller sees for one request after a step.

    ``text`` is cumulative, ``delta`` the new text since the previous output, ``token_ids``
    all generated tokens so far. ``finish_reason`` is None while running, then "stop",
    "length", "abort" or "error". ``stop_reason``: the stop string or token id that ended it.
    ``metrics``: timing, filled in by the API. ``scheduler_times``: on the output that
    carries the request's first token only, ``(queue_seconds, prefill_seconds, replica)`` as
    the scheduler measured them (:class:`EngineOutputs`), with the engine replica that ran it
    ("" with one); a caller of the engine finds them on the first output it reads. When the
    request's output is parsed (the
    parse stage), ``text``/``delta`` hold its content only, ``reasoning`` the reasoning text so
    far and ``tool_calls`` the calls so far (the last one's arguments possibly still growing),
    both cumulative: a stream's deltas are what is new since the previous output.
    ``prompt_token_ids``: the prompt's token ids, as the tokenize stage made them (chat
    template applied). ``prompt_logprobs`` (when ``params.prompt_logprobs`` was set;
    vLLM's field): one entry per prompt token, None for the first (nothing comes before
    it), then each token's :class:`Logprobs` given the tokens before it. Stop-check puts
    each on one output only (the ids on the first, the scores on the first token's), and
    the engine's caller finds them on every output it reads (vLLM's
    ``RequestOutput.prompt_token_ids`` / ``prompt_logprobs``).
    ``embedding``: an embedding request's vector (``float32``), on its one, final output.
    """

    request_id: str
    text: str
    delta: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[Logprobs, ...] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    scheduler_times: tuple[float, float, str] | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    embedding: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutputs:
    """A batch of :class:`RequestOutput` from stop-check to the API (one per step)."""

    outputs: tuple[RequestOutput, ...]
    rejected: tuple[RequestRejected, ...] = ()
    stats: EngineStats | None = None
