"""The detokenize stage: incremental, UTF-8-safe text for every running request.

Ports: ``in`` takes EngineRequest (registers a request, from tokenize), EngineOutputs (new
tokens, from schedule), RequestRejected (from admit) and AbortRequests (from the API); ``out``
forwards registrations, rejections and aborts and sends :class:`TextOutputs` to stop-check.
"""

from __future__ import annotations

import dataclasses

from pipeline.stage import Stage, handles
from stages.detokenizer import DetokenizerFactory, IncrementalDetokenizer
from stages.messages import (
    AbortRequests,
    EngineOutputs,
    EngineRequest,
    RequestRejected,
    TextOutputs,
)
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

    async def start(self) -> None:
        tokenizer = await self.run_in_thread(load_tokenizer, self.config.model)
        self._factory = DetokenizerFactory(tokenizer)

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        assert self._factory is not None
        self._requests[request.request_id] = self._factory.create(
            request.prompt_token_ids, skip_special_tokens=request.params.skip_special_tokens
        )
        await self.emit("out", request)

    @handles(EngineOutputs)
    async def on_outputs(self, outputs: EngineOutputs) -> None:
        requests = self._requests
        keep: list[int] = []
        texts: list[str] = []
        for index, request_id in enumerate(outputs.request_ids):
            detokenizer = requests.get(request_id)
            if detokenizer is None:  # aborted by the caller while the step ran
                continue
            text = detokenizer.push(outputs.new_token_ids[index])
            if outputs.finish_reasons[index] is not None:
                text += detokenizer.flush()
                del requests[request_id]
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
            ),
        )

    @handles(RequestRejected)
    async def on_rejected(self, rejected: RequestRejected) -> None:
        self._requests.pop(rejected.request_id, None)
        await self.emit("out", rejected)

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        for request_id in abort.request_ids:
            self._requests.pop(request_id, None)
        await self.emit("out", abort)
