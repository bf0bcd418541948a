"""StopChecker: stop strings over streamed text, fed by the real SmolLM2 detokenizer where
tokens matter, and a hypothesis property for split-independence."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.detokenizer import DetokenizerFactory
from stages.errors import InvalidRequestError
from stages.params import MAX_STOP_STRING_LENGTH, SamplingParams
from stages.stop_checker import StopChecker, StopCheckerClosedError, StopDecision


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def one_shot(
    text: str, stop: Sequence[str], include: bool, counts_from: int = 0
) -> tuple[str, str | None]:
    """The reference: cut ``text`` at the stop match that completes first (ties: the one
    starting first) among those ending after ``counts_from``; keep it when ``include``."""
    best: tuple[int, int, str] | None = None
    for stop_string in stop:
        start = text.find(stop_string, max(0, counts_from - len(stop_string) + 1))
        if start >= 0:
            key = (start + len(stop_string), start, stop_string)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        return text, None
    end, start, stop_string = best
    return text[: end if include else start], stop_string


def stream_pieces(checker: StopChecker, pieces: Sequence[str]) -> tuple[list[str], StopDecision]:
    """Push pieces (one output token each) until a stop; the deltas, then finish()."""
    deltas: list[str] = []
    decision = StopDecision("")
    for count, piece in enumerate(pieces, start=1):
        decision = checker.push(piece, count)
        deltas.append(decision.delta)
        if decision.stopped:
            break
    deltas.append(checker.finish())
    return deltas, decision


def stream_tokens(
    tokenizer: Any, token_ids: Sequence[int], checker: StopChecker
) -> tuple[list[str], StopDecision]:
    """Detokenize one token at a time (real tokenizer) and stop-check each delta."""
    detokenizer = DetokenizerFactory(tokenizer).create([])
    deltas: list[str] = []
    decision = StopDecision("")
    for count, token_id in enumerate(token_ids, start=1):
        decision = checker.push(detokenizer.push([token_id]), count)
        deltas.append(decision.delta)
        if decision.stopped:
            break
    else:
        deltas.append(checker.push(detokenizer.flush(), len(token_ids)).delta)
    deltas.append(checker.finish())
    return deltas, decision


def test_stop_string_spanning_several_tokens_is_cut_and_never_partly_streamed(
    tokenizer: Any,
) -> None:
    text = "The answer is 42. END OF ANSWER and then more text."
    stop = "END OF ANSWER"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode(" " + stop, add_special_tokens=False)) >= 3  # spans tokens
    checker = StopChecker([stop])
    deltas, decision = stream_tokens(tokenizer, token_ids, checker)
    assert decision == StopDecision(decision.delta, True, stop)
    assert "".join(deltas) == checker.text == "The answer is 42. "
    streamed = ""
    for delta in deltas:
        streamed += delta
        # No prefix of the stop string is ever visible at the end of what was streamed.
        assert not any(streamed.endswith(stop[:k]) for k in range(1, len(stop) + 1))
    assert checker.stopped and checker.stop_reason == stop
    with pytest.raises(StopCheckerClosedError):
        checker.push(" more", 99)  # finish() ran


def test_stop_string_with_multibyte_characters_across_tokens(tokenizer: Any) -> None:
    text = "Voilà: 日本語😀 ends here"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    checker = StopChecker(["語😀"])
    deltas, decision = stream_tokens(tokenizer, token_ids, checker)
    assert decision.stop_reason == "語😀"
    assert "".join(deltas) == "Voilà: 日本"
    assert all("\ufffd" not in delta for delta in deltas)


def test_earliest_completing_match_wins() -> None:
    # "cd" completes before "bcde" and "xyz": it wins although listed last.
    checker = StopChecker(["bcde", "xyz", "cd"])
    decision = checker.push("abcdexyz", 1)
    assert decision == StopDecision("ab", True, "cd")
    # At the same end character, the match starting first (the longer) wins.
    checker = StopChecker(["cd", "bcd"])
    assert checker.push("abcd", 1) == StopDecision("a", True, "bcd")
    # Independent of the split: the same text one character at a time.
    checker = StopChecker(["bcde", "xyz", "cd"])
    deltas, decision = stream_pieces(checker, list("abcdexyz"))
    assert "".join(deltas) == "ab" and decision.stop_reason == "cd"


def test_include_stop_str_in_output_keeps_the_match_and_holds_nothing() -> None:
    checker = StopChecker(["</answer>"], include_stop_str_in_output=True)
    assert checker.push("x </ans", 1).delta == "x </ans"  # nothing held back
    decision = checker.push("wer> trailing", 2)
    assert decision == StopDecision("wer>", True, "</answer>")
    assert checker.text == "x </answer>"
    assert checker.finish() == ""


def test_min_tokens_delays_stop_strings() -> None:
    checker = StopChecker(["!"], min_tokens=3)
    assert checker.push("Hi!", 1) == StopDecision("Hi!")  # token 1 of 3: does not count
    assert checker.push(" Yo!", 3) == StopDecision(" Yo!")  # token 3: still not
    assert checker.push(" Ok!", 4) == StopDecision(" Ok", True, "!")
    assert checker.text == "Hi! Yo! Ok"


def test_min_tokens_match_may_start_in_earlier_text() -> None:
    """vLLM's rule: the match must end in text that counts, it may start before."""
    checker = StopChecker(["STOP"], min_tokens=1)
    assert checker.push("go ST", 1) == StopDecision("go ")  # "ST" held: could start STOP
    assert checker.held_text == "ST"
    assert checker.push("OP now", 2) == StopDecision("", True, "STOP")
    assert checker.text == "go "
    # Tokens already in flight from the engine are ignored until finish().
    assert checker.push(" more", 3) == StopDecision("", True, "STOP")
    assert checker.finish() == ""
    assert checker.text == "go "


