"""The requests waiting for their LoRA adapter to load (docs/lora.md, "Loading"), held by the
schedule stage so that no step waits on an adapter's files.

Where the execute stage runs on the schedule stage's host it loads adapters beside the steps
(:meth:`~stages.execute.stage.ExecuteStage.load_adapter`, on its loader thread). A request
whose adapter is loaded goes straight to the scheduler; one whose adapter is not is held
here, and the adapter's load starts (one load per adapter, however many requests wait for
it). When it ends, each request still held goes on to the scheduler, or, when the adapter
cannot be served, is refused alone with the load's error. An aborted request is dropped
from the hold; its load goes on for the others (and the next request of the adapter).

Where execute runs elsewhere nothing is held: the runner reads the adapter on its step
thread when the request first runs (:meth:`~stages.execute.lora.LoRABank.acquire`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from stages.lora import LoRAAdapterError, LoRARequest
from stages.messages import EngineRequest

__all__ = ["AdapterLoads"]

#: loads an adapter: None once loaded, or the error of one that cannot be served
LoadAdapter = Callable[[LoRARequest], Awaitable[LoRAAdapterError | None]]
#: what happens to a held request when its adapter's load ends (None: loaded)
Release = Callable[[EngineRequest, LoRAAdapterError | None], Awaitable[None]]


class AdapterLoads:
    """The held requests and their adapters' loads (see the module docstring).

    Args:
        ready: whether an adapter is loaded now (execute's ``adapter_ready``).
        load: loads one (execute's ``load_adapter``).
        release: takes a request in, or refuses it, once its adapter's load ended.
        spawn: runs a load in the background (the schedule stage's ``spawn``).
    """

    def __init__(
        self,
        ready: Callable[[LoRARequest], bool],
        load: LoadAdapter,
        release: Release,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._ready = ready
        self._load = load
        self._release = release
        self._spawn = spawn
        self._held: dict[str, EngineRequest] = {}
        self._loading: dict[LoRARequest, list[str]] = {}  # adapter -> its held request ids

    @property
    def pending(self) -> bool:
        """Whether a load is running or a request is held."""
        return bool(self._loading or self._held)

    def holds(self, request: EngineRequest) -> bool:
        """Hold ``request`` if its adapter is not loaded (its load is then started or
        already running). Returns whether it was held: otherwise it may be scheduled."""
        lora = request.lora
        if lora is None or (lora not in self._loading and self._ready(lora)):
            return False
        self._held[request.request_id] = request
        waiting = self._loading.get(lora)
        if waiting is not None:
            waiting.append(request.request_id)
            return True
        self._loading[lora] = [request.request_id]
        self._spawn(self._run(lora))
        return True

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted). Returns whether it was held."""
        return self._held.pop(request_id, None) is not None

    async def _run(self, lora: LoRARequest) -> None:
        """Load ``lora``, then release every request of it still held (in arrival order)."""
        error = await self._load(lora)
        request_ids = self._loading.pop(lora, [])
        for request_id in request_ids:
            request = self._held.pop(request_id, None)
            if request is not None:
                await self._release(request, error)
