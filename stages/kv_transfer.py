"""What disaggregated prefill and decode moves between engines (docs/parallelism.md,
"Disaggregated prefill and decode"): the K/V of a prompt's full blocks, from the prefill
engine that computed them straight to the decode engine that imports them into its prefix
cache, and the two small notes the router and the decode engine exchange about them.

One hop: the prefill engine's execute stage sends :class:`KvBlocks` to the execute stage of
the decode engine the router chose (``EngineRequest.kv_to``), over a link of their own; the
decode engine keeps them in its :class:`KvInbox` and tells the router (:class:`KvArrived`,
a few bytes), which then sends it the request (``EngineRequest.kv_from``); its execute stage
joins the two before the request's first step. Blocks the router no longer wants (their
request was aborted, ran whole, or its decode engine was chosen again) it releases
(:class:`KvRelease`). The router's process never holds the K/V.

Pure (numpy, no torch). The array travels as one of the codec's out-of-band frames
(zero-copy ZeroMQ multipart, ``docs/architecture.md`` §5.4); nothing is pickled. The torch
side (reading blocks out of a KV cache and writing them into another) is
:mod:`stages.execute.kv_blocks`.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from transports.codec import message

__all__ = ["KV_DTYPES", "PREFILL_SUFFIX", "KvArrived", "KvBlocks", "KvInbox", "KvRelease"]

logger = logging.getLogger("actorline.execute")

#: what a request's id on its prefill engine ends with (the router's ``<id>@prefill``)
PREFILL_SUFFIX = "@prefill"

#: the KV cache dtypes a transfer carries, and the numpy dtype each travels as (bf16 has none
#: in numpy: its 16 bits travel as int16 and are read back as bf16, exactly)
KV_DTYPES: dict[str, str] = {"float32": "float32", "float16": "float16", "bfloat16": "int16"}


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KvBlocks:
    """The K/V of the first ``len(token_ids) // block_size`` blocks of request
    ``request_id``'s prompt (``token_ids``: those blocks' tokens, whole blocks only), as the
    prefill engine's cache holds them: ``data [2, L, N, block_size, Hkv, D]`` (keys then
    values, per layer, per block), stored as ``dtype`` (a :data:`KV_DTYPES` key; the array's
    own dtype is that key's value). ``cache_key``: what else the K/V depends on (its LoRA
    adapter's key), mixed into the decode engine's block hashes as the prefill engine's."""

    request_id: str
    token_ids: tuple[int, ...]
    block_size: int
    dtype: str
    data: np.ndarray  # [2, L, N, block_size, Hkv, D]
    cache_key: bytes = b""

    @property
    def num_blocks(self) -> int:
        """How many full blocks this carries."""
        return len(self.token_ids) // self.block_size if self.block_size > 0 else 0

    @property
    def nbytes(self) -> int:
        """The bytes of K/V this carries (what moved over the link, less the few header
        bytes)."""
        return int(self.data.nbytes)


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KvArrived:
    """A decode engine (its execute stage ``stage``) holds request ``request_id``'s moved
    blocks, ``num_blocks`` of them, ``nbytes`` bytes of K/V: to the router, which sends it
    the request now. ``held`` and ``held_bytes``: what else it held as they came (blocks of
    other requests not yet taken or released), so the router sees what waits there."""

    request_id: str
    stage: str
    num_blocks: int
    nbytes: int
    held: int = 0
    held_bytes: int = 0


@message()
@dataclasses.dataclass(frozen=True, slots=True)
class KvRelease:
    """Drop the moved blocks of these requests, if they are still held (from the router to
    a decode engine's execute stage: their request was aborted or ran whole)."""

    request_ids: tuple[str, ...]


class KvInbox:
    """A decode engine's moved blocks, by request id, from their arrival until the request's
    first step takes them (:meth:`take`) or the router releases them (:meth:`release`). The
    router's books decide both, so every entry leaves by one of the two."""

    def __init__(self) -> None:
        self._held: dict[str, KvBlocks] = {}
        #: blocks received, taken by their request, released (dropped) since the start
        self.received = 0
        self.taken = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """The bytes of K/V held now."""
        return sum(blocks.nbytes for blocks in self._held.values())

    def put(self, blocks: KvBlocks, stage: str) -> KvArrived:
        """Hold ``blocks`` (replacing any held for the same request: the later transfer is
        the one the router counts) and say so, as execute stage ``stage``."""
        if self._held.pop(blocks.request_id, None) is not None:
            self.released += 1
            logger.warning("request %s: moved KV blocks came twice; the later kept",
                           blocks.request_id)  # fmt: skip
        arrived = KvArrived(
            blocks.request_id, stage, blocks.num_blocks, blocks.nbytes, len(self), self.nbytes
        )
        self._held[blocks.request_id] = blocks
        self.received += 1
        return arrived

    def take(self, request_id: str) -> KvBlocks | None:
        """The blocks of ``request_id``, no longer held (None: none held)."""
        blocks = self._held.pop(request_id, None)
        if blocks is not None:
            self.taken += 1
        return blocks

    def release(self, request_ids: tuple[str, ...]) -> int:
        """Drop the blocks of ``request_ids`` that are held; returns how many were."""
        dropped = 0
        for request_id in request_ids:
            if self._held.pop(request_id, None) is not None:
                dropped += 1
        self.released += dropped
        return dropped
