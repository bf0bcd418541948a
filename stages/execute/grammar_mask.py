"""The sampler's structured-outputs hook: a step's token bitmask → the constrained rows' masks.

The schedule stage sends, with each :class:`~stages.messages.SchedulerStep`, the bitmask of the
constrained requests that sample in it (``grammar_request_ids[i]`` has row ``i``; the layout of
:mod:`stages.structured.backend`: bit ``t % 32`` of ``int32`` word ``t // 32`` set when token
``t`` is allowed). :func:`grammar_rows` picks the step's sampling rows that are constrained and
unpacks their bits into a ``[constrained rows, vocab]`` boolean mask, True where a token is
forbidden; the sampler sets those tokens to -inf before anything else (as vLLM applies the
grammar bitmask to the logits before sampling, ``vllm/v1/worker/gpu_model_runner.py``).

Only the constrained rows are touched: on the CPU one in-place ``masked_fill_`` per
constrained row, on a GPU one ``masked_fill`` over the constrained rows (:meth:`GrammarRows.apply`).
A batch of 64 rows with 32 constrained spends 1.3-1.8 ms per step here where one
``masked_fill`` over the whole ``[64, 49152]`` batch spent 3.9-4.5 ms (docs/performance.md
§11). On the CPU the bits are unpacked by numpy; on a GPU by torch on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.messages import SchedulerStep

__all__ = ["GrammarRows", "grammar_rows", "mask_rows"]


@dataclass(frozen=True)
class GrammarRows:
    """The constrained rows of a step's sampling batch and what their grammars forbid.

    Attributes:
        rows: the constrained rows, as indices into the batch, ascending.
        forbidden: ``[len(rows), vocab]`` booleans, True for the tokens row ``rows[i]``'s
            grammar forbids.
    """

    rows: tuple[int, ...]
    forbidden: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` (``[batch, vocab]``) with the forbidden tokens of the
        constrained rows set to -inf; ``logits`` itself is not modified."""
        masked = logits.clone()
        forbidden = self.forbidden.to(logits.device)
        if masked.device.type == "cpu":
            # NOTE: one in-place fill per row beats a gather, a fill and a scatter on the
            # CPU, where each launch costs microseconds.
            for index, row in enumerate(self.rows):
                masked[row].masked_fill_(forbidden[index], float("-inf"))
        else:
            rows = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
            masked[rows] = masked[rows].masked_fill(forbidden, float("-inf"))
        return masked


def grammar_rows(
    step: SchedulerStep,
    sampling_request_ids: Sequence[str],
    vocab_size: int,
    device: torch.device,
) -> GrammarRows | None:
    """The rows of ``sampling_request_ids`` that the step's grammars constrain and the tokens
    each forbids, or None when no sampling row is constrained.

    Raises:
        ValueError: the step's bitmask does not have one row per ``grammar_request_ids``.
    """
    return mask_rows(
        step.grammar_bitmask, step.grammar_request_ids, sampling_request_ids, vocab_size, device
    )


def mask_rows(
    bitmask: np.ndarray | None,
    grammar_request_ids: Sequence[str],
    sampling_request_ids: Sequence[str],
    vocab_size: int,
    device: torch.device,
) -> GrammarRows | None:
    """:func:`grammar_rows` of a bitmask and its request ids (``grammar_request_ids[i]``
    has row ``i``) wherever they come from: a step's, or the part of it a pipeline-parallel
    engine's last shard gets (:mod:`stages.execute.pp_sampling`).

    Raises:
        ValueError: the bitmask does not have one row per ``grammar_request_ids``.
    """
    if bitmask is None or not grammar_request_ids:
        return None
    if bitmask.ndim != 2 or bitmask.shape[0] != len(grammar_request_ids):
        raise ValueError(
            f"grammar_bitmask is {tuple(bitmask.shape)}, not one row for each of the "
            f"{len(grammar_request_ids)} grammar_request_ids"
        )
    row_of = {request_id: row for row, request_id in enumerate(grammar_request_ids)}
    rows: list[int] = []  # sampling rows that are constrained
    sources: list[int] = []  # their rows in the bitmask
    for row, request_id in enumerate(sampling_request_ids):
        source = row_of.get(request_id)
        if source is not None:
            rows.append(row)
            sources.append(source)
    if not rows:
        return None
    chosen = np.ascontiguousarray(bitmask[sources], dtype="<i4")  # [R, W], little-endian
    # NOTE: tokens past the bitmask's width (a backend narrower than the model) stay
    # forbidden: nothing allowed them.
    if device.type == "cpu":
        allowed = np.unpackbits(chosen.view(np.uint8), axis=1, bitorder="little")  # [R, W*32]
        width = min(vocab_size, allowed.shape[1])
        forbidden = np.ones((len(rows), vocab_size), dtype=np.bool_)
        forbidden[:, :width] = allowed[:, :width] == 0
        return GrammarRows(tuple(rows), torch.from_numpy(forbidden))
    words = torch.from_numpy(chosen).to(device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed_bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)  # [R, W*32]
    width = min(vocab_size, allowed_bits.shape[1])
    on_device = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
    on_device[:, :width] = allowed_bits[:, :width] == 0
    return GrammarRows(tuple(rows), on_device)
