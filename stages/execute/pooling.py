"""The pooler: an embedding request's final-norm hidden states reduced to one vector, in the
execute stage, which owns the tensors (docs/architecture.md §12).

As vLLM's pooling runner does for a causal model (``vllm/model_executor/layers/pooler.py``:
``LastPool``, ``MeanPool``, ``CLSPool``, then the embedding head that keeps the first
``dimensions`` values and normalizes), the vector is computed from the decoder's output (after
the final norm, before the LM head) over the request's prompt: the last token's (``last``),
the mean over every token (``mean``) or the first token's (``cls``). A prompt longer than a
step's chunk is pooled across its chunks: ``mean`` keeps a running sum, ``cls`` the first
row, ``last`` needs only the last chunk; a chunk starting at 0 (a new or preempted request)
starts over.

``mean`` and ``cls`` need rows that a prefix-cache hit would skip, so their requests do not
look the cache up (:func:`uses_prefix_cache`; their blocks are still published for others);
``last`` always computes the last token (the cache never serves it) and keeps the cache.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from stages.pooling import PoolingParams

__all__ = [
    "HiddenStates",
    "PoolWork",
    "PooledRequest",
    "Pooler",
    "capture_hidden_states",
    "matryoshka_dimensions",
]


class PooledRequest(Protocol):
    """What the pooler needs of an embedding request: its id and what it asks."""

    @property
    def request_id(self) -> str: ...

    @property
    def pooling(self) -> PoolingParams | None: ...


class PoolWork(Protocol):
    """What the pooler needs of a chunk that ran: its positions ``[start, end)``, one past
    its last row in the packed batch, and whether it ends the prompt."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def packed_end(self) -> int: ...

    @property
    def samples(self) -> bool: ...


class HiddenStates:
    """The decoder's output of one forward pass (``[T, H]`` once captured)."""

    tensor: torch.Tensor | None = None


@contextlib.contextmanager
def capture_hidden_states(model: Any, *, enabled: bool = True) -> Iterator[HiddenStates]:
    """Within the block, each forward pass of ``model`` records its decoder's output (the
    final norm's, ``[1, T, H]`` → ``[T, H]``) in the :class:`HiddenStates` yielded. A forward
    hook on ``model.get_decoder()``, transformers' and actorline's own Llama alike; not
    ``enabled``: nothing is hooked (and nothing recorded)."""
    captured = HiddenStates()
    if not enabled:
        yield captured
        return

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        captured.tensor = hidden[0]  # [T, H]

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def matryoshka_dimensions(model_dir: Path) -> tuple[int, ...] | None:
    """The embedding sizes a model's ``config.json`` allows a request's ``dimensions`` (vLLM's
    reading: ``matryoshka_dimensions``, a list of sizes; ``is_matryoshka`` true, any size,
    ``()``); None where it says neither (or there is no config)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and all(type(s) is int and s > 0 for s in sizes):
        return tuple(sorted(set(sizes)))
    if config.get("is_matryoshka") is True:
        return ()
    return None


class Pooler:
    """Pools embedding requests' hidden states across their chunks (see the module
    docstring). ``pooling_type``: one of :data:`stages.pooling.POOLING_TYPES`;
    ``normalize``: the engine's default for requests that do not say."""

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        # request id -> the running sum (mean) or the first row (cls), float32 [H]
        self._partial: dict[str, torch.Tensor] = {}

    def uses_prefix_cache(self) -> bool:
        """Whether an embedding request may take its prefix from the cache: only where the
        pooled rows are never served from it (``last``)."""
        return self.pooling_type == "last"

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop what is kept of these requests (finished, aborted or preempted)."""
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    def pool(
        self, captured: HiddenStates, works: Sequence[tuple[PooledRequest, PoolWork]]
    ) -> dict[str, np.ndarray]:
        """Take each embedding chunk's rows of the captured hidden states (``[T, H]``, the
        packed batch's after the final norm); for a chunk that ends its prompt, the
        request's vector.

        Returns:
            request id → ``float32 [dimensions]`` for every chunk that ended its prompt.
        Raises:
            RuntimeError: nothing was captured (the step did not run the model's modules).
        """
        hidden = captured.tensor
        if hidden is None:
            raise RuntimeError("the step's hidden states were not captured")
        done: dict[str, np.ndarray] = {}
        for request, work in works:
            request_id, params = request.request_id, request.pooling
            assert params is not None
            rows = hidden[work.packed_end - (work.end - work.start) : work.packed_end]  # [n, H]
            if self.pooling_type == "mean":
                partial = rows.float().sum(dim=0)  # [H]
                if work.start > 0:
                    partial += self._partial[request_id]
                self._partial[request_id] = partial
            elif self.pooling_type == "cls" and work.start == 0:
                self._partial[request_id] = rows[0].float()
            if not work.samples:
                continue
            if self.pooling_type == "last":
                vector = rows[-1].float()
            elif self.pooling_type == "mean":
                vector = self._partial.pop(request_id) / work.end
            else:
                vector = self._partial.pop(request_id)
            done[request_id] = self._finish(vector, params)
        return done

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> np.ndarray:
        """vLLM's embedding head: the first ``dimensions`` values, then (unless the request or
        the engine says not to) L2-normalized."""
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, p=2.0, dim=-1)
        return np.ascontiguousarray(vector.cpu().numpy(), dtype=np.float32)
