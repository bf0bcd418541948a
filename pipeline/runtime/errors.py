"""Errors raised by the runtime.

When a pipeline fails (a stage raises, a host process dies, a link loses its peer), every
pending call and every waiting receiver gets the same :class:`PipelineError` subclass, within
a bounded time; nothing hangs.
"""

from __future__ import annotations

from typing import Any

from transports.errors import PeerLostError

__all__ = [
    "CallOverflowError",
    "DeadlockError",
    "GraphError",
    "HostDiedError",
    "HostUnresponsiveError",
    "PeerLostError",
    "PipelineClosedError",
    "PipelineError",
    "StageFailedError",
    "UnhandledMessageError",
]


def _restore(cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class PipelineError(Exception):
    """Base class of runtime errors.

    NOTE: they pickle whatever their ``__init__`` takes (an error raised in a benchmark's
    worker process reaches its parent through pickle, which by default calls
    ``cls(*self.args)``): the message and attributes are restored without calling it.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.args, self.__dict__))


class GraphError(PipelineError, ValueError):
    """The pipeline graph is invalid: an unknown stage or port, a duplicate name, ..."""


class PipelineClosedError(PipelineError):
    """The pipeline is stopping or stopped; it accepts no more messages."""


class StageFailedError(PipelineError):
    """A stage raised; the pipeline failed. In the same process the original exception is
    ``__cause__``; from another process ``remote_type`` and ``remote_traceback`` describe it."""

    def __init__(
        self,
        stage: str,
        host: str,
        error_type: str,
        message: str,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(f"stage {stage!r} on host {host!r} raised {error_type}: {message}")
        self.stage = stage
        self.host = host
        self.remote_type = error_type
        self.remote_message = message
        self.remote_traceback = remote_traceback


class DeadlockError(PipelineError):
    """Stages of one host wait on each other in a cycle: each one's handler waits to send
    into the next one's full mailbox, so none can drain its own and nothing moves again.
    ``stages`` is the cycle in order (each waits on the next, the last on the first) and
    ``capacities`` their mailbox bounds. Cycles through other hosts are not detected."""

    def __init__(self, host: str, stages: tuple[str, ...], capacities: tuple[int, ...]) -> None:
        path = " -> ".join((*stages, stages[0])) if stages else "(none)"
        bounds = sorted(set(capacities))
        capacity = (
            f"capacity {bounds[0]}"
            if len(bounds) == 1
            else "capacities " + ", ".join(f"{s} {c}" for s, c in zip(stages, capacities))
        )
        super().__init__(
            f"deadlock on host {host!r}: {path}: each stage waits to send into the next "
            f"one's full mailbox ({capacity}), so none can drain its own. Bound the messages "
            "in flight around a cycle (e.g. a window of credits sent back from the end of the "
            "cycle to its start) so that they always fit in its mailboxes"
        )
        self.host = host
        self.stages = stages
        self.capacities = capacities


class HostDiedError(PipelineError):
    """A host process exited (killed, crashed) while the pipeline was running."""

    def __init__(self, host: str, exitcode: int | None, detail: str = "") -> None:
        how = f"exit code {exitcode}" if exitcode is not None else "unknown exit"
        if exitcode is not None and exitcode < 0:
            how = f"killed by signal {-exitcode}"
        text = f"host {host!r} died ({how})"
        super().__init__(f"{text}: {detail}" if detail else text)
        self.host = host
        self.exitcode = exitcode


class HostUnresponsiveError(HostDiedError):
    """A host process stopped answering while the pipeline was running: its links fell
    silent past the heartbeat timeout (the process is frozen, e.g. SIGSTOP, or its event
    loop is blocked). The controller then ends it like a dead host. ``seconds``: how long it
    had been silent when it was given up on (None: not known)."""

    def __init__(self, host: str, detail: str = "", *, seconds: float | None = None) -> None:
        super().__init__(host, None, detail)
        self.seconds = seconds
        text = (
            f"host {host!r} is unresponsive"
            if seconds is None
            else f"host {host!r} has been unresponsive for {seconds:g} s"
        )
        self.args = (f"{text}: {detail}" if detail else text,)


class UnhandledMessageError(PipelineError, TypeError):
    """A stage received a message type it has no handler for."""


class CallOverflowError(PipelineError):
    """A call's answers arrived faster than its caller read them, past the
    :class:`~pipeline.runtime.caller.Caller`'s per-call capacity; only that call fails."""
