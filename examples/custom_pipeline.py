"""A custom pipeline: the default LLM pipeline plus a stage of your own.

:class:`MaskStage` masks characters of the generated text (digits by default, so no phone or
card number leaves the server). It is inserted between detokenize and stop-check: it receives
the detokenized :class:`~stages.messages.TextOutputs` of every engine step, rewrites their
text, and forwards every other message (request registrations, rejections, aborts)
unchanged. The example also shows the two other graph edits: placing a stage on a host of its
own (a spawned process) and replacing a stage (the model by the null model)::

    python examples/custom_pipeline.py "My phone number is"
    python examples/custom_pipeline.py "Count: 1 2 3" --characters 0123456789 --mask "*"
    python examples/custom_pipeline.py "Hello" --mask-host masker   # MaskStage in its own process
    python examples/custom_pipeline.py "Hello" --null-model          # random tokens, no model

NOTE: each step's text delta is rewritten on its own, so the rule is per character (a
multi-character pattern such as an e-mail address could straddle two deltas; a stage that
needs whole words must hold back each request's unfinished last word). Stop strings are
matched by stop-check *after* this stage, i.e. against the masked text.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import string
import sys
from typing import Any

from pipeline import AsyncEngine, Pipeline, SamplingParams, Stage
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline
from stages.messages import TextOutputs

__all__ = ["MaskConfig", "MaskStage", "build_pipeline", "generate", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class MaskConfig:
    """Replace every character of ``characters`` in the generated text by ``mask``.

    Raises:
        ValueError: ``characters`` is empty or not a string, or ``mask`` is not a string.
    """

    characters: str = string.digits
    mask: str = "#"

    def __post_init__(self) -> None:
        if not isinstance(self.characters, str) or not self.characters:
            raise ValueError(f"characters must be a non-empty string, got {self.characters!r}")
        if not isinstance(self.mask, str):
            raise ValueError(f"mask must be a string, got {self.mask!r}")


class MaskStage(Stage):
    """Masks characters in the text of :class:`TextOutputs`; forwards everything else.

    One input and one output port, so :meth:`Pipeline.insert` can put it on any link.
    """

    inputs = ("in",)
    outputs = ("out",)

    def __init__(self, config: MaskConfig | None = None) -> None:
        config = config if config is not None else MaskConfig()
        super().__init__(config)
        self._table = str.maketrans(dict.fromkeys(config.characters, config.mask))

    async def handle(self, message: Any, port: str) -> None:
        # NOTE: overriding handle() (instead of @handles per type) is what lets this stage
        # forward message types it has never heard of.
        if isinstance(message, TextOutputs):
            masked = tuple(text.translate(self._table) for text in message.texts)
            message = dataclasses.replace(message, texts=masked)
        await self.emit("out", message)


def build_pipeline(
    options: EngineOptions,
    mask: MaskConfig | None = None,
    *,
    mask_host: str | None = None,
    null_model: bool = False,
) -> Pipeline:
    """The default LLM pipeline for ``options`` with a :class:`MaskStage` named ``mask``
    after detokenize. ``mask_host``: run it in that (spawned) host instead of next to
    detokenize. ``null_model``: replace the execute stage by the null model (instant random
    tokens, real KV bookkeeping), keeping its links, placement and config.
    """
    pipeline = llm_pipeline(options)
    pipeline.insert("mask", MaskStage, mask or MaskConfig(), after="detokenize")
    if mask_host is not None:
        pipeline.place("mask", mask_host)
    if null_model:
        from stages.execute.null import NullExecuteStage

        pipeline.replace("execute", NullExecuteStage, pipeline["execute"].config)
    return pipeline


async def generate(
    pipeline: Pipeline,
    options: EngineOptions,
    prompt: str,
    params: SamplingParams,
    *,
    chat_template: bool = False,
    write: Any = None,
) -> str:
    """Run ``pipeline`` with AsyncEngine, stream one answer to ``write`` (a callable taking
    each text delta; None: don't print) and return the whole text."""
    engine_options = {
        field.name: getattr(options, field.name) for field in dataclasses.fields(options)
    }
    text = ""
    async with AsyncEngine(pipeline=pipeline, **engine_options) as engine:
        async for output in engine.generate(prompt, params, chat_template=chat_template):
            if write is not None:
                write(output.delta)
            text = output.text
    return text


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf")
    parser.add_argument("--transport", default="zmq", choices=("zmq", "grpc", "memory"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--characters", default=string.digits, help="characters to mask")
    parser.add_argument("--mask", default="#", help="what each masked character becomes")
    parser.add_argument("--mask-host", default=None, help="run MaskStage on this spawned host")
    parser.add_argument("--null-model", action="store_true", help="replace the model")
    parser.add_argument("--no-chat-template", action="store_true", help="send the raw prompt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the pipeline (stderr), then stream the masked answer (stdout)."""
    args = _arguments(argv)
    try:
        options = EngineOptions.create(args.model, transport=args.transport)
        mask = MaskConfig(args.characters, args.mask)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pipeline = build_pipeline(options, mask, mask_host=args.mask_host, null_model=args.null_model)
    print(pipeline.describe(), file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def write(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    asyncio.run(
        generate(
            pipeline, options, args.prompt, params,
            chat_template=not args.no_chat_template, write=write,
        )
    )  # fmt: skip
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
