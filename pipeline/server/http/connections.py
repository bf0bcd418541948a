"""Bounded HTTP connections: uvicorn's h11 protocol with a cap on open connections and
deadlines for a request's head and body (uvicorn has neither: an idle or trickling connection
is held forever), and a loop exception handler that turns the accept loop's out-of-descriptors
errors into one log line per interval.

Each connection is in one phase, with its own deadline:

- **head**: from the connection's opening, or from the first byte of its next request, to the
  end of the request head: ``header_timeout`` (nginx's ``client_header_timeout``);
- **body**: from the end of the head to the end of the body: ``body_timeout``;
- **busy**: the app answers; no deadline (a generation takes as long as it takes);
- **idle**: between requests, under uvicorn's keep-alive timer (``keep_alive_timeout``).

A connection past its deadline is closed (a request whose body was cut short sees a
disconnect). At the cap, a new connection makes room by closing the connection that has
waited longest for a request (head or idle phase: no request of it is lost); when every
connection is busy or sending a body, the new one is closed at once. So idle and trickling
connections cannot lock out a client that sends its request.

NOTE: hooks on uvicorn's :class:`~uvicorn.protocols.http.h11_impl.H11Protocol` (uvicorn
0.55): ``connection_made``/``connection_lost``, ``data_received`` (which runs
``handle_events``) and ``on_response_complete``, reading its ``cycle`` (the request being
answered: ``response_complete``, ``more_body``) and ``timeout_keep_alive_task``.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.server.limits import ListenerLimits

__all__ = ["ConnectionGuard", "RateLimitedLog", "guarded_protocol", "quiet_accept_errors"]

logger = logging.getLogger("actorline.server.http")

#: seconds between two log lines about the same kind of refusal
LOG_INTERVAL = 10.0
#: the message asyncio's accept loop passes to the exception handler when accept() fails for
#: want of descriptors or memory (Lib/asyncio/selector_events.py, _accept_connection)
_ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"


class RateLimitedLog:
    """A WARNING at most once per ``interval`` seconds, with how many were held back."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        suffix = f" ({held} more since the last such line)" if held else ""
        logger.warning(message + suffix, *args)


class _Phase(enum.Enum):
    HEAD = "head"
    BODY = "body"
    BUSY = "busy"
    IDLE = "idle"


class ConnectionGuard:
    """The connections of one HTTP server: at most ``cap`` open, each closed past its phase's
    deadline (see the module docstring)."""

    def __init__(self, limits: ListenerLimits, cap: int) -> None:
        self.limits = limits
        self.cap = cap
        self.open: set[_GuardedH11] = set()
        # connections waiting for a request (head or idle phase), the longest-waiting first
        self.waiting: collections.OrderedDict[_GuardedH11, None] = collections.OrderedDict()
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0
        self._full_log = RateLimitedLog()
        self._timeout_log = RateLimitedLog()

    def admit(self, connection: _GuardedH11) -> bool:
        """Count a new connection in, closing the longest-waiting one at the cap; False when
        every open connection has a request running (then the new one is to be closed)."""
        if len(self.open) >= self.cap:
            if not self.waiting:
                self.refused += 1
                self._full_log.warning(
                    "HTTP connections at the cap (%d, --max-connections), every one with a "
                    "request running: refusing new connections",
                    self.cap,
                )
                return False
            oldest = next(iter(self.waiting))
            self.evicted += 1
            self._full_log.warning(
                "HTTP connections at the cap (%d, --max-connections): closing the ones that "
                "waited longest for a request",
                self.cap,
            )
            oldest.close_quietly()
        self.open.add(connection)
        return True

    def forget(self, connection: _GuardedH11) -> None:
        self.open.discard(connection)
        self.waiting.pop(connection, None)

    def note_timeout(self, phase: str, seconds: float) -> None:
        self.timed_out += 1
        self._timeout_log.warning(
            "closed an HTTP connection whose request %s took over %g s", phase, seconds
        )


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol under a :class:`ConnectionGuard` (set on the subclass that
    :func:`guarded_protocol` makes)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: _Phase | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._closed = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            self.close_quietly()
            return
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._disarm()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def close_quietly(self) -> None:
        """Close the connection (a request still reading its body sees a disconnect)."""
        self._closed = True
        self._disarm()
        self.guard.forget(self)
        if not self.transport.is_closing():
            self.transport.close()

    def _update(self) -> None:
        """Move to the phase the connection is in now, arming that phase's deadline."""
        if self._closed or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            phase = _Phase.IDLE if self.timeout_keep_alive_task is not None else _Phase.HEAD
        elif cycle.more_body:
            phase = _Phase.BODY
        else:
            phase = _Phase.BUSY
        if phase is self._phase:
            return
        self._phase = phase
        self._disarm()
        if phase in (_Phase.HEAD, _Phase.IDLE):
            self.guard.waiting[self] = None
            self.guard.waiting.move_to_end(self)
        else:
            self.guard.waiting.pop(self, None)
        limits = self.guard.limits
        seconds = {_Phase.HEAD: limits.header_timeout, _Phase.BODY: limits.body_timeout}.get(phase)
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, phase: _Phase, seconds: float) -> None:
        self._deadline = None
        if self._phase is phase and not self._closed:
            self.guard.note_timeout(phase.value, seconds)
            self.close_quietly()


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: h11 under ``guard``."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"guard": guard})


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` log accept() failing for want of descriptors (or memory) as one WARNING
    line per :data:`LOG_INTERVAL`, without a traceback; everything else goes to the handler
    it had. (asyncio calls the handler for each failed accept, up to the listen backlog of
    them per loop turn: thousands of tracebacks a second once descriptors run out.)
    Idempotent."""
    previous = loop.get_exception_handler()
    if getattr(previous, "_actorline_quiet_accept", False):
        return
    log = RateLimitedLog()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if context.get("message") == _ACCEPT_OUT_OF_RESOURCES:
            log.warning(
                "cannot accept connections: %s; retrying (raise `ulimit -n` or lower "
                "--max-connections)",
                error,
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handle._actorline_quiet_accept = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handle)
