"""The router stage: the front of N engine replicas, with data parallelism.

Each request from tokenize goes to one replica (its admit stage), chosen by a routing policy
(a plugin of ``actorline.routers``, :mod:`stages.router`; ``least-loaded`` by default) from
what the router knows of each live replica: the tokens its requests have left. Everything
the replicas send back (step outputs, rejections) passes through the router on its way to
detokenize, which is how it knows what each replica holds; an abort goes only to the
replica holding the request (its schedule stage). The replicas' EngineInfo is passed on once,
when every replica has loaded.

A replica that is restored (``restart_engine``) is routed to again once its fresh hosts have
started (:meth:`RouterStage.on_replica_restored`).

A replica that fails is cut off by the runtime (``docs/architecture.md`` §8, and
:mod:`pipeline.runtime.replicas`), which then tells this stage
(:meth:`RouterStage.on_replica_lost`): its requests that had streamed output end with a
``RequestRejected`` of kind :data:`~stages.errors.ENGINE_DEAD` (the API raises
``EngineDeadError`` for them), those that had none yet go to the replicas that remain, as if
they had just arrived, and it takes no more requests. The others go on.

Ports: ``in`` (EngineRequest), ``abort`` (AbortRequests, from the API and stop-check),
``outputs`` (EngineOutputs and RequestRejected from the replicas), ``info`` (EngineInfo from
each replica's execute stage); ``requests`` (to every replica's admit stage, each request to
one), ``aborts`` (to every replica's schedule stage, each abort to the one holding it),
``out`` (to detokenize), ``info`` (EngineInfo, once).

With LoRA adapters (docs/lora.md) the router keeps, per replica, the adapters it sent it
last (at most ``max_cpu_loras``, as the replica keeps them loaded) and passes them to the
policy in each :class:`ReplicaLoad`, whose adapter affinity then prefers a replica that has
the request's adapter loaded.

A request the router fails on (the policy raised, or the link to the chosen replica cannot
carry it: an ``EncodeError``) fails alone (``docs/architecture.md`` §7.2): what the router
recorded of it is undone, as if it had never come, and a :class:`RequestRejected` goes on to
detokenize; the other requests go on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Collection
from typing import Any, ClassVar

from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored
from pipeline.runtime.stage import Stage, handles
from stages.early_aborts import EarlyAborts
from stages.errors import ENGINE_DEAD
from stages.messages import (
    AbortRequests,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    RequestRejected,
)
from stages.recovery import rejection, request_id_of
from stages.router import ReplicaLoad, RouteRequest, RoutingPolicy, block_hashes, load_router

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "RECENT_ROUTES",
    "ReplicaRoute",
    "RouterConfig",
    "RouterStage",
]

logger = logging.getLogger("actorline.router")

#: what a request without ``max_tokens`` is assumed to generate, before the model's length
#: is known (it counts toward its replica's load)
DEFAULT_MAX_TOKENS = 256
#: how many recent routing decisions the router remembers (:attr:`RouterStage.recent`)
RECENT_ROUTES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaRoute:
    """Replica ``name``: the stage its requests go to (``admit``) and the one its aborts go
    to (``schedule``)."""

    name: str
    admit: str
    schedule: str


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    """``replicas``: the engine replicas, named as in the pipeline's replica set
    ``replica_set``. ``policy``: a name in ``actorline.routers``. Prefix affinity hashes the
    first ``affinity_blocks`` KV blocks of ``block_size`` tokens. ``max_loras`` and
    ``max_cpu_loras``: the replicas' (the adapters each keeps loaded, ``max_cpu_loras`` or
    else ``max_loras``).

    Raises:
        ValueError: no replica, a replica named twice, or a size below 1.
    """

    replicas: tuple[ReplicaRoute, ...]
    policy: str = "least-loaded"
    replica_set: str = "engines"
    block_size: int = 16
    affinity_blocks: int = 4
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        names = [replica.name for replica in self.replicas]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"replicas must be distinct and at least one, got {names}")
        for field in ("block_size", "affinity_blocks", "max_loras"):
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(slots=True)
class _Routed:
    """A request the router sent to ``replica``: ``left`` tokens to go (its prompt until
    its first token arrives, plus what it may still generate); ``request`` itself until its
    first output, so a replica lost before that can be replaced by another."""

    replica: str
    left: int
    prompt: int
    request: EngineRequest | None
    started: bool = False


class RouterStage(Stage):
    inputs: ClassVar[tuple[str, ...]] = ("in", "abort", "outputs", "info")
    outputs: ClassVar[tuple[str, ...]] = ("requests", "aborts", "out", "info")

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.policy: RoutingPolicy | None = None
        self._live: dict[str, ReplicaRoute] = {route.name: route for route in config.replicas}
        self._routed: dict[str, _Routed] = {}
        self._outstanding: dict[str, int] = dict.fromkeys(self._live, 0)
        self._held: dict[str, int] = dict.fromkeys(self._live, 0)
        #: per replica, the adapters it was sent last, least recently first
        self._adapters: dict[str, collections.OrderedDict[str, None]] = {
            name: collections.OrderedDict() for name in self._live
        }
        self._early_aborts = EarlyAborts()
        self._infos = 0
        self._max_model_len: int | None = None
        #: requests sent to each replica since the start
        self.routed: collections.Counter[str] = collections.Counter()
        #: requests sent again, to another replica, because theirs was lost before they started
        self.rerouted = 0
        #: the latest routing decisions, (request id, replica), oldest first
        self.recent: collections.deque[tuple[str, str]] = collections.deque(maxlen=RECENT_ROUTES)

    async def start(self) -> None:
        # NOTE: a policy plugin that is missing, broken or invalid fails start-up loudly.
        self.policy = load_router(self.config.policy)

    @property
    def live_replicas(self) -> tuple[str, ...]:
        """The replicas requests are routed to."""
        return tuple(self._live)

    def load(self, replica: str) -> ReplicaLoad:
        """What the router counts against live replica ``replica``."""
        adapters = frozenset(self._adapters[replica])
        return ReplicaLoad(replica, self._outstanding[replica], self._held[replica], adapters)

    @handles(EngineInfo)
    async def on_info(self, info: EngineInfo) -> None:
        self._max_model_len = info.max_model_len
        self._infos += 1
        if self._infos == len(self.config.replicas):  # every replica has loaded
            await self.emit("info", info)

    @handles(EngineRequest)
    async def on_request(self, request: EngineRequest) -> None:
        assert self.policy is not None
        request_id = request.request_id
        if self._early_aborts.take(request_id):
            return  # aborted before it got here
        await self._route(request)

    def route_request(self, request: EngineRequest) -> RouteRequest:
        """What the routing policy reads of ``request``."""
        prompt = request.prompt_token_ids
        adapter = request.lora.lora_name if request.lora is not None else ""
        config = self.config
        return RouteRequest(
            request.request_id,
            request.tenant,
            len(prompt),
            block_hashes(prompt, config.block_size, config.affinity_blocks, adapter),
            adapter,
        )

    async def _route(self, request: EngineRequest, among: Collection[str] | None = None) -> None:
        """Send ``request`` to the live replica the policy picks (among the live replicas
        named in ``among``, when given: disaggregated prefill and decode's decode engines,
        stages/disaggregate.py), and count it there."""
        assert self.policy is not None
        request_id = request.request_id
        if not self._live:
            await self.emit(
                "out", RequestRejected(request_id, ENGINE_DEAD, "no engine replica is alive")
            )
            return
        prompt = request.prompt_token_ids
        names = list(self._live) if among is None else [n for n in among if n in self._live]
        route_request = self.route_request(request)
        adapter = route_request.adapter
        name = self.policy.choose(route_request, [self.load(n) for n in names])
        route = self._live.get(name)
        if route is None:
            raise RuntimeError(
                f"routing policy {self.config.policy!r} chose {name!r}, which is not one of "
                f"the live replicas {sorted(self._live)}"
            )
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            room = (self._max_model_len or 0) - len(prompt)
            max_tokens = room if room > 0 else DEFAULT_MAX_TOKENS
        routed = _Routed(name, len(prompt) + max_tokens, len(prompt), request)
        self._routed[request_id] = routed
        self._outstanding[name] += routed.left
        self._held[name] += 1
        self.routed[name] += 1
        self.recent.append((request_id, name))
        if adapter:
            self.record_adapter(name, adapter)
        await self.emit("requests", request, to=route.admit)

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A request this stage failed on (the policy raised, or its send to the chosen
        replica failed: a value the link cannot carry) is answered with a typed error, and
        what :meth:`_route` recorded of it is undone (its replica's load, the counts, the
        latest decision), so the books are as if it had never come. It reached no replica,
        so nothing is aborted. (A policy's own memory, prefix affinity say, is a hint, not
        a count: it stays.) Failures on the other messages (outputs, rejections and aborts
        passing through) are this stage's own."""
        request_id = request_id_of(message)
        if port != "in" or request_id is None:
            return False
        routed = self._routed.get(request_id)
        if routed is not None and routed.request is message:
            self._forget(request_id)
            self.routed[routed.replica] -= 1
            if not self.routed[routed.replica]:
                del self.routed[routed.replica]
            if self.recent and self.recent[-1] == (request_id, routed.replica):
                self.recent.pop()
        await self.emit("out", rejection(self.name, request_id, error))
        return True

    @handles(EngineOutputs)
    async def on_outputs(self, outputs: EngineOutputs) -> None:
        routed_of = self._routed
        for index, request_id in enumerate(outputs.request_ids):
            routed = routed_of.get(request_id)
            if routed is None:
                continue
            if outputs.finish_reasons[index] is not None:
                self._forget(request_id)
                continue
            spent = len(outputs.new_token_ids[index])
            if not routed.started:
                routed.started = True
                routed.request = None
                spent += routed.prompt
            spent = min(spent, routed.left)
            routed.left -= spent
            self._outstanding[routed.replica] -= spent
        await self.emit("out", outputs)

    @handles(RequestRejected)
    async def on_rejected(self, rejected: RequestRejected) -> None:
        self._forget(rejected.request_id)
        await self.emit("out", rejected)

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        by_replica: dict[str, list[str]] = {}
        for request_id in abort.request_ids:
            routed = self._forget(request_id)
            if routed is None:
                self._early_aborts.add(request_id)
            elif routed.replica in self._live:
                by_replica.setdefault(routed.replica, []).append(request_id)
        for name, request_ids in by_replica.items():
            schedule = self._live[name].schedule
            await self.emit("aborts", AbortRequests(tuple(request_ids)), to=schedule)

    async def on_replica_lost(self, lost: ReplicaLost) -> None:
        if lost.replica_set != self.config.replica_set or lost.replica not in self._live:
            return
        assert self.policy is not None
        del self._live[lost.replica]
        self.policy.forget_replica(lost.replica)
        stranded = [rid for rid, routed in self._routed.items() if routed.replica == lost.replica]
        # NOTE: a request that had no output yet lost nothing the caller saw: it goes to
        # another replica (the lost one is cut off, so it can answer nothing more). One that
        # had streamed tokens fails: its output so far came from the replica that died.
        unstarted = [self._routed[rid].request for rid in stranded]
        moved = [request for request in unstarted if request is not None] if self._live else []
        logger.error(
            "engine replica %s failed (%s); %d of its requests fail, %d that had not started "
            "go to the %d replicas that remain",
            lost.replica,
            lost.message,
            len(stranded) - len(moved),
            len(moved),
            len(self._live),
        )
        moved_ids = {request.request_id for request in moved}
        for request in moved:
            self._forget(request.request_id)
            self.rerouted += 1
            await self._route(request)
        for request_id in stranded:
            if request_id in moved_ids:
                continue
            self._forget(request_id)
            await self.emit(
                "out",
                RequestRejected(
                    request_id,
                    ENGINE_DEAD,
                    f"engine replica {lost.replica} failed while it ran this request: "
                    f"{lost.message}",
                ),
            )

    async def on_replica_restored(self, restored: ReplicaRestored) -> None:
        """A lost replica runs again (``restart_engine``, docs/architecture.md §4.7): route
        to it again, from an empty load. A policy with the optional hook
        ``restore_replica(name)`` is told (the protocol needs no more: :meth:`RoutingPolicy.choose`
        is given the live replicas each time)."""
        if restored.replica_set != self.config.replica_set or restored.replica in self._live:
            return
        route = next((r for r in self.config.replicas if r.name == restored.replica), None)
        if route is None:
            return
        self._live[route.name] = route
        self._outstanding[route.name] = 0
        self._held[route.name] = 0
        self._adapters[route.name] = collections.OrderedDict()  # a fresh engine loaded none
        hook = getattr(self.policy, "restore_replica", None)
        if callable(hook):
            hook(route.name)
        logger.warning(
            "engine replica %s runs again; routing to %d replicas", route.name, len(self._live)
        )

    def record_adapter(self, replica: str, adapter: str) -> None:
        """``replica`` loads ``adapter`` (if it has not), its least recently used past
        what it keeps loaded going."""
        kept = self._adapters[replica]
        kept[adapter] = None
        kept.move_to_end(adapter)
        capacity = self.config.max_cpu_loras or self.config.max_loras
        while len(kept) > capacity:
            kept.popitem(last=False)

    def _forget(self, request_id: str) -> _Routed | None:
        """Drop ``request_id`` from the books (its replica's load with it)."""
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self._outstanding[routed.replica] -= routed.left
            self._held[routed.replica] -= 1
        return routed
