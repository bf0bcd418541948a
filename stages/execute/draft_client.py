"""The execute stage's side of a draft model placed apart (``speculative_config``
``"placement": "host"``, docs/speculative.md "Where the draft model runs"): after each target
step it tells the draft stage (:mod:`stages.execute.draft_stage`) what to draft and what to
forget (:class:`~stages.execute.draft_messages.DraftFeed`, on the execute stage's ``draft``
port) and waits a bounded time for the proposals, which ride the step's result to the
scheduler as with the draft model beside the target.

NOTE: drafts are never stale. A feed carries each request's tokens as the target holds them
after the step, the answer names the feed's step, and only the answer to the step just run is
taken: an answer that comes after ``draft_timeout`` is dropped when it arrives, and no new
drafts are asked for while one is still awaited (the draft stage works in order; asking more
would queue behind it). The requests to forget always go out. A draft stage that failed,
whose host died (:meth:`DraftClient.lost`), or that cannot draft for the target costs the
drafts, never a request: the target decodes on without speculation, logged once, and
``StepResult.drafts_dropped`` counts the requests that went without.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from pipeline.runtime.stage import Stage
from stages.execute.draft_messages import DraftFeed, DraftProposals, DraftReady
from stages.execute.draft_tracker import DraftTracker, with_dropped
from stages.messages import SchedulerStep, StepResult
from stages.speculative import SpeculativeConfig

__all__ = ["DRAFT_PORT", "DraftClient"]

logger = logging.getLogger("actorline.execute")

#: the execute stage's port to its draft stage
DRAFT_PORT = "draft"


class DraftClient:
    """Feeds a draft stage placed apart and takes its proposals (see the module docstring).

    Args:
        stage: the execute stage, whose ``draft`` port leads to the draft stage.
        spec: the engine's speculative config (method ``draft_model``, placement ``host``).
    """

    def __init__(self, stage: Stage, spec: SpeculativeConfig) -> None:
        self._stage = stage
        self._timeout = spec.draft_timeout
        self.tracker = DraftTracker(spec)
        #: whether the draft stage loaded its model for this target
        self.ready = False
        #: its answer once it loaded (its KV cache, its host), or None
        self.loaded: DraftReady | None = None
        self._settled = asyncio.Event()  # it loaded, cannot draft, or was lost
        #: why no more drafts are asked for (the draft stage failed, its host died), or ""
        self.failure = ""
        #: the feed whose answer is awaited: its step id and the future its answer resolves
        self._awaited: tuple[int, asyncio.Future[DraftProposals]] | None = None
        self._late_logged = False

    @property
    def idle(self) -> bool:
        """Whether no answer is awaited."""
        return self._awaited is None

    # ------------------------------------------------------------- what the draft stage says
    def on_ready(self, ready: DraftReady) -> None:
        """The draft stage loaded its model (or cannot draft for this target: no drafts)."""
        if ready.error:
            self._fail(f"the draft stage cannot draft: {ready.error}")
            return
        logger.info("execute: the draft stage drafts with %s", ready.model)
        self.ready = True
        self.loaded = ready
        self._settled.set()

    async def settled(self) -> DraftReady | None:
        """Wait until the draft stage has loaded its model (its answer), cannot draft, or
        was lost (None)."""
        await self._settled.wait()
        return self.loaded

    def on_proposals(self, proposals: DraftProposals) -> None:
        """An answer: taken if it is the awaited one and still awaited, else dropped."""
        if proposals.error:
            self._fail(f"the draft stage failed: {proposals.error}")
        awaited = self._awaited
        if awaited is None or awaited[0] != proposals.step_id:
            return  # NOTE: an answer to a feed not asked for any more: never used
        self._awaited = None
        if not awaited[1].done():
            awaited[1].set_result(proposals)

    def lost(self, reason: str) -> None:
        """The draft stage's host died or was cut off: no drafts from now on."""
        self._fail(f"the draft stage was lost: {reason}")

    def restored(self) -> None:
        """The draft stage runs again on a fresh host (restarted alone,
        :mod:`pipeline.engine.replica_heal`): no drafts until it says it has loaded its model
        again (:meth:`on_ready`). Its draft cache is empty: each query carries the request's
        every token (:class:`~stages.execute.draft_messages.DraftQuery`), so a running
        request's next query registers it there and catches its cache up, as a resumed
        request's does."""
        if self.failure:
            logger.warning("execute: the draft stage runs again; drafts resume once it loads")
        self.ready = False
        self.failure = ""
        self._late_logged = False
        awaited, self._awaited = self._awaited, None
        if awaited is not None and not awaited[1].done():
            awaited[1].set_result(DraftProposals(awaited[0], error="the draft stage restarted"))

    def _fail(self, reason: str) -> None:
        self._settled.set()
        if not self.failure:
            self.failure = reason
            logger.error("execute: %s; decoding goes on without speculation", reason)
        awaited, self._awaited = self._awaited, None
        if awaited is not None and not awaited[1].done():
            awaited[1].set_result(DraftProposals(awaited[0], error=reason))

    # ------------------------------------------------------------------- after each step
    async def after_step(
        self,
        step: SchedulerStep,
        result: StepResult,
        output_token_ids: Callable[[str], Sequence[int]],
    ) -> StepResult:
        """Tell the draft stage about ``step`` and wait at most ``draft_timeout`` for its
        drafts (see the module docstring).

        Returns:
            ``result`` with the drafts, or without them (``drafts_dropped`` counting the
            requests that asked for one) where they did not come in time or cannot come.
        """
        queries, forget = self.tracker.observe(step, result, output_token_ids)
        if not self.ready or self.failure:
            return with_dropped(result, len(queries) if self.failure else 0)
        if self._awaited is not None or not queries:
            # a draft still awaited: the draft stage is behind; ask for nothing more
            if forget:
                await self._stage.emit(DRAFT_PORT, DraftFeed(result.step_id, (), tuple(forget)))
            return with_dropped(result, len(queries))
        future: asyncio.Future[DraftProposals] = asyncio.get_running_loop().create_future()
        self._awaited = (result.step_id, future)
        await self._stage.emit(DRAFT_PORT, DraftFeed(result.step_id, tuple(queries), tuple(forget)))
        try:
            # NOTE: shielded: a timeout leaves the feed awaited (its late answer clears it)
            proposals = await asyncio.wait_for(asyncio.shield(future), self._timeout)
        except TimeoutError:
            if not self._late_logged:
                self._late_logged = True
                logger.warning(
                    "execute: the draft stage did not answer step %d within draft_timeout "
                    "(%g s); steps go on without its drafts until it catches up (logged once)",
                    result.step_id,
                    self._timeout,
                )
            return with_dropped(result, len(queries))
        if proposals.error:
            return with_dropped(result, len(queries))
        if not proposals.drafts:
            return result
        asked = {query.request_id: query.num_tokens for query in queries}
        drafts = {
            request_id: tuple(draft[: asked[request_id]])
            for request_id, draft in proposals.drafts.items()
            if request_id in asked and draft
        }
        return dataclasses.replace(result, draft_token_ids=drafts)
