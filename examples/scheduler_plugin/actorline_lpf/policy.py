"""The "longest prompt first" policy (``lpf``).

Plain Python: the scheduler asks it two questions (which waiting request next, which running
request to preempt) and tells it what happened; it never touches the scheduler's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from stages.policies import RequestView, StepObservation

__all__ = ["LongestPromptFirstPolicy"]


def _arrival(request: RequestView) -> tuple[float, int]:
    return (request.arrival_time, request.arrival_index)


class LongestPromptFirstPolicy:
    """Admit the waiting request with the longest prompt first (ties: earliest arrival);
    when KV blocks run out, preempt the running request with the shortest prompt (ties:
    latest arrival), the cheapest one to recompute.

    This is "longest processing time first" applied to prefill: for an offline batch,
    starting the long prompts early leaves the short ones to fill the gaps at the end, which
    shortens the time to finish the whole batch. It is not meant for interactive serving:
    a steady stream of long prompts makes short ones wait.
    """

    # NOTE: the version of the actorline.schedulers protocol this class implements, written
    # out rather than imported: if actorline changes the protocol, loading must fail loudly.
    api_version: ClassVar[int] = 1
    name = "lpf"

    def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
        """``waiting`` longest prompt first, then by arrival."""
        return sorted(waiting, key=lambda r: (-r.num_prompt_tokens, *_arrival(r)))

    def select_victim(self, running: Sequence[RequestView]) -> RequestView:
        """The running request with the shortest prompt (the latest among equals)."""
        return min(running, key=lambda r: (r.num_prompt_tokens, -r.arrival_time, -r.arrival_index))

    def on_arrival(self, request: RequestView) -> None:
        """Nothing to learn from arrivals."""

    def on_step(self, observation: StepObservation) -> None:
        """Nothing to learn from steps."""

    def on_finish(self, request: RequestView) -> None:
        """Nothing to forget."""