def test_finish_flushes_held_text() -> None:
    checker = StopChecker(["<|end|>"])
    assert checker.push("result: <|e", 1).delta == "result: "
    assert checker.held_text == "<|e"
    assert checker.finish() == "<|e"  # length / abort / stop token: flushed as is
    assert checker.text == "result: <|e"
    assert checker.finish() == ""
    with pytest.raises(StopCheckerClosedError):
        checker.push("nd|>", 2)


def test_hold_back_is_minimal() -> None:
    checker = StopChecker(["Human:", "###"])
    # Nothing at the end can start a stop string: everything streams at once.
    assert checker.push("Hello there", 1).delta == "Hello there"
    # Only the suffix that is a prefix of a stop string is held ("Hu", not max_len - 1).
    assert checker.push(" Hu", 2).delta == " "
    assert checker.held_text == "Hu"
    # The held text turns out not to be a stop string: released with the new text.
    assert checker.push("go is here #", 3).delta == "Hugo is here "
    assert checker.held_text == "#"
    assert checker.push("#", 4).delta == ""
    assert checker.held_text == "##"
    assert checker.push(" done", 5).delta == "## done"
    assert checker.held_text == ""


def test_overlapping_prefix_is_held_through_a_false_start() -> None:
    # "aab": after "aa" the longest held prefix must restart inside the held text.
    checker = StopChecker(["aab"])
    assert checker.push("xa", 1).delta == "x"
    assert checker.push("a", 2).delta == ""
    assert checker.push("a", 3).delta == "a"  # "aaa": only "aa" can still start "aab"
    assert checker.push("b", 4) == StopDecision("", True, "aab")
    assert checker.text == "xa"


def test_a_stop_string_of_the_longest_length_allowed_is_held_and_matched() -> None:
    stop = "".join(chr(ord("a") + i % 26) for i in range(MAX_STOP_STRING_LENGTH))
    checker = StopChecker([stop, "zz"])
    for i in range(0, len(stop) - 1, 100):  # every piece extends a prefix: all held
        assert checker.push(stop[i : min(i + 100, len(stop) - 1)], 1 + i).delta == ""
    assert checker.held_text == stop[:-1]
    assert checker.push(stop[-1], 10**4) == StopDecision("", True, stop)
    released = StopChecker([stop])
    assert released.push(stop[:500], 1).delta == ""
    assert released.push("!", 2).delta == stop[:500] + "!"  # a false start, released


def test_no_stop_strings_streams_everything() -> None:
    checker = StopChecker()
    assert checker.push("any text", 1) == StopDecision("any text")
    assert checker.push("", 2) == StopDecision("")
    assert checker.finish() == ""
    assert checker.text == "any text"


def test_from_params_and_validation() -> None:
    params = SamplingParams(stop=("x", "yz"), include_stop_str_in_output=True, min_tokens=2)
    checker = StopChecker.from_params(params)
    assert checker.push("ax", 1) == StopDecision("ax")
    assert checker.push("byz", 3) == StopDecision("byz", True, "yz")
    with pytest.raises(InvalidRequestError) as error:
        StopChecker(["ok", ""])
    assert error.value.field == "stop"
    with pytest.raises(InvalidRequestError) as error:
        StopChecker(["ok"], min_tokens=-1)
    assert error.value.field == "min_tokens"
    with pytest.raises(ValueError, match="stop_reason"):
        StopDecision("", stopped=True)


# Small alphabets make stop strings occur (and overlap) often.
texts = st.text(alphabet="abc d\n😀é", max_size=60)
stop_lists = st.lists(st.text(alphabet="abc d\n😀é", min_size=1, max_size=5), max_size=4)


@settings(max_examples=500, deadline=None)
@given(text=texts, stop=stop_lists, include=st.booleans(), data=st.data())
def test_streamed_result_is_independent_of_the_split(
    text: str, stop: list[str], include: bool, data: st.DataObject
) -> None:
    """Property: however the text is split into pushes (one token each), the deltas
    concatenate to the one-shot result, the stop reason agrees, and after each push exactly
    the longest suffix that could start a stop string is held back. With min_tokens, the
    one-shot result only counts matches ending after the first min_tokens pieces."""
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    min_tokens = data.draw(st.integers(0, 3))
    counts_from = len("".join(pieces[:min_tokens]))
    expected_text, expected_reason = one_shot(text, stop, include, counts_from)
    checker = StopChecker(stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    pushed = ""
    deltas: list[str] = []
    for count, piece in enumerate(pieces, start=1):
        decision = checker.push(piece, count)
        deltas.append(decision.delta)
        pushed += piece
        if decision.stopped:
            break
        streamed = "".join(deltas)
        assert expected_text.startswith(streamed)
        held = len(pushed) - len(streamed)
        could_start = [
            k
            for k in range(1, len(pushed) + 1)
            if any(s.startswith(pushed[-k:]) and len(s) > k for s in stop)
        ]
        assert held == (0 if include or not could_start else max(could_start))
    deltas.append(checker.finish())
    assert "".join(deltas) == checker.text == expected_text
    assert checker.stop_reason == expected_reason
