"""The router of disaggregated prefill and decode: P prefill engines and D decode engines
behind one router stage (docs/parallelism.md, "Disaggregated prefill and decode").

A new request's two ends are chosen when it arrives: a prefill engine among the live prefill
engines and a decode engine among the live decode engines, each by the routing policy (least
loaded, prefix affinity). The request goes first to the prefill engine, as a request of its
own (``<id>@prefill``) that generates one token, greedily, and nothing else, and that names
the decode engine's execute stage (``EngineRequest.kv_to``). That engine's execute stage
(``ExecuteConfig.kv_export``) sends the K/V of the prompt's full blocks straight there
(:class:`~stages.kv_transfer.KvBlocks`, as the codec's zero-copy frames, over a link between
the two engines: one hop) in the step that computed them; its one token is dropped here. The
decode engine holds the blocks and tells the router (:class:`~stages.kv_transfer.KvArrived`,
on the ``kv`` port: a few bytes, counted as the transfer), which then sends it the request,
whole and unchanged but for ``kv_from``. Its execute stage joins the request with its blocks
and imports them into its prefix cache before planning the request's first chunk
(:mod:`stages.execute.kv_links`, :mod:`stages.execute.kv_blocks`): the request's
prefix-cache lookup hits them, and the decode engine computes the rest of the prompt (less
than one block: the tail) and everything after, with the request's own sampling, grammar and
stops. So the output is the output of one engine by construction; the tail's recompute is
what this design pays. The router's process never holds the K/V.

Failures stay with their request. A transfer that is late (its prefill finished
``transfer_timeout`` seconds ago without it, or its prefill engine ran no step for that long:
a busy prefill engine that keeps stepping keeps its queue), a prefill the prefill engine
refuses, the requests of a prefill engine that dies and those whose chosen decode engine dies
before their blocks came are run whole on a decode engine (counted in
:attr:`PrefillDecodeRouterStage.fallbacks`); a decode engine that dies is a lost replica as
with data parallelism (:class:`~stages.route.RouterStage`): its requests that had streamed
tokens fail with ``EngineDeadError``, the others go to an engine that lives, whole. Blocks
that reach a decode engine for a request that no longer waits for them (aborted, run whole),
or for one that was aborted or refused before its first step took them, are released there
(:class:`~stages.kv_transfer.KvRelease`; :attr:`PrefillDecodeRouterStage.released` counts
them). With no decode engine left, requests run whole on a prefill engine (it is a whole
engine); with none of either, they fail.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Collection
from typing import Any, ClassVar

from pipeline.runtime.replicas import ReplicaLost
from pipeline.runtime.stage import handles
from stages.kv_transfer import PREFILL_SUFFIX, KvArrived, KvRelease
from stages.messages import AbortRequests, EngineOutputs, EngineRequest, RequestRejected
from stages.params import SamplingParams
from stages.recovery import request_id_of
from stages.route import RECENT_ROUTES, RouterConfig, RouterStage
from stages.router import ReplicaLoad

__all__ = ["PREFILL_SUFFIX", "KvTransfer", "PrefillDecodeConfig", "PrefillDecodeRouterStage"]

logger = logging.getLogger("actorline.router")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillDecodeConfig(RouterConfig):
    """A :class:`~stages.route.RouterConfig` whose replicas named in ``prefill`` are prefill
    engines and the others decode engines; ``execute``: each replica's execute stage, in the
    order of ``replicas`` (where the prefill engines send blocks, and the router releases
    them). ``transfer_timeout``: seconds a request waits for its prompt's blocks before it
    runs whole on a decode engine.

    Raises:
        ValueError: no prefill or no decode engine, a prefill name that is no replica, not one
            execute stage per replica, or a timeout that is not a number of seconds > 0.
    """

    prefill: tuple[str, ...] = ()
    execute: tuple[str, ...] = ()
    transfer_timeout: float = 30.0

    def __post_init__(self) -> None:
        RouterConfig.__post_init__(self)
        names = [replica.name for replica in self.replicas]
        unknown = sorted(set(self.prefill) - set(names))
        if unknown:
            raise ValueError(f"prefill names {unknown}, which are not replicas ({names})")
        if not self.prefill or len(set(self.prefill)) == len(names):
            raise ValueError(
                f"prefill and decode need one engine each at least: prefill {self.prefill} "
                f"of replicas {names}"
            )
        if len(self.execute) != len(names) or not all(
            isinstance(stage, str) and stage for stage in self.execute
        ):
            raise ValueError(
                f"execute must name each replica's execute stage ({len(names)}: {names}), got "
                f"{self.execute!r}"
            )
        timeout = self.transfer_timeout
        if type(timeout) not in (int, float) or not 0 < timeout < float("inf"):
            raise ValueError(f"transfer_timeout must be a number of seconds > 0, got {timeout!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class KvTransfer:
    """One transfer: request ``request_id``'s ``num_blocks`` blocks, ``nbytes`` bytes of K/V,
    from prefill engine ``source`` straight to decode engine ``target``."""

    request_id: str
    source: str
    num_blocks: int
    nbytes: int
    target: str = ""


@dataclasses.dataclass(slots=True)
class _Prefilling:
    """A request on its prefill engine ``replica``, counted there as ``tokens`` tokens,
    its blocks on their way to decode engine ``decode`` (promised it as ``tokens`` too)."""

    request: EngineRequest
    replica: str
    tokens: int
    decode: str
    #: when its prefill's last output came (its blocks should be here by then)
    finished: float | None = None


class PrefillDecodeRouterStage(RouterStage):
    """See the module docstring. Ports: the router's (:class:`~stages.route.RouterStage`),
    ``kv`` in (:class:`~stages.kv_transfer.KvArrived` from each decode engine's execute
    stage) and ``kv_release`` out (:class:`~stages.kv_transfer.KvRelease` to them)."""

    inputs: ClassVar[tuple[str, ...]] = (*RouterStage.inputs, "kv")
    outputs: ClassVar[tuple[str, ...]] = (*RouterStage.outputs, "kv_release")

    def __init__(self, config: PrefillDecodeConfig) -> None:
        super().__init__(config)
        self._prefill_names = frozenset(config.prefill)
        #: each replica's execute stage, and back
        self._execute = dict(zip((r.name for r in config.replicas), config.execute))
        self._replica_of = {stage: name for name, stage in self._execute.items()}
        #: per decode engine, the tokens and requests whose blocks are on their way to it
        self._promised: dict[str, list[int]] = {name: [0, 0] for name in self._execute}
        #: requests sent to a decode engine whose blocks wait there for their first step
        self._parked: dict[str, str] = {}
        #: prefill id -> the request waiting for its blocks
        self._prefilling: dict[str, _Prefilling] = {}
        #: prefill ids whose prefill engine may still send outputs (dropped here)
        self._prefill_ids: set[str] = set()
        #: when each engine's latest step outputs came (time.monotonic())
        self._heard: dict[str, float] = {}
        #: transfers received, blocks and bytes moved since the start
        self.transfers = 0
        self.blocks_moved = 0
        self.bytes_moved = 0
        #: requests run whole on a decode engine (transfer timed out, refused, engine lost)
        self.fallbacks = 0
        #: moved blocks a decode engine was told to drop (no request waited for them)
        self.released = 0
        #: per decode engine, the blocks of other requests it held (requests, bytes) as the
        #: latest blocks came (what waits there: taken by a first step, or released)
        self.decode_held: dict[str, tuple[int, int]] = {}
        #: the latest transfers, oldest first
        self.recent_transfers: collections.deque[KvTransfer] = collections.deque(
            maxlen=RECENT_ROUTES
        )

    def idle(self) -> bool:
        return not self._prefilling

    def load(self, replica: str) -> ReplicaLoad:
        """The router's count, and on a decode engine the requests whose blocks are on their
        way to it (chosen, not yet sent)."""
        load = super().load(replica)
        tokens, requests = self._promised.get(replica, (0, 0))
        if not requests:
            return load
        return dataclasses.replace(
            load,
            outstanding_tokens=load.outstanding_tokens + tokens,
            num_requests=load.num_requests + requests,
        )

    def _decode_replicas(self) -> list[str]:
        return [name for name in self._live if name not in self._prefill_names]

    def _prefill_replicas(self) -> list[str]:
        return [name for name in self._live if name in self._prefill_names]

    async def _route(self, request: EngineRequest, among: Collection[str] | None = None) -> None:
        """A new request goes to a prefill engine; one that carries its blocks, or that a
        prefill would not help (an embedding, prompt scores, a prompt of less than a block and
        a token), or with no prefill engine (or no decode engine) alive, runs whole on a
        decode engine (or any live engine). One that was sent to a decode engine whose blocks
        waited there, and comes back (that engine was lost before it started), runs whole."""
        if among is not None:
            await super()._route(request, among)
            return
        if request.kv_from:  # its blocks were lost with its decode engine
            self._parked.pop(request.request_id, None)
            self.fallbacks += 1
            request = dataclasses.replace(request, kv_from="")
            await super()._route(request, self._decode_replicas() or None)
            return
        prefill, decode = self._prefill_replicas(), self._decode_replicas()
        whole = (
            request.kv_blocks is not None
            or request.pooling is not None
            or request.params.prompt_logprobs is not None
            or len(request.prompt_token_ids) <= self.config.block_size
            or not prefill
            or not decode
        )
        if whole:
            await super()._route(request, decode or None)
            return
        await self._prefill(request, prefill, decode)

    def _choose(self, request: EngineRequest, among: list[str], role: str) -> str:
        assert self.policy is not None
        name = self.policy.choose(self.route_request(request), [self.load(n) for n in among])
        if name not in among:
            raise RuntimeError(
                f"routing policy {self.config.policy!r} chose {name!r}, which is not one of "
                f"the live {role} engines {sorted(among)}"
            )
        return name

    async def _prefill(self, request: EngineRequest, prefill: list[str], decode: list[str]) -> None:
        """Choose both ends of ``request`` and send its prefill, naming where its blocks go."""
        prefill_id = request.request_id + PREFILL_SUFFIX
        name = self._choose(request, prefill, "prefill")
        target = self._choose(request, decode, "decode")
        tokens = len(request.prompt_token_ids)
        self._prefilling[prefill_id] = _Prefilling(request, name, tokens, target)
        self._prefill_ids.add(prefill_id)
        self._outstanding[name] += tokens
        self._held[name] += 1
        promised = self._promised[target]
        promised[0] += tokens
        promised[1] += 1
        self.routed[name] += 1
        self.recent.append((prefill_id, name))
        params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, priority=request.params.priority
        )
        prefill_request = dataclasses.replace(
            request,
            request_id=prefill_id,
            params=params,
            parsing=None,
            bad_words_token_ids=(),
            kv_to=self._execute[target],
        )
        self.spawn(self._expire(prefill_id))
        await self.emit("requests", prefill_request, to=self._live[name].admit)

    def _unbook(self, prefill_id: str) -> _Prefilling | None:
        """Drop the prefill of ``prefill_id`` from the books (its engines' loads with it)."""
        state = self._prefilling.pop(prefill_id, None)
        if state is not None:
            if state.replica in self._outstanding:
                self._outstanding[state.replica] -= state.tokens
                self._held[state.replica] -= 1
            promised = self._promised[state.decode]
            promised[0] -= state.tokens
            promised[1] -= 1
        return state

    async def _run_whole(self, prefill_id: str, why: str) -> None:
        """Run the request of ``prefill_id`` whole on a decode engine (or any live one)."""
        state = self._unbook(prefill_id)
        # NOTE: its prefill may still send a row (an aborted one sends no last row); the
        # frontend drops rows of ids it does not know, so the id need not be kept. Its blocks
        # may still reach its decode engine: they are released when it says so (on_kv)
        self._prefill_ids.discard(prefill_id)
        if state is None:
            return
        self.fallbacks += 1
        logger.warning(
            "request %s runs whole on a decode engine: %s", state.request.request_id, why
        )
        await super()._route(state.request, self._decode_replicas() or None)

    async def _abort_prefill(self, prefill_id: str, replica: str) -> None:
        if replica in self._live:
            schedule = self._live[replica].schedule
            await self.emit("aborts", AbortRequests((prefill_id,)), to=schedule)

    async def _release(self, replica: str, request_ids: tuple[str, ...]) -> None:
        """Tell decode engine ``replica`` (if it lives) to drop the blocks of these."""
        if replica in self._live and request_ids:
            self.released += len(request_ids)
            await self.emit("kv_release", KvRelease(request_ids), to=self._execute[replica])

    async def _expire(self, prefill_id: str) -> None:
        """Run the request of ``prefill_id`` whole once its transfer is late: its prefill
        finished ``transfer_timeout`` seconds ago and no blocks came, or its prefill engine
        has run no step for that long. (A busy prefill engine that keeps stepping keeps its
        queue: a request waiting its turn is not late.)"""
        timeout = self.config.transfer_timeout
        while True:
            await asyncio.sleep(timeout)
            state = self._prefilling.get(prefill_id)
            if state is None:
                return
            now = time.monotonic()
            if state.finished is not None:
                if now - state.finished >= timeout:
                    break
            elif now - self._heard.get(state.replica, 0.0) >= timeout:
                break
        await self._abort_prefill(prefill_id, state.replica)
        late = "after its prefill" if state.finished is not None else "of a step"
        await self._run_whole(
            prefill_id,
            f"prefill engine {state.replica} sent neither its KV blocks nor any sign {late} "
            f"within {timeout:g} s",
        )

    @handles(KvArrived)
    async def on_kv(self, arrived: KvArrived) -> None:
        """A decode engine holds a request's blocks: send it the request (or, where the
        request no longer waits for them, tell it to drop them)."""
        target = self._replica_of.get(arrived.stage)
        if target is None:  # the graph links only the replicas' execute stages here
            logger.error("KvArrived from %r, which is no replica's execute stage (%s): "
                         "ignored", arrived.stage, sorted(self._replica_of))  # fmt: skip
            return
        self.decode_held[target] = (arrived.held, arrived.held_bytes)
        state = self._prefilling.get(arrived.request_id + PREFILL_SUFFIX)
        if state is None or state.decode != target or target not in self._live:
            # timed out, aborted, its prefill engine was lost: the request went on without
            await self._release(target, (arrived.request_id,))
            return
        self._unbook(arrived.request_id + PREFILL_SUFFIX)
        transfer = KvTransfer(
            arrived.request_id, state.replica, arrived.num_blocks, arrived.nbytes, target
        )
        self.transfers += 1
        self.blocks_moved += transfer.num_blocks
        self.bytes_moved += transfer.nbytes
        self.recent_transfers.append(transfer)
        self._parked[arrived.request_id] = target
        request = dataclasses.replace(state.request, kv_from=self._execute[state.replica])
        await super()._route(request, (target,))

    @handles(EngineOutputs)
    async def on_outputs(self, outputs: EngineOutputs) -> None:
        if outputs.stats is not None:  # every step's outputs carry them: its engine steps
            self._heard[outputs.stats.replica] = time.monotonic()
        parked = self._parked
        if parked:  # a request's first step took its blocks
            for request_id in outputs.request_ids:
                parked.pop(request_id, None)
        prefill_ids = self._prefill_ids
        if prefill_ids and any(rid in prefill_ids for rid in outputs.request_ids):
            keep = []
            for index, request_id in enumerate(outputs.request_ids):
                if request_id not in prefill_ids:
                    keep.append(index)
                elif outputs.finish_reasons[index] is not None:
                    prefill_ids.discard(request_id)
                    state = self._prefilling.get(request_id)
                    if state is not None:  # its blocks are late (or on their way)
                        state.finished = time.monotonic()
            outputs = _rows(outputs, keep)  # kept even when empty: it carries the stats
        await super().on_outputs(outputs)

    @handles(RequestRejected)
    async def on_rejected(self, rejected: RequestRejected) -> None:
        request_id = rejected.request_id
        if request_id in self._prefill_ids:
            self._prefill_ids.discard(request_id)
            await self._run_whole(
                request_id, f"its prefill engine refused it ({rejected.kind}: {rejected.message})"
            )
            return
        target = self._parked.pop(request_id, None)
        if target is not None:  # refused before its first step took its blocks
            await self._release(target, (request_id,))
        await super().on_rejected(rejected)

    @handles(AbortRequests)
    async def on_abort(self, abort: AbortRequests) -> None:
        rest = []
        released: dict[str, list[str]] = {}
        for request_id in abort.request_ids:
            target = self._parked.pop(request_id, None)
            if target is not None:  # aborted before its first step took its blocks
                released.setdefault(target, []).append(request_id)
            prefill_id = request_id + PREFILL_SUFFIX
            state = self._unbook(prefill_id)
            if state is None:
                rest.append(request_id)
                continue
            self._prefill_ids.discard(prefill_id)  # as in _run_whole
            await self._abort_prefill(prefill_id, state.replica)
        if rest:
            await super().on_abort(AbortRequests(tuple(rest)))
        for target, request_ids in released.items():
            await self._release(target, tuple(request_ids))

    async def on_replica_lost(self, lost: ReplicaLost) -> None:
        if lost.replica_set == self.config.replica_set:
            # the blocks parked there died with it; its unstarted requests come back whole
            self._parked = {rid: t for rid, t in self._parked.items() if t != lost.replica}
        stranded = [
            (prefill_id, state)
            for prefill_id, state in self._prefilling.items()
            if lost.replica in (state.replica, state.decode)
        ]
        await super().on_replica_lost(lost)
        if lost.replica_set != self.config.replica_set:
            return
        for prefill_id, state in stranded:
            self._prefill_ids.discard(prefill_id)
            if state.replica == lost.replica:
                why = f"prefill engine {lost.replica} failed"
            else:  # its prefill goes on, for nothing: its blocks have nowhere to go
                await self._abort_prefill(prefill_id, state.replica)
                why = f"decode engine {lost.replica}, where its blocks were going, failed"
            await self._run_whole(prefill_id, why)

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """As the router's; a request that failed on its way to a prefill engine is dropped
        from the prefills too (it is answered with the error)."""
        request_id = request_id_of(message)
        if port == "in" and request_id is not None:
            self._unbook(request_id + PREFILL_SUFFIX)
            self._prefill_ids.discard(request_id + PREFILL_SUFFIX)
        return await super().recover(message, port, error)


def _rows(outputs: EngineOutputs, keep: list[int]) -> EngineOutputs:
    """``outputs`` with only the rows ``keep`` (their per-request maps cut to them too)."""
    ids = tuple(outputs.request_ids[i] for i in keep)
    kept = set(ids)

    def cut(mapping: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in mapping.items() if key in kept}

    return dataclasses.replace(
        outputs,
        request_ids=ids,
        new_token_ids=tuple(outputs.new_token_ids[i] for i in keep),
        finish_reasons=tuple(outputs.finish_reasons[i] for i in keep),
        stop_reasons=tuple(outputs.stop_reasons[i] for i in keep),
        logprobs=cut(outputs.logprobs),
        num_cached_tokens=cut(outputs.num_cached_tokens),
        scheduler_times=cut(outputs.scheduler_times),
        prompt_logprobs=cut(outputs.prompt_logprobs),
        embeddings=cut(outputs.embeddings),
    )
