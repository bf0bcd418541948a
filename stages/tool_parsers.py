"""Tool-call parsers: the calls a model wrote in its output, read as the text streams in
(pure logic; the parse stage, :mod:`stages.parse`, runs one per request).

A parser is fed the output's text piece by piece (:meth:`ToolParser.feed`) and told when it
ends (:meth:`ToolParser.finish`); at any point :attr:`ToolParser.content` is the text outside
calls released so far and :attr:`ToolParser.calls` the calls so far. Both only grow: content is
held back while it could be the start of a call marker, a call appears once its ``name`` is
read, and its ``arguments`` grow as they are generated (the last ``}`` run is held back until
the call closes, since the object around the arguments ends with one). A region that never
becomes a call (no JSON object with a ``name`` after the marker) is released as content.

The formats, as vLLM's parsers read them (vllm/entrypoints/openai/tool_parsers/):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with
  text between (Hermes 2 Pro, Qwen2.5/Qwen3; ``hermes_tool_parser.py``).
- ``llama3_json``: the output is a JSON object ``{"name": ..., "parameters": {...}}`` (after
  an optional ``<|python_tag|>``), several separated by ``;`` (``llama_tool_parser.py``).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects
  (``mistral_tool_parser.py``, the pre-v11 tokenizer format).
- ``generic``: for models without a format of their own: ``hermes``'s tags (what the default
  tool preamble asks for, :func:`stages.tools.tool_preamble`), or an output that is a JSON
  object or list of objects with ``name`` and ``arguments`` (or ``parameters``).

Each is registered in the entry-point group ``actorline.tool_parsers`` (:mod:`plugins`);
``api_version`` is the protocol's version.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from stages.messages import ToolCall

__all__ = [
    "GenericToolParser",
    "HermesToolParser",
    "JsonListToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedFunctionParser",
    "ToolParser",
    "new_call_id",
    "parser_for",
    "scan_calls",
]

#: the start of an object naming a call, up to its arguments' first character
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
#: what may stand between the objects of a call region
_BETWEEN = " \t\r\n,;[]"
_HELD_TAIL = " \t\r\n}"


def new_call_id() -> str:
    """A fresh call id, in OpenAI's shape (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def _object_end(text: str, start: int) -> int:
    """The index after the JSON object starting at ``text[start] == "{"``, or -1 when it has
    not ended yet."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return -1


def _name_of(raw: str) -> str | None:
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None


def _complete_call(text: str) -> tuple[str, str] | None:
    """(name, arguments text) of a whole call object, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if key not in value:
        return None
    arguments = value[key]
    head = _HEAD.match(text)
    if head is not None:
        # NOTE: the arguments as generated (the text streamed so far is a prefix of them)
        raw = text[head.end() :].rstrip()[:-1].rstrip()
        try:
            if json.loads(raw) == arguments:
                return value["name"], raw
        except ValueError:
            pass
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def scan_calls(region: str, closed: bool) -> tuple[list[tuple[str, str]], bool]:
    """The calls in a region of call objects (separated by whitespace, ``,`` or ``;``,
    possibly in a list): each (name, arguments text so far), and whether the region is well
    formed. ``closed``: the region has ended (else its last object may still be growing: it
    counts once its name is read, its arguments without their trailing ``}`` run)."""
    calls: list[tuple[str, str]] = []
    index = 0
    while True:
        while index < len(region) and region[index] in _BETWEEN:
            index += 1
        if index >= len(region):
            return calls, True
        if region[index] != "{":
            return calls, False
        end = _object_end(region, index)
        if end < 0:
            head = _HEAD.match(region, index)
            name = _name_of(head.group(1)) if head else None
            if head is not None and name is not None:
                calls.append((name, region[head.end() :].rstrip(_HELD_TAIL)))
            return calls, not closed and (head is not None or len(region) - index < 4096)
        call = _complete_call(region[index:end])
        if call is None:
            return calls, False
        calls.append(call)
        index = end


