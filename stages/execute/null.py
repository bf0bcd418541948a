"""The null model: an execute stage that runs no model, for measuring the framework itself.

:class:`NullExecuteStage` has the ports of :class:`~stages.execute.stage.ExecuteStage` (``in``:
SchedulerStep; ``out``: StepResult; ``info``: EngineInfo once at start) and answers every step
at once: each chunk that samples gets a random token, drawn by a seeded numpy generator
uniformly over the model tokenizer's vocabulary minus its special tokens (so detokenization
downstream does real work and EOS never ends a request by chance), or, for a request with
structured outputs, uniformly over the tokens its grammar allows (the step's bitmask).
Everything else is real: the KV bookkeeping goes through the same
:class:`~stages.execute.allocator.BlockAllocator` as the model runner (allocation, prefix-cache
lookups and commits, frees, preemption when blocks run out), sized from the same
:class:`~stages.execute.config.ExecuteConfig`, and the :class:`~stages.messages.EngineInfo`
carries the model's real vocabulary size, length limit and EOS ids. No KV tensors are allocated
(``kv_cache_bytes`` is 0) and torch is never used.

Select it with ``AsyncEngine(model, null_model=True)`` (or ``LLM``), which swaps it in for the
execute stage in :func:`pipeline.engine.presets.llm_pipeline`.

Step semantics are :class:`stages.execute.runner.ModelRunner`'s, through the same code
(:mod:`stages.execute.bookkeeping`): check the step whole, free ``finished`` and ``preempted``,
register ``new_requests``, plan each chunk (a chunk starting at 0 is a (re)start that first
looks its tokens up in the prefix cache), then sample where a chunk reaches the end of the
request's known tokens and commit the computed blocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.runtime.stage import Stage, handles
from stages.execute.allocator import BlockAllocator
from stages.execute.bookkeeping import (
    PlanReport,
    StepError,
    commit_chunk,
    plan_chunks,
    release,
    release_behind_windows,
    step_result,
    validate_step,
)
from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.crash_notes import note_step
from stages.execute.model_impl import eos_token_ids
from stages.execute.model_length import resolve_model_length
from stages.execute.windows import config_layer_windows
from stages.lora import lora_cache_key
from stages.messages import (
    EngineInfo,
    EngineRequest,
    Logprobs,
    SchedulerStep,
    StepResult,
)
from stages.models import ModelFormatError, resolve_model

__all__ = ["NullExecuteStage", "NullRunner", "NullStepError", "sampleable_token_ids"]

logger = logging.getLogger("actorline.execute.null")

#: bytes per KV element by dtype name, to size the (never allocated) cache like the runner
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_CONFIG_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


NullStepError = StepError
"""A :class:`SchedulerStep` is inconsistent with the null runner's state: the model runner's
:class:`~stages.execute.bookkeeping.StepError`, since both check steps with the same code."""


@dataclasses.dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    wants_logprobs: bool
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # leading tokens whose (virtual) K/V is in the cache
    num_cached: int = 0  # of those, served by the prefix cache since the request started
    owes_prompt_logprobs: bool = False  # asked for them, and they were not sent yet
    cache_key: bytes = b""  # its LoRA adapter's prefix-cache key (stages.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        return not self.owes_prompt_logprobs

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Known tokens ``[start, end)`` (prompt then outputs)."""
        known = [*self.prompt_token_ids, *self.output_token_ids]
        return known[start:end]


def sampleable_token_ids(tokenizer: Any) -> np.ndarray:
    """The ids of ``tokenizer``'s vocabulary that are not special tokens (ascending).

    Special means listed in ``all_special_ids`` or an added token flagged special.

    Raises:
        ModelFormatError: the tokenizer has no non-special token.
    """
    special = {int(token_id) for token_id in getattr(tokenizer, "all_special_ids", ())}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.special:
                special.add(int(token_id))
    ids = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ModelFormatError("the tokenizer has no non-special token to sample")
    return ids


