"""The target's side of the draft model (docs/speculative.md, "The draft model"): which
requests draft after a target step, how many tokens each, and which the draft model must
forget. Pure logic (no torch, no asyncio): the execute stage runs it after every step,
whether the draft model runs beside it (:class:`stages.execute.drafter.Drafter`) or as a
stage of its own (:mod:`stages.execute.draft_stage`, fed by
:class:`stages.execute.draft_client.DraftClient`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from stages.execute.draft_messages import DraftQuery
from stages.messages import SchedulerStep, StepResult
from stages.params import SamplingParams
from stages.speculative import Backoff, SpeculativeConfig, may_draft

__all__ = ["DraftTracker", "with_dropped"]


@dataclasses.dataclass(slots=True)
class _Target:
    """What the tracker keeps of a request the target runs."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class DraftTracker:
    """Follows the target's requests from its steps and says what to draft after each.

    Args:
        spec: the engine's speculative config (method ``draft_model``).
    """

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self._targets: dict[str, _Target] = {}
        self._backoff = Backoff()

    def observe(
        self,
        step: SchedulerStep,
        result: StepResult,
        output_token_ids: Callable[[str], Sequence[int]],
    ) -> tuple[list[DraftQuery], list[str]]:
        """Track ``step``'s requests, count its verified drafts for the back-off, and say
        which requests draft now: those that got a token and may draft
        (:func:`stages.speculative.may_draft`, not backing off, fewer running requests than
        ``disable_by_batch_size``, tokens left before ``max_tokens``).

        Args:
            output_token_ids: a request's output tokens as the target holds them now.
        Returns:
            The queries, and the requests the draft model must drop (finished, aborted or
            preempted).
        """
        for new in step.new_requests:
            self._targets[new.request_id] = _Target(new.prompt_token_ids, new.params)
        for request_id in step.finished:
            self._targets.pop(request_id, None)
            self._backoff.forget(request_id)
        forget = [*step.finished, *step.preempted, *result.preempted]
        for request_id, accepted in result.accepted_token_ids.items():
            self._backoff.observe(request_id, len(accepted))
        queries: list[DraftQuery] = []
        if len(self._targets) < self.spec.disable_by_batch_size:
            for request_id in result.request_ids:
                query = self._query(request_id, output_token_ids)
                if query is not None:
                    queries.append(query)
        return queries, forget

    def _query(
        self, request_id: str, output_token_ids: Callable[[str], Sequence[int]]
    ) -> DraftQuery | None:
        target = self._targets.get(request_id)
        if target is None:
            return None
        outputs = output_token_ids(request_id)
        # NOTE: not with its first token: that goes out without waiting for the draft
        # model's prefill, which starts with the next step
        if len(outputs) < 2 or not may_draft(target.params, len(outputs)):
            return None
        num_tokens = self.spec.num_speculative_tokens
        if target.params.max_tokens is not None:
            num_tokens = min(num_tokens, target.params.max_tokens - len(outputs) - 1)
        if num_tokens < 1 or self._backoff.skips(request_id):
            return None
        return DraftQuery(request_id, (*target.prompt_token_ids, *outputs), num_tokens)


def with_dropped(result: StepResult, count: int) -> StepResult:
    """``result`` with ``count`` more requests whose drafts were lost
    (``StepResult.drafts_dropped``)."""
    if count == 0:
        return result
    return dataclasses.replace(result, drafts_dropped=result.drafts_dropped + count)
