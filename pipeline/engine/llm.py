"""``LLM``: the synchronous offline wrapper over :class:`~pipeline.engine.async_engine.AsyncEngine`.

::

    llm = LLM("smollm2-135m")
    outputs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))
    print(outputs[0].text)

It is a thin wrapper, not a second engine: the async engine runs on an event loop in a
background thread and each call waits for its result.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.embeddings import EmbeddingRequestOutput, embedding_result
from pipeline.engine.loop_thread import LoopThread
from pipeline.engine.options import EngineOptions
from pipeline.engine.prompts import CheckedPrompt, Prompt, is_prompt_dict
from pipeline.runtime.errors import PipelineClosedError
from stages.chat_template import make_rendering
from stages.errors import InvalidRequestError, OverloadedError, RateLimitedError
from stages.lora import LoRARequest
from stages.messages import ChatMessage, ChatRendering, RequestOutput, ToolSpec
from stages.params import SamplingParams
from stages.pooling import PoolingParams
from stages.tools import ToolUse, tool_specs_of
from transports.tasks import TaskSet

__all__ = ["LLM"]

T = TypeVar("T")

#: batches at least this long show a progress bar (unless use_tqdm=False)
PROGRESS_BAR_MIN_PROMPTS = 8

#: seconds before a prompt the engine refused for now (queue full, rate limit) is sent
#: again, doubling up to _RETRY_MAX
_RETRY_FIRST = 0.05
_RETRY_MAX = 1.0


def _shutdown(engine: AsyncEngine, loop_thread: LoopThread) -> None:
    try:
        if loop_thread.loop.is_running():
            loop_thread.run(engine.close())
    finally:
        loop_thread.stop()


class LLM:
    """Synchronous offline generation. ``LLM(model, **options)`` takes the same options as
    :class:`~pipeline.engine.async_engine.AsyncEngine`; the engine starts at construction (the
    model loads) and stops at :meth:`close` (or at exit of a ``with`` block, or interpreter
    exit)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.options = EngineOptions.create(model, **options)
        self._loop = LoopThread()
        self._engine = AsyncEngine(**_as_kwargs(self.options))
        self._finalizer = weakref.finalize(self, _shutdown, self._engine, self._loop)
        try:
            self._loop.run(self._engine.start())
        except BaseException:
            self._finalizer()
            raise

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: bool = False,
        tools: ToolUse | None = None,
        rendering: ChatRendering | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished output per prompt, in order.
        ``tools``: the functions every conversation may call (:class:`~stages.tools.ToolUse`);
        ``rendering``: how the chat template renders every conversation
        (:class:`~stages.messages.ChatRendering`; :meth:`chat` makes it).

        ``prompts``: one prompt or a list of them; a prompt is a string, a chat conversation,
        a list of token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
        ``sampling_params``: one SamplingParams for all, or a list with one per prompt.
        ``lora_request``: the LoRA adapter of every prompt, or a list with one per prompt
        (None: the base model), as vLLM's (:class:`~stages.lora.LoRARequest`; docs/lora.md).

        Any number of prompts can be given: as vLLM's offline ``LLM``, the whole batch runs.
        The engine's queue bound (``max_queued_requests``) and rate limits pace it (a
        refused prompt is sent again once the engine has room) instead of failing it.

        Raises:
            InvalidRequestError: a bad prompt or parameter. Every prompt and parameter is
                checked before anything is sent; a prompt the engine still refuses (too long
                once tokenized, say) aborts the rest of the batch.
            EngineDeadError: the engine died.
            PipelineClosedError: the LLM was closed.
        """
        self._check_open()
        batch = _as_batch(prompts)
        per_prompt: list[SamplingParams] = _one_per_prompt(
            SamplingParams() if sampling_params is None else sampling_params,
            SamplingParams,
            len(batch),
            "SamplingParams",
            "sampling_params",
        )
        loras: list[LoRARequest | None] = _one_per_prompt(
            lora_request, LoRARequest, len(batch), "LoRA requests", "lora_request"
        )
        # NOTE: every prompt through the validation core before anything is sent, once:
        # generate() takes the checked prompts as they are (docs/architecture.md §7.1).
        checked = [
            self._engine.check(
                prompt,
                sampling,
                chat_template=chat_template,
                tools=tools,
                rendering=rendering,
                lora_request=lora,
            )
            for prompt, sampling, lora in zip(batch, per_prompt, loras)
        ]
        show = use_tqdm and len(batch) >= PROGRESS_BAR_MIN_PROMPTS
        return self._loop.run(self._generate_all(checked, show))

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt, in order (vLLM's ``LLM.embed``): each output's
        ``outputs.embedding`` is the vector the engine's pooling (``pooling_type``,
        ``pooling_normalize``) makes of the prompt's final hidden states; ``pooling_params``
        (``dimensions``, ``normalize``) applies to all. Batches run as :meth:`generate`'s.

        Raises: as :meth:`generate`; InvalidRequestError also for ``dimensions`` the model
        does not allow.
        """
        self._check_open()
        batch = _as_batch(prompts)
        checked = [
            self._engine.check_embedding(
                prompt, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens
            )
            for prompt in batch
        ]
        show = use_tqdm and len(batch) >= PROGRESS_BAR_MIN_PROMPTS
        outputs = self._loop.run(self._generate_all(checked, show))
        return [embedding_result(output.request_id, output) for output in outputs]

    def chat(
        self,
        conversations: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        tools: Sequence[Mapping[str, Any] | ToolSpec] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations (lists of ``{"role", "content"}`` mappings,
        OpenAI's shape with ``tool_calls`` / ``tool_call_id``, or
        :class:`~stages.messages.ChatMessage`), or to one conversation. ``tools``: functions
        the model may call (OpenAI's ``{"type": "function", "function": {...}}`` or
        :class:`~stages.messages.ToolSpec`), with ``tool_choice`` (``none``, ``auto``,
        ``required`` or a function's name) and ``parallel_tool_calls``, as vLLM's ``LLM.chat``;
        the outputs' ``tool_calls`` hold the calls (docs/serving.md, "Tool calling").
        ``chat_template`` (a Jinja template used instead of the model's),
        ``chat_template_kwargs`` (variables it reads, such as ``enable_thinking``),
        ``add_generation_prompt`` and ``continue_final_message`` (the last message left
        open for the model to continue; not with ``add_generation_prompt``) as vLLM's
        ``LLM.chat`` takes them (docs/serving.md, "Chat templates").

        Raises: as :meth:`generate`; InvalidRequestError names ``chat_template`` for a
            template that is not valid Jinja or fails, ``chat_template_kwargs`` for a
            variable the template does not read.
        """
        self._check_open()
        if conversations and _is_chat_message(conversations[0]):
            conversations = [conversations]
        use = None
        if tools is not None:
            use = ToolUse(tool_specs_of(tools), tool_choice, parallel_tool_calls)
        rendering = make_rendering(
            chat_template, chat_template_kwargs, add_generation_prompt, continue_final_message
        )
        return self.generate(
            list(conversations), sampling_params, use_tqdm=use_tqdm, tools=use, rendering=rendering
        )

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise PipelineClosedError("the LLM is closed")

    async def _generate_all(
        self, prompts: list[CheckedPrompt], show_progress: bool
    ) -> list[RequestOutput]:
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc="generating", unit="req")

        # NOTE: at most max_queued_requests in the engine at once, so a batch of any size
        # fits its queue; a refusal that waiting cures (queue full on stale counts, a rate
        # limit) is retried with backoff. Either comes before the request's first output.
        window = asyncio.Semaphore(self.options.max_queued_requests)

        async def one(prompt: CheckedPrompt) -> RequestOutput:
            last: RequestOutput | None = None
            backoff = _RETRY_FIRST
            async with window:
                while last is None:
                    try:
                        async for output in self._engine.generate(prompt):
                            last = output
                    except (OverloadedError, RateLimitedError):
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, _RETRY_MAX)
            if progress is not None:
                progress.update(1)
            return last

        try:
            # NOTE: leaving the block on an error cancels the other prompts and waits for them
            async with TaskSet("generate") as tasks:
                running = [tasks.spawn(one(prompt)) for prompt in prompts]
                return list(await asyncio.gather(*running))
        finally:
            if progress is not None:
                progress.close()

    def close(self) -> None:
        """Stop the engine and its process. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _one_per_prompt(value: Any, kind: type, count: int, noun: str, field: str) -> list[Any]:
    """``value`` for each of ``count`` prompts: one ``kind`` (or None) for all, or a sequence
    of exactly one per prompt.

    Raises:
        InvalidRequestError: a sequence of another length (``field`` named).
    """
    if value is None or isinstance(value, kind):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise InvalidRequestError(f"got {len(values)} {noun} for {count} prompts", field=field)
    return values


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(type(t) is int for t in prompts):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, Sequence) and prompts and _is_chat_message(prompts[0]):
        return [prompts]  # type: ignore[list-item]  # one conversation
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError(
            "prompts must be a non-empty prompt or list of prompts", field="prompt"
        )
    return list(prompts)  # type: ignore[arg-type]


def _is_chat_message(item: object) -> bool:
    """Whether ``item`` is one chat message (so a list of them is one conversation), in
    either form :meth:`AsyncEngine.generate` accepts (a prompt dict is not one)."""
    return isinstance(item, ChatMessage) or (isinstance(item, Mapping) and not is_prompt_dict(item))


def _as_kwargs(options: EngineOptions) -> dict[str, Any]:
    import dataclasses

    return {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
