"""When to restart a dead engine and when to give up (pure logic, no event loop): the
``restart_*`` options of :class:`~pipeline.engine.options.EngineOptions`
(docs/architecture.md §4.7).

A death is counted at the moment the engine is found dead or frozen; a restart that fails to
start counts as one more. The wait before the next start is ``restart_backoff`` doubled for
each other death within ``restart_window`` (so a lone death waits ``restart_backoff``, a third
in a row four times that), at most :data:`~pipeline.engine.options.MAX_RESTART_BACKOFF`. Once
``restart_limit`` deaths fall within ``restart_window`` seconds, the engine is in a crash loop
and is not restarted again (as systemd's ``StartLimitBurst`` in ``StartLimitIntervalSec``).
"""

from __future__ import annotations

import collections
import dataclasses

from pipeline.engine.options import MAX_RESTART_BACKOFF

__all__ = ["RestartPolicy"]


@dataclasses.dataclass
class RestartPolicy:
    """Counts deaths and says how long to wait before the next start (None: give up).

    Raises (from the constructor): ValueError for a limit < 1 or a window <= 0.
    """

    backoff: float
    limit: int
    window: float
    deaths: collections.deque[float] = dataclasses.field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        if self.limit < 1 or not self.window > 0 or self.backoff < 0:
            raise ValueError(
                f"a restart policy needs limit >= 1, window > 0 and backoff >= 0, got "
                f"{self.limit}, {self.window}, {self.backoff}"
            )

    def died(self, now: float) -> float | None:
        """Record a death at ``now`` (monotonic seconds); the seconds to wait before
        restarting, or None once ``limit`` deaths fall within ``window``."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] <= now - self.window:
            self.deaths.popleft()
        if len(self.deaths) >= self.limit:
            return None
        return float(min(self.backoff * 2 ** (len(self.deaths) - 1), MAX_RESTART_BACKOFF))

    @property
    def recent(self) -> int:
        """Deaths within the window (as of the last one)."""
        return len(self.deaths)
