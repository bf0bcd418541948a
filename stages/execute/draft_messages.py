"""What the execute stage and a draft stage placed apart send each other
(docs/speculative.md, "Where the draft model runs"; :mod:`stages.execute.draft_stage`).

Per target step the execute stage sends one :class:`DraftFeed` (the requests to draft for,
each with its tokens as the target accepted them, and the requests to forget); the draft
stage answers each feed that asked for drafts with one :class:`DraftProposals` of the same
step id. Once, before any feed, the draft stage says it has loaded its model for the target
it was told of (the target's :class:`~stages.messages.EngineInfo`, on its ``in`` port) with a
:class:`DraftReady`. Apart from the torch side so that the stage modules, which the frontend
imports to build the pipeline graph, need no torch. Codec-encoded like every message
(``transports/tags.py``); nothing is pickled.
"""

from __future__ import annotations

import dataclasses

from stages.messages import EngineInfo
from transports.codec import message

__all__ = ["DraftFeed", "DraftProposals", "DraftQuery", "DraftReady", "with_draft_kv"]


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class DraftQuery:
    """Draft at most ``num_tokens`` tokens to follow ``token_ids`` (the request's prompt and
    its outputs so far) of ``request_id``."""

    request_id: str
    token_ids: tuple[int, ...]
    num_tokens: int


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class DraftFeed:
    """What the draft model needs after target step ``step_id``: first drop the requests
    ``forget`` (finished, aborted or preempted: their draft KV is freed), then draft for
    ``queries`` (none: nothing to answer)."""

    step_id: int
    queries: tuple[DraftQuery, ...] = ()
    forget: tuple[str, ...] = ()


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class DraftProposals:
    """The draft stage's answer to the feed of step ``step_id``: request id -> its draft
    (absent where the draft model drafted nothing). ``error``: why no drafts came (drafting
    raised; the draft stage drafts no more), else empty."""

    step_id: int
    drafts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    error: str = ""


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class DraftReady:
    """The draft stage loaded ``model`` for the target it was told of (``error`` empty), or
    cannot draft for it (``error`` says why: a vocabulary not the target's, a load that
    failed): the execute stage sends feeds only after a ready answer without error.
    Loaded: its KV cache (``num_blocks``, ``kv_cache_bytes``) and the ``host`` it runs on,
    which the execute stage reports in its :class:`~stages.messages.EngineInfo`."""

    model: str
    error: str = ""
    num_blocks: int = 0
    kv_cache_bytes: int = 0
    host: str = ""


def with_draft_kv(
    info: EngineInfo, model: str, num_blocks: int, kv_cache_bytes: int, host: str
) -> EngineInfo:
    """The target's ``info`` with its draft model's own KV cache (``num_blocks`` blocks of
    the target's block size, ``kv_cache_bytes``) and the ``host`` the draft model runs on."""
    return dataclasses.replace(
        info,
        draft_model=model,
        draft_num_blocks=num_blocks,
        draft_kv_cache_bytes=kv_cache_bytes,
        draft_host=host,
    )