class NullRunner:
    """The null model's synchronous core (no asyncio, no torch): KV bookkeeping and random
    tokens. :meth:`load` reads the model's config and tokenizer; :meth:`execute` answers a
    step.

    Args:
        config: the execute config (model, block size, KV size, prefix caching, seed).
    """

    def __init__(self, config: ExecuteConfig) -> None:
        self.config = config
        self.allocator: BlockAllocator | None = None
        self.info: EngineInfo | None = None
        self.max_model_len = 0
        self._window: int | None = None  # bounds every layer: blocks behind it are freed
        self._requests: dict[str, _Request] = {}
        self._token_ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self._uniform_logprob = 0.0
        self._rng = np.random.default_rng(config.seed)

    # ----------------------------------------------------------------- loading
    def load(self, tokenizer: Any = None) -> EngineInfo:
        """Read the model's config and tokenizer (``tokenizer`` if given, else the model's),
        size the block allocator as the model runner would.

        Returns:
            The engine's capacity, as the real execute stage reports it.

        Raises:
            stages.models.ModelError: the model cannot be found or read.
            ExecuteConfigError: the KV budget holds no block, or max_model_len is too long.
        """
        config = self.config
        resolved = resolve_model(config.model)
        text_config = _text_config(resolved.path)
        if tokenizer is None:
            from stages.tokenize import load_tokenizer

            tokenizer = load_tokenizer(config.model)
        self._token_ids = sampleable_token_ids(tokenizer)
        self._uniform_logprob = -math.log(self._token_ids.size)

        num_heads = int(text_config["num_attention_heads"])
        num_layers = int(text_config["num_hidden_layers"])
        num_kv_heads = int(text_config.get("num_key_value_heads") or num_heads)
        head_dim = int(text_config.get("head_dim") or int(text_config["hidden_size"]) // num_heads)
        dtype = _dtype_name(config.dtype, text_config)
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        # Same size as stages.execute.attention.KVCache.bytes_per_block (keys and values).
        block_bytes = (
            2 * num_layers * config.block_size * num_kv_heads * head_dim * _ELEMENT_BYTES[kv_dtype]
        )
        if config.num_blocks is not None:
            usable_blocks = config.num_blocks
        else:
            usable_blocks = config.kv_cache_bytes_budget // block_bytes - 1
            if usable_blocks < 1:
                raise ExecuteConfigError(
                    "kv_cache_memory",
                    f"({config.kv_cache_bytes_budget} bytes) holds no KV block; one block "
                    f"takes {block_bytes} bytes (plus one reserved block)",
                )
        self.max_model_len, self._window = resolve_model_length(
            config.max_model_len,
            text_config,
            usable_blocks,
            config.block_size,
            config_layer_windows(text_config),
        )
        self.allocator = BlockAllocator(
            usable_blocks + 1,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            extra_hash_key=f"{resolved.path}|{dtype}|null".encode(),
        )
        self.info = EngineInfo(
            model=resolved.name,
            vocab_size=int(text_config.get("vocab_size") or len(tokenizer)),
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids(resolved.path, text_config),
            num_blocks=usable_blocks,
            block_size=config.block_size,
            dtype=dtype,
            device="cpu",
            kv_cache_bytes=0,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self._window,
            kv_cache_dtype=kv_dtype,
        )
        logger.info("execute (null model): %s", self.info)
        return self.info

    # ----------------------------------------------------------------- stepping
    def execute(self, step: SchedulerStep) -> StepResult:
        """Answer one scheduler step: free, register, plan each chunk's blocks, sample a
        random token for every chunk that reaches the end of its request's known tokens.

        Returns:
            The sampled tokens and the allocator's state; requests that did not get blocks
            are listed in ``preempted`` (their blocks freed, their tokens kept).

        Raises:
            NullStepError: the step does not match the runner's state.
            RuntimeError: :meth:`load` was not called.
        """
        allocator = self.allocator
        if allocator is None:
            raise RuntimeError("NullRunner.load() must be called before execute()")
        began = time.perf_counter()
        validate_step(step, self._requests, self.max_model_len)
        release(allocator, self._requests, step)
        for new_request in step.new_requests:
            self._register(new_request)

        report = PlanReport()
        planned = plan_chunks(allocator, self._requests, step.chunks, report, step.spare_blocks)
        sampling = [request for request, _, end in planned if end == request.num_tokens]
        for request, _, end in planned:
            commit_chunk(allocator, request, end)
        release_behind_windows(allocator, self._requests, step, report, self._window)

        request_ids: list[str] = []
        logprob_ids: list[str] = []
        logprobs: list[Logprobs] = []
        prompt_logprobs: dict[str, tuple[Logprobs, ...]] = {}
        token_ids: list[int] = []
        if sampling:
            drawn = self._token_ids[self._rng.integers(0, self._token_ids.size, len(sampling))]
            token_ids = drawn.tolist()
            self._constrain(step, sampling, token_ids)
            for request, token_id in zip(sampling, token_ids):
                request.output_token_ids.append(token_id)
                request_ids.append(request.request_id)
                if request.wants_logprobs:
                    # NOTE: every sampleable token is equally likely: all tie for rank 1.
                    logprob_ids.append(request.request_id)
                    logprobs.append(Logprobs(token_id, self._uniform_logprob, 1))
                if request.owes_prompt_logprobs:
                    # the same uniform distribution at every prompt position
                    request.owes_prompt_logprobs = False
                    prompt_logprobs[request.request_id] = tuple(
                        Logprobs(prompt_token, self._uniform_logprob, 1)
                        for prompt_token in request.prompt_token_ids[1:]
                    )
        return step_result(
            step,
            allocator,
            request_ids=request_ids,
            token_ids=token_ids,
            logprob_request_ids=logprob_ids,
            logprobs=logprobs,
            report=report,
            num_computed_tokens=sum(end - start for _, start, end in planned),
            forward_seconds=time.perf_counter() - began,
            prompt_logprobs=prompt_logprobs,
        )

    def _constrain(
        self, step: SchedulerStep, sampling: Sequence[_Request], token_ids: list[int]
    ) -> None:
        """Redraw the tokens of constrained rows uniformly among those their grammar allows
        (special tokens included: a complete grammar allows only the end of sequence)."""
        if step.grammar_bitmask is None or not step.grammar_request_ids:
            return
        row_of = {request_id: row for row, request_id in enumerate(step.grammar_request_ids)}
        vocab = self.info.vocab_size if self.info is not None else 0
        for index, request in enumerate(sampling):
            row = row_of.get(request.request_id)
            if row is None:
                continue
            words = np.ascontiguousarray(step.grammar_bitmask[row], dtype="<i4")
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            allowed = allowed[allowed < vocab]
            if allowed.size:
                token_ids[index] = int(allowed[self._rng.integers(0, allowed.size)])

    def _register(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = _Request(
            request.request_id,
            tuple(request.prompt_token_ids),
            request.params.logprobs is not None,
            owes_prompt_logprobs=request.params.prompt_logprobs is not None,
            cache_key=lora_cache_key(request.lora),
        )

    # ----------------------------------------------------------------- inspection
    def has_request(self, request_id: str) -> bool:
        """Whether the runner holds state for ``request_id``."""
        return request_id in self._requests

    def output_token_ids(self, request_id: str) -> list[int]:
        """The tokens sampled so far for ``request_id`` (a copy)."""
        return list(self._requests[request_id].output_token_ids)


class NullExecuteStage(Stage):
    """The execute stage with the null model (see the module docstring). Steps are answered
    inline on the event loop: there is no forward pass to move off it."""

    inputs = ("in",)
    outputs = ("out", "info")

    def __init__(self, config: ExecuteConfig) -> None:
        super().__init__(config)
        self.runner: NullRunner | None = None

    async def start(self) -> None:
        self.runner = runner = NullRunner(self.config)
        info = await self.run_in_thread(runner.load)
        await self.emit("info", info)

    @handles(SchedulerStep)
    async def on_step(self, step: SchedulerStep) -> None:
        await self.emit("out", await self.execute_step(step))

    async def execute_step(self, step: SchedulerStep) -> StepResult:
        """Answer ``step`` (inline): what a step sent to ``in`` does, less sending the result
        (called directly by a schedule stage on this stage's host, :mod:`stages.engine_core`)."""
        assert self.runner is not None
        note_step(step)
        return self.runner.execute(step)


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The language model's part of ``config.json`` (``text_config`` for multimodal models)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    text = config.get("text_config")
    merged = {**config, **text} if isinstance(text, dict) else config
    for key in ("num_attention_heads", "num_hidden_layers"):
        if not isinstance(merged.get(key), int):
            raise ModelFormatError(f"{model_dir / 'config.json'} has no integer {key!r}")
    if not isinstance(merged.get("head_dim"), int) and not isinstance(
        merged.get("hidden_size"), int
    ):
        raise ModelFormatError(f"{model_dir / 'config.json'} has neither head_dim nor hidden_size")
    return merged


def _dtype_name(requested: str, text_config: dict[str, Any]) -> str:
    if requested != "auto":
        return requested
    declared = text_config.get("dtype") or text_config.get("torch_dtype")
    return _CONFIG_DTYPES.get(str(declared), "float32")
