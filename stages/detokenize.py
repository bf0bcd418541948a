"""The detokenize stage: incremental, UTF-8-safe text for every running request.

A request the engine stopped (EOS or a stop token id, ``finish_reason="stop"``) does not get
its last token's text unless ``include_stop_str_in_output``: the stop token is in the output's
token ids, not in its text, as in vLLM V1 (``vllm/v1/engine/detokenizer.py``,
``IncrementalDetokenizer.update``: a stop-terminated request skips its last token for
detokenization).

Ports: ``in`` takes EngineRequest (registers a request, from tokenize), EngineOutputs (new
tokens, from schedule), RequestRejected (from admit) and AbortRequests (from the API); ``out``
forwards registrations, rejections and aborts and sends :class:`TextOutputs` to stop-check.

A request whose detokenizer fails (registering it, or decoding its tokens in a step's batch)
fails alone (docs/architecture.md, "Failure: one request or the pipeline"): its state is
dropped and a :class:`RequestRejected` with ``abort`` set goes on to stop-check, which aborts
it in the engine; the other requests of the batch go on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.runtime.stage import Stage, handles, recoverable
from stages.detokenizer import DetokenizerFactory, IncrementalDetokenizer
from stages.early_aborts import EarlyAborts
from stages.messages import (
    AbortRequests,
    EngineOutputs,
    EngineRequest,
    RequestRejected,
    TextOutputs,
)
from stages.recovery import rejection, request_id_of
from stages.tokenize import load_tokenizer

__all__ = ["DetokenizeConfig", "DetokenizeStage"]


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizeConfig:
    model: str


class DetokenizeStage(Stage):
    inputs = ("in",)
    outputs = ("out",)

    def __init__(self, config: DetokenizeConfig) -> None:
        super().__init__(config)
        self._factory: DetokenizerFactory | None = None
        self._requests: dict[str, IncrementalDetokenizer] = {}
        # requests whose stop token's text is wanted (include_stop_str_in_output)
        self._stop_text_kept: set[str] = set()
        # aborts that overtook their request (sent by the API while it passed tokenize)
        self._early_aborts = EarlyAborts()

    async def start(self) -> None:
        tokenizer = await self.run_in_thread(load_tokenizer, self.config.model)
        self._factory = DetokenizerFactory(tokenizer)

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        assert self._factory is not None
        if self._early_aborts.take(request.request_id):
            return  # aborted before it got here: neither this stage nor stop-check tracks it
        self._requests[request.request_id] = self._factory.create(
            request.prompt_token_ids, skip_special_tokens=request.params.skip_special_tokens
        )
        if request.params.include_stop_str_in_output:
            self._stop_text_kept.add(request.request_id)
        await self.emit("out", request)

    @handles(EngineOutputs)
    async def on_outputs(self, outputs: EngineOutputs) -> None:
        requests = self._requests
        keep: list[int] = []
        texts: list[str] = []
        failed: list[RequestRejected] = []
        for index, request_id in enumerate(outputs.request_ids):
            detokenizer = requests.get(request_id)
            if detokenizer is None:  # aborted by the caller while the step ran
                continue
            finish_reason = outputs.finish_reasons[index]
            try:
                if finish_reason is None:
                    text = detokenizer.push(outputs.new_token_ids[index])
                else:
                    text = self._finish(request_id, detokenizer, finish_reason, outputs, index)
            except Exception as error:
                if not recoverable(error):
                    raise
                self.contained(error, outputs, request_id)
                self._forget(request_id)
                failed.append(rejection(self.name, request_id, error, abort=True))
                continue
            keep.append(index)
            texts.append(text)
        if len(keep) == len(outputs.request_ids):
            request_ids, new_ids = outputs.request_ids, outputs.new_token_ids
            finish, stop = outputs.finish_reasons, outputs.stop_reasons
        else:
            request_ids = tuple(outputs.request_ids[i] for i in keep)
            new_ids = tuple(outputs.new_token_ids[i] for i in keep)
            finish = tuple(outputs.finish_reasons[i] for i in keep)
            stop = tuple(outputs.stop_reasons[i] for i in keep)
        await self.emit(
            "out",
            TextOutputs(
                request_ids,
                new_ids,
                tuple(texts),
                finish,
                stop,
                outputs.logprobs,
                outputs.num_cached_tokens,
                outputs.stats,
                outputs.scheduler_times,
                outputs.prompt_logprobs,
                outputs.embeddings,
            ),
        )
        for rejected in failed:
            await self.emit("out", rejected)

    def _finish(
        self,
        request_id: str,
        detokenizer: IncrementalDetokenizer,
        finish_reason: str,
        outputs: EngineOutputs,
        index: int,
    ) -> str:
        """The text of a finishing request's last tokens (held-back text included); forgets
        the request."""
        token_ids = outputs.new_token_ids[index]
        if finish_reason == "stop" and token_ids and request_id not in self._stop_text_kept:
            # NOTE: the engine stopped on this token (EOS or a stop token id): its text is
            # left out, as vLLM V1 leaves it out unless include_stop_str_in_output.
            token_ids = token_ids[:-1]
        text = detokenizer.push(token_ids) if token_ids else ""
        text += detokenizer.flush()
        del self._requests[request_id]
        self._stop_text_kept.discard(request_id)
        return text

    @handles(RequestRejected)
    async def on_rejected(self, rejected: RequestRejected) -> None:
        self._forget(rejected.request_id)
        await self.emit("out", rejected)

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request whose registration failed is forgotten and answered; it is in the
        engine already (tokenize sent it to admit too), so the answer asks stop-check to
        abort it there. Failures on other messages (a step's batch, rejections, aborts) are
        this stage's own."""
        request_id = request_id_of(message)
        if request_id is None:
            return False
        self._forget(request_id)
        await self.emit("out", rejection(self.name, request_id, error, abort=True))
        return True

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._stop_text_kept.discard(request_id)

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        for request_id in abort.request_ids:
            if self._requests.pop(request_id, None) is None:
                self._early_aborts.add(request_id)
            self._stop_text_kept.discard(request_id)
        await self.emit("out", abort)