class ToolParser:
    """The base of tool-call parsers: a region of call objects starts at one of
    :attr:`starts` (or, with :attr:`leading_json`, at an output that starts with ``{`` or
    ``[``) and ends at :attr:`end` ("" : the output's end)."""

    api_version = 1
    name = ""
    starts: tuple[str, ...] = ()
    end = ""
    leading_json = False

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._position = 0  # where the next unread text starts
        self._region: int | None = None  # where the current call region's objects start
        self._marker = 0  # where its marker starts (its text is content if it holds no call)
        self._first_call = 0  # the index in calls of its first call
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
        while True:
            if self._region is None:
                if not self._read_text():
                    return
            elif not self._read_region():
                return

    def _read_text(self) -> bool:
        """Release content up to the next region; True when one starts."""
        buffer, position = self._buffer, self._position
        if self.leading_json and position == 0 and not self.content:
            stripped = buffer.lstrip()
            if not stripped and not self._finished:
                return False
            if stripped[:1] in ("{", "["):
                self._marker = 0
                self._region = len(buffer) - len(stripped)
                return True
        found = [(buffer.find(start, position), start) for start in self.starts]
        found = [(index, start) for index, start in found if index >= 0]
        if found:
            index, start = min(found)
            self.content += buffer[position:index]
            self._marker = index
            self._region = index + len(start)
            self._position = index
            return True
        cut = len(buffer) if self._finished else len(buffer) - _partial(buffer, self.starts)
        cut = max(cut, position)
        self.content += buffer[position:cut]
        self._position = cut
        return False

    def _read_region(self) -> bool:
        """Read the current region; True when it closed and text follows."""
        assert self._region is not None
        buffer = self._buffer
        stop = buffer.find(self.end, self._region) if self.end else -1
        closed = stop >= 0 or self._finished
        region_end = stop if stop >= 0 else len(buffer)
        if stop < 0 and self.end and not self._finished:
            region_end -= _partial(buffer, (self.end,))
        calls, ok = scan_calls(buffer[self._region : region_end], closed)
        self._update(calls)
        if not closed:
            return False
        after = stop + len(self.end) if stop >= 0 else len(buffer)
        if not ok and len(self.calls) == self._first_call:
            self.content += buffer[self._marker : after]  # never a call: it was text
        self._position = after
        self._region = None
        self._first_call = len(self.calls)
        return stop >= 0

    def _update(self, calls: list[tuple[str, str]]) -> None:
        """Grow the region's calls to ``calls`` (names kept, arguments only extended)."""
        for offset, (name, arguments) in enumerate(calls):
            index = self._first_call + offset
            if index < len(self.calls):
                old = self.calls[index]
                if len(arguments) > len(old.arguments) and arguments.startswith(old.arguments):
                    self.calls[index] = ToolCall(old.id, old.name, arguments)
            else:
                self.calls.append(ToolCall(new_call_id(), name, arguments))


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes, Qwen)."""

    name = "hermes"
    starts = ("<tool_call>",)
    end = "</tool_call>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON tool calls: the output is ``{"name": ..., "parameters": ...}`` (``;``
    between several), after an optional ``<|python_tag|>``."""

    name = "llama3_json"
    starts = ("<|python_tag|>",)
    leading_json = True


class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``."""

    name = "mistral"
    starts = ("[TOOL_CALLS]",)


class GenericToolParser(ToolParser):
    """For models without a format: ``<tool_call>`` tags (the default tool preamble's), or an
    output that is a JSON call object or a list of them."""

    name = "generic"
    starts = ("<tool_call>",)
    end = "</tool_call>"
    leading_json = True

    def _read_region(self) -> bool:
        # NOTE: a region that began as the output's leading JSON runs to the output's end
        if (
            self._marker == 0
            and self._region is not None
            and not self._buffer.startswith(self.starts[0], self._marker)
        ):
            end, self.end = self.end, ""
            try:
                return super()._read_region()
            finally:
                self.end = end
        return super()._read_region()


class JsonListToolParser(ToolParser):
    """``tool_choice: "required"``: the whole output is a JSON list of
    ``{"name": ..., "parameters": ...}`` objects, as the request's grammar enforces it
    (vLLM's shape: ``vllm/entrypoints/openai/serving_chat.py``)."""

    name = "json_list"
    leading_json = True


class NamedFunctionParser(ToolParser):
    """A named ``tool_choice``: the whole output is the arguments of ``function`` (enforced by
    the request's grammar); one call, its arguments streamed as generated."""

    name = "named"

    def __init__(self, function: str = "") -> None:
        super().__init__()
        self.function = function

    def feed(self, text: str) -> None:
        self._buffer += text
        if not self.calls and not self._buffer.strip():
            return
        arguments = self._buffer.strip()
        if not self.calls:
            self.calls.append(ToolCall(new_call_id(), self.function, arguments))
        else:
            self.calls[0] = ToolCall(self.calls[0].id, self.function, arguments)

    def finish(self) -> None:
        self._finished = True
        self.feed("")


def parser_for(name: str, **options: Any) -> ToolParser:
    """A built-in parser by name (tests and the internal modes; the stage resolves plugins)."""
    return _BUILTIN[name](**options)


_BUILTIN: dict[str, Any] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                   GenericToolParser, JsonListToolParser, NamedFunctionParser)
}  # fmt: skip
