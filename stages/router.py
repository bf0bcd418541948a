"""Routing policies: which engine replica serves a request, with data parallelism.

A policy is a plugin of the ``actorline.routers`` entry-point group (protocol version 1,
checked by :mod:`plugins`). The router stage (:mod:`stages.route`) keeps the bookkeeping
(what each replica holds, what it has left to compute) and asks the policy one question,
:meth:`RoutingPolicy.choose`, with a :class:`RouteRequest` and the live replicas'
:class:`ReplicaLoad`; it tells the policy when a replica is gone
(:meth:`RoutingPolicy.forget_replica`). A replica that comes back (restarted with
``restart_engine``) is simply among the live replicas ``choose`` is given again; a policy
that keeps per-replica state may define the optional ``restore_replica(name)``, which the
router calls then (optional, so protocol version 1 is unchanged).

Built in:

- ``least-loaded`` (the default): the replica with the fewest outstanding tokens (prompt
  tokens not yet computed plus tokens still to generate), with **prefix affinity**: a request
  whose leading KV blocks hash like an earlier request's goes where that one went, so prefix
  caching keeps working across replicas, unless that replica is too far ahead of the least
  loaded one (then the load wins). After SGLang's cache-aware router
  (``sgl-router/src/policies/cache_aware.rs``: a prefix match picks the worker unless the load
  imbalance passes its absolute and relative thresholds), with the prefix tree reduced to the
  chained hashes of the first few KV blocks; and **adapter affinity** (docs/lora.md): a
  request of a LoRA adapter goes to the least loaded replica that holds that adapter loaded
  (each replica loads an adapter the first time one of its requests uses it), under the same
  balance rule, so an adapter is loaded on as few replicas as the load allows. A request's
  block hashes start from its adapter's name, so its prefix affinity only ever points at a
  replica whose cache holds that prefix under the same adapter (prefix caching is keyed by
  adapter).
- ``round-robin``: replicas in turn (a baseline).

Everything here is pure Python (no asyncio, zmq, grpc or torch).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

from plugins import ROUTERS, PluginError, load_instance

__all__ = [
    "AFFINITY_ENTRIES",
    "API_VERSION",
    "BALANCE_RATIO",
    "BALANCE_TOKENS",
    "LeastLoadedPolicy",
    "ReplicaLoad",
    "RoundRobinPolicy",
    "RouteRequest",
    "RouterConstructionError",
    "RoutingPolicy",
    "block_hashes",
    "load_router",
]

API_VERSION = 1
#: prefixes (chained block hashes) the least-loaded policy remembers, oldest forgotten first
AFFINITY_ENTRIES = 65536
#: prefix affinity yields to the load once the matched replica has more than
#: ``BALANCE_RATIO`` times the least loaded one's outstanding tokens plus ``BALANCE_TOKENS``
BALANCE_RATIO = 2.0
BALANCE_TOKENS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may read about a request: its id, tenant, prompt length, the
    chained hashes of its first full KV blocks (``block_hashes[i]`` covers blocks 0..i), and
    its LoRA adapter's name (``""``: the base model)."""

    request_id: str
    tenant: str
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    adapter: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A live replica: its name, the tokens its requests have left (``outstanding_tokens``),
    how many requests it holds, and the LoRA adapters the router sent it last (those it
    keeps loaded, as far as the router can tell: at most its ``max_cpu_loras``)."""

    name: str
    outstanding_tokens: int
    num_requests: int
    adapters: frozenset[str] = frozenset()


@runtime_checkable
class RoutingPolicy(Protocol):
    """The protocol of an ``actorline.routers`` plugin (constructed with no arguments)."""

    api_version: ClassVar[int]
    name: ClassVar[str]

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> str:
        """The name of the replica (one of ``replicas``, never empty) to serve ``request``."""
        ...

    def forget_replica(self, name: str) -> None:
        """Replica ``name`` is gone for good: drop what the policy keeps about it."""
        ...


def block_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int, adapter: str = ""
) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full blocks of ``token_ids`` (a request
    shorter than one block has none), from its LoRA ``adapter``'s name (``""``: the base
    model). Equal prompts prefixes under one adapter give equal leading hashes."""
    hashes: list[int] = []
    previous = hash(("lora", adapter)) if adapter else 0
    for index in range(min(len(token_ids) // block_size, max_blocks)):
        block = tuple(token_ids[index * block_size : (index + 1) * block_size])
        previous = hash((previous, block))
        hashes.append(previous)
    return tuple(hashes)


def _least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    return min(replicas, key=lambda r: (r.outstanding_tokens, r.num_requests, r.name))


class LeastLoadedPolicy:
    """Fewest outstanding tokens, with prefix affinity (see the module docstring)."""

    api_version: ClassVar[int] = API_VERSION
    name: ClassVar[str] = "least-loaded"

    def __init__(
        self,
        *,
        balance_ratio: float = BALANCE_RATIO,
        balance_tokens: int = BALANCE_TOKENS,
        capacity: int = AFFINITY_ENTRIES,
    ) -> None:
        if balance_ratio < 1 or balance_tokens < 0 or capacity < 1:
            raise ValueError("balance_ratio >= 1, balance_tokens >= 0 and capacity >= 1")
        self.balance_ratio = balance_ratio
        self.balance_tokens = balance_tokens
        self._capacity = capacity
        self._owners: collections.OrderedDict[int, str] = collections.OrderedDict()
        #: how many routings prefix affinity decided (for tests and statistics)
        self.affinity_hits = 0
        #: how many routings adapter affinity decided (prefix affinity may then refine them)
        self.adapter_hits = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> str:
        by_name = {replica.name: replica for replica in replicas}
        least = _least_loaded(replicas)
        limit = self.balance_ratio * least.outstanding_tokens + self.balance_tokens
        chosen = least
        if request.adapter:
            holders = [replica for replica in replicas if request.adapter in replica.adapters]
            if holders and (holder := _least_loaded(holders)).outstanding_tokens <= limit:
                chosen = holder
                self.adapter_hits += 1
        for prefix in reversed(request.block_hashes):  # the longest shared prefix first
            owner = by_name.get(self._owners.get(prefix, ""))
            if owner is None:
                continue
            if owner.outstanding_tokens <= limit:
                chosen = owner
                self.affinity_hits += 1
            break
        for prefix in request.block_hashes:
            self._owners[prefix] = chosen.name
            self._owners.move_to_end(prefix)
        while len(self._owners) > self._capacity:
            self._owners.popitem(last=False)
        return chosen.name

    @property
    def remembered(self) -> int:
        """How many prefixes the policy remembers an owner for."""
        return len(self._owners)

    def forget_replica(self, name: str) -> None:
        self._owners = collections.OrderedDict(
            (prefix, owner) for prefix, owner in self._owners.items() if owner != name
        )


class RoundRobinPolicy:
    """The live replicas in turn, whatever their load."""

    api_version: ClassVar[int] = API_VERSION
    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> str:
        names = sorted(replica.name for replica in replicas)
        self._turn += 1
        return names[(self._turn - 1) % len(names)]

    def forget_replica(self, name: str) -> None:
        pass


class RouterConstructionError(PluginError):
    """A routing policy plugin's constructor raised, or its instance has no string name."""


def load_router(name: str) -> RoutingPolicy:
    """Load the ``actorline.routers`` plugin ``name`` and construct it (no arguments).

    Raises:
        plugins.PluginNotFoundError: no such policy (the message lists the installed ones).
        plugins.PluginLoadError: its entry point failed to import.
        plugins.PluginProtocolError: it lacks a method or attribute of the protocol.
        RouterConstructionError: its constructor raised, or its ``name`` is not a string.
    """
    policy: RoutingPolicy = load_instance(ROUTERS, name, RouterConstructionError)
    return policy
