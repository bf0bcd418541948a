"""Errors of the LLM engine (the runtime's own errors are in :mod:`pipeline.runtime.errors`)."""

from __future__ import annotations

from pipeline.runtime.errors import HostDiedError

__all__ = ["EngineCrashLoopError", "EngineDeadError", "WrongEventLoopError"]


class EngineDeadError(HostDiedError):
    """The LLM engine stopped working; raised to every pending request of the LLM API.

    Usually its host died (``exitcode`` says how); with ``failed=True`` the host lives but a
    stage on it raised (``detail`` says which), which ends the engine just the same. With
    ``unresponsive_for`` its host lives but stopped answering (frozen, e.g. SIGSTOP, or its
    event loop blocked) for that many seconds (``unresponsive``: for a time not known), and
    was ended.
    """

    def __init__(
        self,
        host: str,
        exitcode: int | None,
        detail: str = "",
        *,
        failed: bool = False,
        unresponsive: bool = False,
        unresponsive_for: float | None = None,
    ) -> None:
        super().__init__(host, exitcode, detail)
        self.unresponsive = unresponsive or unresponsive_for is not None
        self.unresponsive_for = unresponsive_for
        if failed:
            self.args = (f"the engine failed: {detail}" if detail else "the engine failed",)
        elif self.unresponsive:
            text = (
                f"host {host!r} is unresponsive"
                if unresponsive_for is None
                else f"host {host!r} has been unresponsive for {unresponsive_for:g} s"
            )
            self.args = (f"{text}: {detail}" if detail else text,)

    @classmethod
    def replica_lost(cls, detail: str, host: str = "engine") -> EngineDeadError:
        """The error of one request whose engine replica died (data parallelism), while the
        other replicas go on serving; ``detail`` says which replica and why."""
        error = cls(host, None, detail)
        error.args = (detail,)
        return error


class EngineCrashLoopError(EngineDeadError):
    """The engine died ``deaths`` times within ``window`` seconds, the limit of its restarts
    (``restart_limit`` in ``restart_window``): it is not restarted again. ``last`` is the
    last death's message."""

    def __init__(self, deaths: int, window: float, last: str, host: str = "engine") -> None:
        super().__init__(host, None)
        self.deaths = deaths
        self.window = window
        self.last = last
        self.args = (
            f"the engine died {deaths} times within {window:g} s (restart_limit "
            f"{deaths} in restart_window {window:g} s); not restarting it again; the last "
            f"death: {last}",
        )


class WrongEventLoopError(RuntimeError):
    """An :class:`~pipeline.engine.async_engine.AsyncEngine` is bound to the event loop it
    started on: ``generate`` and ``abort`` called from another loop (another thread's) raise
    this at once instead of waiting on futures that loop never runs."""
