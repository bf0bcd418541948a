"""Reasoning parsers: the ``<think>…</think>`` part of a model's output, read as the text
streams in (pure logic; the parse stage, :mod:`stages.parse`, runs one per request).

A parser is fed the output piece by piece (:meth:`ReasoningParser.feed`) and told when it
ends (:meth:`ReasoningParser.finish`); :attr:`ReasoningParser.reasoning` and
:attr:`ReasoningParser.content` only grow (text that could be the start of a marker is held
back until it is known). As vLLM's parsers (vllm/reasoning/):

- ``deepseek_r1``: the output starts in reasoning (the chat template may already have written
  ``<think>``; one at the output's start is dropped) and ``</think>`` ends it
  (``deepseek_r1_reasoning_parser.py``); an output without ``</think>`` is all reasoning.
- ``qwen3``: reasoning only when the output starts with ``<think>``, up to ``</think>``; an
  output that does not start with it is all content (``qwen3_reasoning_parser.py``; unlike
  vLLM's whole-output reading, an unclosed ``<think>`` stays reasoning, as it streamed).

Each is registered in the entry-point group ``actorline.reasoning_parsers`` (:mod:`plugins`).
"""

from __future__ import annotations

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser"]

_START = "<think>"
_END = "</think>"


class ReasoningParser:
    """The base: starts in reasoning when :attr:`starts_in_reasoning`, else only after a
    leading ``<think>``; ``</think>`` switches to content for the rest of the output."""

    api_version = 1
    name = ""
    starts_in_reasoning = False

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self._buffer = ""
        self._state = "start"  # start → reasoning → content
        self._finished = False

    def feed(self, text: str) -> None:
        """Read the next piece of the output."""
        self._buffer += text
        self._advance()

    def finish(self) -> None:
        """The output has ended: release what was held back."""
        self._finished = True
        self._advance()

    def _advance(self) -> None:
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if _START.startswith(stripped) and stripped != _START and not self._finished:
                return  # could still be the leading <think>
            if stripped.startswith(_START):
                self._buffer = stripped[len(_START) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._buffer.find(_END)
            if end < 0:
                keep = 0 if self._finished else _partial_end(self._buffer)
                self.reasoning += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return
            self.reasoning += self._buffer[:end]
            self._buffer = self._buffer[end + len(_END) :]
            self._state = "content"
        self.content += self._buffer
        self._buffer = ""


def _partial_end(text: str) -> int:
    for size in range(min(len(_END) - 1, len(text)), 0, -1):
        if _END.startswith(text[-size:]):
            return size
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: reasoning from the output's start up to ``</think>``."""

    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning inside a leading ``<think>…</think>``."""

    name = "qwen3"
