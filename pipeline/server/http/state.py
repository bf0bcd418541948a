"""The state the HTTP handlers share: the engine (started, not owned), the model's name,
the logprobs decoder, the requests being answered, and whether the server is shutting
down."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from pipeline.engine.async_engine import AsyncEngine
from pipeline.engine.prompts import CheckedPrompt, Prompt
from pipeline.server.http.choices import Choices, RunningRequests
from pipeline.server.http.echo import Echo
from pipeline.server.http.errors import SERVER_ERROR, ApiError
from pipeline.server.http.logprobs import TokenTexts
from pipeline.server.http.requests import Plan
from pipeline.server.limits import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    check_logprob_entries,
    check_request_template,
)
from pipeline.server.lora_modules import LoRAModules
from stages.errors import RequestError
from stages.lora import LoRARequest
from stages.messages import ChatRendering, RequestOutput
from stages.params import SamplingParams
from stages.tools import ToolUse

__all__ = ["HttpService"]


class HttpService:
    """Serves the API's requests from ``engine`` under the model id ``model_name``.
    ``texts`` decodes logprobs' tokens (None until the tokenizer is loaded);
    ``max_logprob_entries``: the logprobs one request may ask for
    (:func:`~pipeline.server.limits.check_logprob_entries`);
    ``trust_request_chat_template``: whether a request may bring its own ``chat_template``
    (:func:`~pipeline.server.limits.check_request_template`); ``lora_modules``: the LoRA
    adapters a request's ``model`` may name (docs/lora.md); ``tenant_adapters``: the adapter
    each bound API key's tenant always runs with
    (:meth:`~pipeline.server.auth.ApiKeys.tenant_adapters`)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
        trust_request_chat_template: bool = False,
        lora_modules: LoRAModules | None = None,
        tenant_adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.lora_modules = lora_modules if lora_modules is not None else LoRAModules()
        self.tenant_adapters: Mapping[str, str] = dict(tenant_adapters or {})
        self.model_name = model_name
        self.max_logprob_entries = max_logprob_entries
        self.trust_request_chat_template = trust_request_chat_template
        self.created = int(time.time())
        self.texts: TokenTexts | None = None
        #: the engine's HF tokenizer, for /tokenize and /detokenize (None until loaded)
        self.tokenizer: Any = None
        self.running = RunningRequests()
        self.shutting_down = False

    @property
    def num_running(self) -> int:
        """Engine requests being answered (one per choice)."""
        return len(self.running.ids)

    def problem(self) -> ApiError | None:
        """Why no request can be served now (the 503), or None."""
        if self.shutting_down:
            return ApiError(503, "the server is shutting down", error_type=SERVER_ERROR)
        failure = self.engine.failure
        if failure is not None:
            return ApiError.from_error(failure)
        if self.engine.info is None:
            return ApiError(503, "the engine is not started", error_type=SERVER_ERROR)
        return None

    def check_model(
        self, model: str | None, *, adapters: bool = True, tenant: str = ""
    ) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (docs/lora.md), or None for the model served
        (None, left out: it is, as vLLM takes it): its served name, or the ``root`` its model
        card names (the path or alias it was started with, which ``vllm bench serve`` sends
        when it found the model from ``/v1/models``: ``vllm/benchmarks/serve.py``, its prompt
        alignment). ``adapters``: whether this endpoint serves adapters. A ``tenant`` whose API
        key is bound to an adapter always runs with it (:meth:`bound_adapter`).

        Raises:
            ApiError: 404 for any other model (an adapter where ``adapters`` is off: 400);
                for a bound key, 403 naming another model, 404 when its adapter is not
                served.
        """
        bound = self.tenant_adapters.get(tenant)
        if bound is not None:
            return self.bound_adapter(bound, model, adapters)
        if model is None or model in (self.model_name, self.engine.options.model):
            return None
        lora = self.lora_modules.get(model)
        if lora is not None and not adapters:
            raise ApiError(
                400, f"the LoRA adapter {model!r:.80} serves completions and chats only; "
                f"use the base model {self.model_name!r}", param="model",
            )  # fmt: skip
        if lora is None:
            names = (self.model_name, *self.lora_modules.adapters)
            served = ", ".join(repr(name) for name in names)
            raise ApiError(
                404,
                f"the model {model!r:.80} does not exist; this server serves {served:.400}",
                param="model",
                code="model_not_found",
            )
        return lora

    def bound_adapter(self, bound: str, model: str | None, adapters: bool) -> LoRARequest:
        """The adapter ``bound`` of a bound API key's request naming ``model`` (docs/lora.md,
        "An API key bound to an adapter"): ``model`` may be left out or name the base model
        or the adapter; the request runs with the adapter either way.

        Raises:
            ApiError: 403 on an endpoint that serves no adapters or for another ``model``;
                404 when ``bound`` is not served (removed at run time).
        """
        if not adapters:
            raise ApiError(
                403, f"this API key is bound to the LoRA adapter {bound!r:.80}, which serves "
                "completions and chats only", param="model", code="permission_denied",
            )  # fmt: skip
        base_names = (self.model_name, self.engine.options.model)
        try:
            lora = self.lora_modules.bound(bound, model, base_names, "model")
        except RequestError as exc:
            raise ApiError.from_error(exc) from None
        if lora is None:
            raise ApiError(
                404, f"the LoRA adapter {bound!r:.80} this API key is bound to is not served "
                "now", param="model", code="model_not_found",
            )  # fmt: skip
        return lora

    def token_texts(self, logprobs: int | None) -> TokenTexts | None:
        """The decoder for a request that asked for ``logprobs`` (None: none asked)."""
        if logprobs is None:
            return None
        if self.texts is None:
            raise ApiError(503, "the tokenizer is not loaded", error_type=SERVER_ERROR)
        return self.texts

    def echo(self, plan: Plan) -> Echo | None:
        """What ``plan``'s ``echo`` asks (None: no echo)."""
        if not plan.echo:
            return None
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ApiError(503, "the tokenizer is not loaded", error_type=SERVER_ERROR)

        async def decode(token_ids: Sequence[int]) -> str:
            return str(await run_in_threadpool(tokenizer.decode, list(token_ids)))

        prompts = [prompt for prompt, _ in plan.choices]
        truncated = any(params.truncate_prompt_tokens is not None for _, params in plan.choices)
        return Echo(prompts, decode, decode_all=truncated, only=plan.echo_only)

    def check(
        self,
        request_id: str,
        choices: Sequence[tuple[Prompt, SamplingParams]],
        tenant: str,
        tools: ToolUse | None = None,
        rendering: ChatRendering | None = None,
        lora: LoRARequest | None = None,
    ) -> list[CheckedPrompt]:
        """Every choice through the engine's validation core, once, before any starts
        (docs/architecture.md §7.1): a value no stage or link could carry is a 400 naming
        its field, and no choice is started only to be aborted again. Then what only this
        server knows: the logprobs one answer may carry.

        ``lora``: the adapter every choice runs with (:meth:`check_model`).

        Raises:
            ApiError: 400 naming the field that is invalid (an adapter that cannot be
                served: ``lora_request``); 503 while nothing can be
                served; 400 ``invalid_value`` (param ``logprobs``) for an answer that could
                carry more logprobs than ``max_logprob_entries``; 400 (param
                ``chat_template``) for a request's own template on a server that does not
                trust them.
        """
        try:
            check_request_template(rendering, self.trust_request_chat_template)
            checked = [
                self.engine.check(
                    prompt,
                    params,
                    request_id=request_id,
                    tenant=tenant,
                    tools=tools,
                    rendering=rendering,
                    lora_request=lora,
                )
                for prompt, params in choices
            ]
        except RequestError as exc:
            raise ApiError.from_error(exc) from None
        problem = self.problem()
        if problem is not None:
            raise problem
        info = self.engine.info
        if checked and info is not None:
            params = checked[0].params  # NOTE: the choices differ in their seeds only
            try:
                check_logprob_entries(
                    len(checked),
                    params.max_tokens,
                    params.logprobs,
                    info.max_model_len,
                    self.max_logprob_entries,
                    params.prompt_logprobs,
                )
            except RequestError as exc:
                raise ApiError.from_error(exc) from None
        return checked

    async def start(
        self,
        request_id: str,
        choices: Sequence[CheckedPrompt],
        tenant: str,
        receive: Receive,
        per_prompt: int = 1,
    ) -> Choices:
        """Start one engine request per checked choice (:meth:`check`) and wait for each
        one's first output; ``per_prompt``: the choices of each prompt (``n``).

        Raises:
            ApiError: the engine refused a choice (400, 429, 503...) or cannot serve.
        """
        problem = self.problem()
        if problem is not None:
            raise problem
        started = Choices(self.engine, request_id, choices, tenant, self.running, per_prompt)
        try:
            await started.start(receive)
        except Exception as exc:
            raise ApiError.from_error(exc) from exc
        return started

    @staticmethod
    async def collect(choices: Choices) -> list[RequestOutput]:
        """Every choice's last output.

        Raises:
            ApiError: the engine failed on the way (it died, was closed, ...).
        """
        try:
            return await choices.collect()
        except Exception as exc:
            raise ApiError.from_error(exc) from exc

    async def shut_down(self) -> None:
        """Refuse new requests and abort every running one: their streams end with
        ``finish_reason: "abort"`` and ``[DONE]``, so a graceful shutdown has nothing left
        to wait for. Idempotent."""
        self.shutting_down = True
        for engine_id in list(self.running.ids):
            with contextlib.suppress(Exception):  # finished meanwhile, or the engine is gone
                await self.engine.abort(engine_id)
