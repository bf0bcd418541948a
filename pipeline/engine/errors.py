"""Errors of the LLM engine (the runtime's own errors are in :mod:`pipeline.runtime.errors`)."""

from __future__ import annotations

from pipeline.runtime.errors import HostDiedError

__all__ = ["EngineDeadError"]


class EngineDeadError(HostDiedError):
    """The LLM engine stopped working; raised to every pending request of the LLM API.

    Usually its host died (``exitcode`` says how); with ``failed=True`` the host lives but a
    stage on it raised (``detail`` says which), which ends the engine just the same.
    """

    def __init__(
        self, host: str, exitcode: int | None, detail: str = "", *, failed: bool = False
    ) -> None:
        super().__init__(host, exitcode, detail)
        if failed:
            self.args = (f"the engine failed: {detail}" if detail else "the engine failed",)
