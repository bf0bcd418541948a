"""Stop strings on streamed text, one checker per request.

Follows vLLM V1 ``check_stop_strings`` (``vllm/v1/engine/detokenizer.py``) and its use in
``vllm/v1/engine/output_processor.py``: only the tail where a new match can be is searched,
the match is cut from the output (kept with ``include_stop_str_in_output``), and stop strings
do not count before ``min_tokens`` output tokens.

Choices, where vLLM leaves room:

- **Which match wins.** The match that *completes* first in the text, so the result does not
  depend on how the text was split into pushes (it is what a token-by-token check finds);
  between matches completing at the same character, the one starting earlier (the longer
  stop string). vLLM breaks that tie by list order instead.
- **Hold-back.** vLLM holds back ``max(len(stop)) - 1`` characters while streaming. This
  holds back only the longest suffix of the text that is a proper prefix of some stop string,
  the least that keeps a partial stop string from being streamed; text that cannot start a
  stop string goes out at once. With ``include_stop_str_in_output`` nothing is held.
- **min_tokens.** A push's text counts for stop strings when ``num_output_tokens`` after it
  exceeds ``min_tokens``; a match may start in earlier text but must end in counting text
  (vLLM's offset rule). With one token per push this is exactly vLLM's per-token rule; a push
  of several tokens that crosses ``min_tokens`` counts whole.
- **A stop string ending mid-token.** The text is cut inside the token; the token list is
  not: the token stays among the output ids (as in vLLM), so ``decode(token_ids)`` can be
  longer than the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from stages.errors import InvalidRequestError
from stages.params import SamplingParams

__all__ = ["StopChecker", "StopCheckerClosedError", "StopDecision"]


class StopCheckerClosedError(RuntimeError):
    """``push`` was called on a :class:`StopChecker` after ``finish``."""


@dataclasses.dataclass(frozen=True, slots=True)
class StopDecision:
    """What one push allows: ``delta`` is safe to stream now; ``stopped`` when a stop string
    matched, ``stop_reason`` being that string.

    Raises:
        ValueError: ``stopped`` and ``stop_reason`` disagree.
    """

    delta: str
    stopped: bool = False
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        if self.stopped != (self.stop_reason is not None):
            raise ValueError(
                f"stop_reason must be set exactly when stopped (stopped={self.stopped}, "
                f"stop_reason={self.stop_reason!r})"
            )


_NOTHING = StopDecision("")


class StopChecker:
    """Finds stop strings in one request's streamed text and decides what may be streamed.

    Args:
        stop: the stop strings (non-empty).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: stop strings count only once more output tokens than this exist.

    Raises:
        InvalidRequestError: an empty or non-string stop string, or a negative
            ``min_tokens`` (``field`` names which).
    """

    __slots__ = (
        "_closed",
        "_held",
        "_include",
        "_min_tokens",
        "_parts",
        "_prefixes_by_last_char",
        "_stop",
        "_stop_reason",
        "_text",
        "_window",
        "_window_size",
    )

    def __init__(
        self,
        stop: Sequence[str] = (),
        *,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for stop_string in stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings, got {stop_string!r}", field="stop"
                )
        if type(min_tokens) is not int or min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be an integer >= 0, got {min_tokens!r}", field="min_tokens"
            )
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens
        # NOTE: the window is the last max(len(stop)) - 1 characters of all text pushed
        # (before cutting): a match ending in new text starts no earlier than that. Its last
        # _held characters have not been streamed yet, and _held never exceeds its length.
        self._window_size = max((len(s) for s in self._stop), default=1) - 1
        self._window = ""
        self._held = 0
        self._parts: list[str] = []
        self._text: str | None = ""
        self._stop_reason: str | None = None
        self._closed = False
        # For the hold-back: per last character c, every proper prefix of a stop string that
        # ends with c, longest first, as (its length, the stop string): only these can be a
        # suffix of text ending with c. Lengths, not the prefixes themselves, so memory grows
        # with the stop strings' length, not its square.
        by_last_char: dict[str, list[tuple[int, str]]] = {}
        if not self._include:
            for stop_string in self._stop:
                for length in range(1, len(stop_string)):
                    by_last_char.setdefault(stop_string[length - 1], []).append(
                        (length, stop_string)
                    )
        self._prefixes_by_last_char = {
            char: tuple(sorted(prefixes, key=lambda entry: entry[0], reverse=True))
            for char, prefixes in by_last_char.items()
        }

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        """The checker for a request's sampling parameters."""
        return cls(
            params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def text(self) -> str:
        """The text streamed so far (after cutting the stop string)."""
        if self._text is None:
            self._text = "".join(self._parts)
            self._parts = [self._text]
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, if one did."""
        return self._stop_reason

    @property
    def held_text(self) -> str:
        """Text pushed but held back (it could be the start of a stop string)."""
        return self._window[len(self._window) - self._held :]

    def push(self, new_text: str, num_output_tokens: int) -> StopDecision:
        """Add newly detokenized text; ``num_output_tokens`` counts every output token so far
        (those that produced ``new_text`` included).

        After a stop, further pushes are ignored and repeat the stopped decision with an
        empty delta (tokens already in flight from the engine).

        Raises:
            StopCheckerClosedError: after :meth:`finish`.
        """
        if self._closed:
            raise StopCheckerClosedError("push() after finish(): the request already finished")
        if self._stop_reason is not None:
            return StopDecision("", True, self._stop_reason)
        if not new_text:
            return _NOTHING
        if not self._stop:
            self._emit(new_text)
            return StopDecision(new_text)
        window = self._window
        buffer = window + new_text
        # Where unstreamed text starts in buffer.
        unstreamed = len(window) - self._held
        if num_output_tokens > self._min_tokens:
            match = self._find_first_match(buffer, len(window))
            if match is not None:
                start, stop_string = match
                cut = start + len(stop_string) if self._include else start
                delta = buffer[unstreamed:cut]
                self._emit(delta)
                self._stop_reason = stop_string
                self._window = ""
                self._held = 0
                return StopDecision(delta, True, stop_string)
        # Hold back the longest suffix that is a proper prefix of a stop string: only the
        # prefixes ending with the buffer's last character can be.
        held = 0
        for length, stop_string in self._prefixes_by_last_char.get(buffer[-1], ()):
            if length <= len(buffer) and stop_string.startswith(buffer[-length:]):
                held = length
                break
        self._window = buffer[-self._window_size :] if self._window_size else ""
        self._held = held
        delta = buffer[unstreamed : len(buffer) - held] if held else buffer[unstreamed:]
        if not delta:
            return _NOTHING
        self._parts.append(delta)
        self._text = None
        return StopDecision(delta)

    def finish(self) -> str:
        """Finish the request (stop token, length or abort): return the held-back text, which
        is then streamed as is. Later pushes raise; a second call returns ""."""
        if self._closed:
            return ""
        self._closed = True
        tail = self.held_text
        self._held = 0
        if tail:
            self._emit(tail)
        return tail

    def _emit(self, text: str) -> None:
        self._parts.append(text)
        self._text = None

    def _find_first_match(self, buffer: str, searched: int) -> tuple[int, str] | None:
        """The stop string match in ``buffer`` that ends after ``searched`` and completes
        first (ties: starts first), as (start, stop string); None if there is none."""
        best_end = best_start = 0
        best: str | None = None
        for stop_string in self._stop:
            # NOTE: the first occurrence ending after `searched` is the earliest-ending one
            # of this stop string; beginning the search later could skip a match.
            start = buffer.find(stop_string, max(0, searched - len(stop_string) + 1))
            if start < 0:
                continue
            end = start + len(stop_string)
            if best is None or (end, start) < (best_end, best_start):
                best, best_end, best_start = stop_string, end, start
        return None if best is None else (best_start, best)
