"""The draft stage: the draft model of speculative decoding as a stage of its own
(``speculative_config`` ``"placement": "host"``, docs/speculative.md "Where the draft model
runs"), on a host of its own (``<engine host>_draft``: a spawned process, or a Ray actor in the
engine replica's placement group under ``ray``), so the draft model runs on other cores or
another machine than the target.

Ports: ``in`` (from the execute stage's ``draft`` port: the target's
:class:`~stages.messages.EngineInfo`, once, then a
:class:`~stages.execute.draft_messages.DraftFeed` per target step; the info again from a
fresh target: an engine replica restarted alone); ``out``
(:class:`~stages.execute.draft_messages.DraftReady` once per info, with its KV cache,
then a :class:`~stages.execute.draft_messages.DraftProposals` for each feed that asked for
drafts; linked to the execute stage's ``in``). It wraps the same
:class:`~stages.execute.drafter.Drafter` that runs beside the target by default: its own
:class:`~stages.execute.runner.ModelRunner` and KV cache (as many blocks as the target's,
known from the target's info), rolled back to what the target accepted.

It never fails a request: a draft model that cannot load for the target (another vocabulary)
answers a :class:`DraftReady` with the error, drafting that raises answers the feed with the
error and drafts no more, and its host is an expendable replica set of the pipeline
(``docs/architecture.md`` §8), so a dead or silent draft host is cut off without failing the
pipeline; the execute stage (:class:`~stages.execute.draft_client.DraftClient`) decodes on
without speculation in every case.

NOTE: torch and the runner are imported when the stage starts, not with this module (the
frontend imports every stage class to build the pipeline graph), as the execute stage's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from pipeline.runtime.stage import Stage, handles
from stages.execute.config import ExecuteConfig
from stages.execute.draft_messages import DraftFeed, DraftProposals, DraftReady
from stages.messages import EngineInfo
from stages.models import loading

if TYPE_CHECKING:
    from stages.execute.drafter import Drafter

__all__ = ["DRAFT_HOST_SUFFIX", "DraftStage", "draft_host"]

logger = logging.getLogger("actorline.execute")

#: what the draft stage's host name adds to its engine host's
DRAFT_HOST_SUFFIX = "_draft"


def draft_host(engine_host: str) -> str:
    """The host of the draft stage of the engine on ``engine_host``."""
    return engine_host + DRAFT_HOST_SUFFIX


class DraftStage(Stage):
    """Runs the draft model for one engine's execute stage (see the module docstring).

    Args:
        config: the execute stage's config (its ``speculative_config`` names the draft model).
    """

    inputs = ("in",)
    outputs = ("out",)

    def __init__(self, config: ExecuteConfig) -> None:
        super().__init__(config)
        self.drafter: Drafter | None = None
        #: what it answered once loaded
        self._ready = DraftReady("")
        #: why it drafts no more (drafting raised), or ""
        self.failure = ""

    async def start(self) -> None:
        # NOTE: on the stage's thread, so the host's loop keeps beating meanwhile
        await self.run_in_thread(_import_model_stack)

    @handles(EngineInfo)
    async def on_target(self, target: EngineInfo) -> None:
        """Load the draft model for ``target`` (once) and say so."""
        from stages.execute.drafter import Drafter

        spec = self.config.speculative_config
        model = spec.model if spec is not None and spec.model is not None else ""
        if self.drafter is not None:
            # a fresh target (its engine replica restarted alone, docs/architecture.md §4.7):
            # the draft cache holds the old one's requests; dropped, and ready again
            drafter = self.drafter
            if not self.failure:
                await self.run_in_thread(drafter.forget_all)
            await self.emit("out", dataclasses.replace(self._ready, error=self.failure))
            return
        drafter = Drafter(self.config)

        def load() -> EngineInfo:
            with loading():
                return drafter.load(target)

        try:
            info = await self.run_in_thread(load)
        except Exception as exc:  # NOTE: the drafts are lost, never a request
            logger.exception("draft: the draft model %s cannot draft for %s", model, target.model)
            await self.emit("out", DraftReady(model, f"{type(exc).__name__}: {exc}"))
            return
        self.drafter = drafter
        self._ready = DraftReady(model, "", info.num_blocks, info.kv_cache_bytes, self.host_name)
        await self.emit("out", self._ready)

    @handles(DraftFeed)
    async def on_feed(self, feed: DraftFeed) -> None:
        """Forget what the feed says, draft for its queries and answer them."""
        drafter = self.drafter
        if drafter is None or self.failure:
            if feed.queries:
                await self.emit(
                    "out", DraftProposals(feed.step_id, error=self.failure or "not loaded")
                )
            return
        try:
            drafts = await self.run_in_thread(drafter.propose, feed.queries, feed.forget)
        except Exception as exc:  # NOTE: the drafts are lost, never a request
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.exception("draft: drafting failed; no more drafts from this stage")
            await self.emit("out", DraftProposals(feed.step_id, error=self.failure))
            return
        if feed.queries:
            await self.emit("out", DraftProposals(feed.step_id, drafts))


def _import_model_stack() -> None:
    """Import what :meth:`DraftStage.on_target` needs (off the event loop)."""
    import torch  # noqa: F401

    import stages.execute.drafter  # noqa: F401
