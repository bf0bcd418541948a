"""A chat stream's deltas of parsed outputs (pure): reasoning, content and calls arrive
cumulative from the parse stage; each chunk carries only what is new, a call's first delta
its index, id, type and name, the next ones argument pieces that concatenate to the whole."""

from __future__ import annotations

from pipeline.server.http.chat import SentParts
from stages.messages import RequestOutput, ToolCall


def output(delta: str, reasoning: str, *calls: ToolCall) -> RequestOutput:
    return RequestOutput("r", "", delta, (), reasoning=reasoning, tool_calls=calls)


def test_each_delta_carries_what_is_new() -> None:
    sent = SentParts()
    assert sent.delta(output("", "Let me")) == {"reasoning_content": "Let me"}
    assert sent.delta(output("", "Let me think")) == {"reasoning_content": " think"}
    assert sent.delta(output("Sure.", "Let me think")) == {"content": "Sure."}
    first = ToolCall("call_1", "get_weather", '{"ci')
    assert sent.delta(output("", "Let me think", first)) == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"ci'}}]
    }  # fmt: skip
    grown = ToolCall("call_1", "get_weather", '{"city": "Rome"}')
    second = ToolCall("call_2", "get_time", "")
    assert sent.delta(output("", "Let me think", grown, second)) == {
        "tool_calls": [
            {"index": 0, "function": {"arguments": 'ty": "Rome"}'}},
            {"index": 1, "id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": ""}},
        ]
    }  # fmt: skip
    assert sent.delta(output("", "Let me think", grown, second)) == {}
