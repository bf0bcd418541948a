"""The sampler's structured-outputs hook: a step's token bitmask → one mask for the batch.

The schedule stage sends, with each :class:`~stages.messages.SchedulerStep`, the bitmask of
the constrained requests that sample in it (``grammar_request_ids[i]`` has row ``i``; the
layout of :mod:`stages.grammar`: bit ``t % 32`` of ``int32`` word ``t // 32`` set when token
``t`` is allowed). :func:`forbidden_tokens` turns it into one ``[rows, vocab]`` boolean tensor
for the sampling rows of the step, True where a token is forbidden (free rows all False), and
the sampler applies it with a single ``masked_fill`` before anything else (as vLLM applies
the grammar bitmask to the logits before sampling, ``vllm/v1/worker/gpu_model_runner.py``).
On the CPU the bits are unpacked by numpy; on a GPU by torch on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from stages.messages import SchedulerStep

__all__ = ["forbidden_tokens"]


def forbidden_tokens(
    step: SchedulerStep,
    sampling_request_ids: Sequence[str],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The ``[len(sampling_request_ids), vocab_size]`` mask of tokens the step's grammars
    forbid each sampling row (True: forbidden), or None when no sampling row is constrained.

    Raises:
        ValueError: the step's bitmask does not have one row per ``grammar_request_ids``.
    """
    bitmask = step.grammar_bitmask
    if bitmask is None or not step.grammar_request_ids:
        return None
    if bitmask.ndim != 2 or bitmask.shape[0] != len(step.grammar_request_ids):
        raise ValueError(
            f"grammar_bitmask is {tuple(bitmask.shape)}, not one row for each of the "
            f"{len(step.grammar_request_ids)} grammar_request_ids"
        )
    row_of = {request_id: row for row, request_id in enumerate(step.grammar_request_ids)}
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
    num_rows = len(sampling_request_ids)
    if device.type == "cpu":
        allowed = np.unpackbits(chosen.view(np.uint8), axis=1, bitorder="little")  # [R, W*32]
        width = min(vocab_size, allowed.shape[1])
        # NOTE: tokens past the bitmask's width (a backend narrower than the model) stay
        # forbidden: nothing allowed them.
        constrained = np.ones((len(rows), vocab_size), dtype=np.bool_)
        constrained[:, :width] = allowed[:, :width] == 0
        forbidden = np.zeros((num_rows, vocab_size), dtype=np.bool_)
        forbidden[rows] = constrained
        return torch.from_numpy(forbidden)
    words = torch.from_numpy(chosen).to(device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed_bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)  # [R, W*32]
    width = min(vocab_size, allowed_bits.shape[1])
    mask = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=device)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    on_device = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
    on_device[:, :width] = allowed_bits[:, :width] == 0
    mask[index] = on_device
    return mask
