"""What disaggregated prefill and decode moves between engines (docs/parallelism.md,
"Disaggregated prefill and decode"): the K/V of a prompt's full blocks, from the prefill
engine that computed them to the decode engine that imports them into its prefix cache.

Pure (numpy, no torch): the frontend's router passes these on without the model's stack. The
array travels as one of the codec's out-of-band frames (zero-copy ZeroMQ multipart,
``docs/architecture.md`` §5.4); nothing is pickled. The torch side (reading blocks out of a
KV cache and writing them into another) is :mod:`stages.execute.kv_blocks`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transports.codec import message

__all__ = ["KV_DTYPES", "KvBlocks"]

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
