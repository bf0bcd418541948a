"""A bounded memory of aborts that overtook their request (pure logic, no IO).

The API sends aborts straight to schedule and detokenize while the request itself still
passes tokenize (and admit), so an abort can arrive before its request. A stage that tracks
requests remembers such ids and drops the request when it arrives; otherwise it would keep
the request's state forever. Request ids inside the pipeline are unique, so a remembered id
never matches a later, different request. The oldest ids are forgotten past ``capacity``.
"""

from __future__ import annotations

import collections

__all__ = ["EARLY_ABORTS_KEPT", "EarlyAborts"]

#: how many aborts of not-yet-arrived requests a stage remembers
EARLY_ABORTS_KEPT = 65536


class EarlyAborts:
    """Ids aborted before their request arrived, oldest forgotten first."""

    __slots__ = ("_capacity", "_ids")

    def __init__(self, capacity: int = EARLY_ABORTS_KEPT) -> None:
        self._capacity = capacity
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, request_id: str) -> None:
        """Remember that ``request_id`` was aborted before it arrived."""
        self._ids[request_id] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Whether ``request_id`` was aborted early (forgetting it: it arrives once)."""
        return self._ids.pop(request_id, 0) is None

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids
