"""The execute stage's two ends of disaggregated prefill and decode's direct link
(docs/parallelism.md, "Disaggregated prefill and decode"; the messages are
:mod:`stages.kv_transfer`).

A prefill engine's execute stage learns from each new request where its blocks go
(``EngineRequest.kv_to``: the decode engine's execute stage the router chose) and, once the
step that completes the prompt has run, sends the :class:`~stages.kv_transfer.KvBlocks` there
under the caller's request id (:meth:`KvLinks.addressed`). A decode engine's execute stage
holds what arrives in its :class:`~stages.kv_transfer.KvInbox` (:meth:`KvLinks.arrived`: the
router is told) and joins a new request that says its blocks wait here
(``EngineRequest.kv_from``) with them before the step runs (:meth:`KvLinks.join`), so
:func:`stages.execute.kv_blocks.import_moved_blocks` imports them as if they had come inside
the request. A request whose blocks are not here (released, or never came) computes its
whole prompt: the same tokens, a slower first token, and a warning.

Pure bookkeeping: no torch, no asyncio (the stage sends what this returns).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from stages.kv_transfer import PREFILL_SUFFIX, KvArrived, KvBlocks, KvInbox, KvRelease
from stages.messages import SchedulerStep

__all__ = ["KvLinks"]

logger = logging.getLogger("actorline.execute")


class KvLinks:
    """One execute stage's side of the direct links: where its prefill requests' blocks go,
    and the blocks held for its decode requests."""

    def __init__(self) -> None:
        self.inbox = KvInbox()
        #: prefill request id -> the execute stage its blocks go to
        self._to: dict[str, str] = {}

    def join(self, step: SchedulerStep) -> SchedulerStep:
        """``step`` with each new request whose blocks wait here carrying them, and the
        destinations of its new prefill requests noted (those of requests it finishes
        forgotten)."""
        for request_id in step.finished:
            self._to.pop(request_id, None)
        if not step.new_requests:
            return step
        joined, changed = [], False
        for request in step.new_requests:
            if request.kv_to:
                self._to[request.request_id] = request.kv_to
            if request.kv_from and request.kv_blocks is None:
                blocks = self.inbox.take(request.request_id)
                if blocks is None:
                    logger.warning(
                        "request %s: its moved KV blocks (from %s) are not here; it computes "
                        "its whole prompt",
                        request.request_id,
                        request.kv_from,
                    )
                else:
                    request = dataclasses.replace(request, kv_blocks=blocks)
                    changed = True
            joined.append(request)
        return dataclasses.replace(step, new_requests=tuple(joined)) if changed else step

    def addressed(self, exports: Sequence[KvBlocks]) -> list[tuple[str, KvBlocks]]:
        """Each exported ``KvBlocks`` (under its prefill id) with the execute stage it goes
        to, under the caller's request id. Blocks of a request that named no destination
        (a prefill request from a router of before the direct link) are dropped, logged."""
        addressed = []
        for blocks in exports:
            to = self._to.pop(blocks.request_id, None)
            if to is None:
                logger.warning("request %s: KV blocks exported with nowhere to go; dropped",
                               blocks.request_id)  # fmt: skip
                continue
            caller = blocks.request_id.removesuffix(PREFILL_SUFFIX)
            addressed.append((to, dataclasses.replace(blocks, request_id=caller)))
        return addressed

    def arrived(self, blocks: KvBlocks, stage: str) -> KvArrived:
        """Hold ``blocks`` until their request comes; the note for the router (from execute
        stage ``stage``, this one)."""
        return self.inbox.put(blocks, stage)

    def release(self, release: KvRelease) -> int:
        """Drop the held blocks ``release`` names; how many were held."""
        return self.inbox.release(release.request_ids)
