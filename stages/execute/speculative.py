"""Speculative decoding in execute: a drafted chunk's rows are verified in the step's one
forward pass (docs/speculative.md; the scheduler's half is :mod:`stages.speculative`).

A chunk with ``draft_token_ids`` computes the request's last known token and its ``k`` drafted
ones, like a short prefill chunk that samples at every row. Before the step's blocks are
planned, :func:`stage_drafts` appends each draft to its request's tokens (so packing and
allocation see them as known tokens); after the forward pass :func:`verify` decides, row by
row, and :func:`settle` keeps the accepted tokens, appends the corrected or bonus token, and
rolls back the rejected ones: their tokens, their computed positions and the blocks past the
accepted ones (only the accepted tokens' full blocks are ever published to the prefix cache).

Verification, as vLLM's rejection sampler (``vllm/v1/sample/rejection_sampler.py``) with the
n-gram proposer's point-mass draft distribution ``q = δ(x)``:

- greedy: a draft token is accepted while it equals the target's argmax at its row; the first
  mismatch's argmax (or, all accepted, the last row's) is the step's token;
- temperature > 0: draft ``x`` at row ``i`` is accepted with probability ``p_i(x)`` (the
  sampler's distribution there: ``min(1, p/q)`` with ``q(x) = 1``); a rejection samples from
  ``p_i`` with ``x`` removed and renormalised (``max(0, p - q)``), which keeps the output
  distributed exactly as ``p``. A seeded request draws from its own generator.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Protocol

import torch

from stages.execute.allocator import BlockAllocator
from stages.execute.bookkeeping import commit_drafted_chunk
from stages.execute.sampler import GREEDY_TEMPERATURE, Sampler, SamplingState
from stages.messages import ScheduledChunk

__all__ = [
    "DraftedRequest",
    "DraftedWork",
    "draft_rows",
    "settle",
    "stage_drafts",
    "unstage_drafts",
    "verify",
    "verify_drafts",
]


class DraftedRequest(Protocol):
    """What this module needs of the runner's per-request state."""

    request_id: str
    sampling: SamplingState
    num_computed: int
    num_cached: int
    cache_key: bytes

    @property
    def num_tokens(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool: ...

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]: ...


class DraftedWork(Protocol):
    """A drafted chunk's share of the packed batch: its request, one past its last position."""

    @property
    def request(self) -> DraftedRequest: ...

    @property
    def end(self) -> int: ...


def stage_drafts(
    requests: Mapping[str, DraftedRequest], chunks: Sequence[ScheduledChunk]
) -> dict[str, tuple[int, ...]]:
    """Append each drafted chunk's draft to its request's tokens (a validated, released step).

    Returns:
        request id -> draft, for the chunks that carry one.
    """
    drafts: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        if chunk.draft_token_ids:
            requests[chunk.request_id].sampling.output_token_ids.extend(chunk.draft_token_ids)
            drafts[chunk.request_id] = chunk.draft_token_ids
    return drafts


def unstage_drafts(
    requests: Mapping[str, DraftedRequest],
    drafts: MutableMapping[str, tuple[int, ...]],
    request_ids: Sequence[str],
) -> None:
    """Take the drafts of ``request_ids`` (preempted while planning) back out of their
    tokens and out of ``drafts``."""
    for request_id in request_ids:
        draft = drafts.pop(request_id, ())
        if draft:
            del requests[request_id].sampling.output_token_ids[-len(draft) :]


def draft_rows(packed_ends: Sequence[tuple[int, int]]) -> list[int]:
    """The packed rows whose logits verify drafts: for each ``(packed_end, draft length)``,
    the rows of the last known token and every draft token but the last (the last draft
    token's row is the chunk's sampling row, kept anyway)."""
    rows: list[int] = []
    for packed_end, num_drafted in packed_ends:
        first = packed_end - 1 - num_drafted
        rows.extend(range(first, packed_end - 1))
    return rows


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    state: SamplingState,
    draft: Sequence[int],
) -> tuple[tuple[int, ...], int]:
    """Verify ``draft`` against the target's ``logits`` (``[len(draft) + 1, V]``: row ``i``
    scores the token after draft position ``i - 1``, the last row the token after the whole
    draft); see the module docstring.

    Returns:
        The accepted leading draft tokens, and the step's token after them.
    Raises:
        ValueError: ``logits`` does not have one row more than ``draft``.
    """
    num_drafted = len(draft)
    if logits.dim() != 2 or logits.shape[0] != num_drafted + 1:
        raise ValueError(
            f"logits must be [{num_drafted + 1}, vocab] for a {num_drafted}-token draft, got "
            f"{tuple(logits.shape)}"
        )
    states = [state] * (num_drafted + 1)
    if state.params.temperature < GREEDY_TEMPERATURE:
        targets = sampler.sample(logits, states).token_ids
        accepted = 0
        while accepted < num_drafted and targets[accepted] == draft[accepted]:
            accepted += 1
        return tuple(draft[:accepted]), targets[accepted]
    probs = sampler.probabilities(logits, states)  # [k + 1, V]
    generator = state.generator
    for row, token in enumerate(draft):
        chance = float(probs[row, token])
        draw = float(torch.rand((), generator=generator, device=probs.device))
        if draw < chance:
            continue
        residual = probs[row].clone()  # [V]
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p was a point mass on the draft: cannot reject
            continue
        corrected = torch.multinomial(residual, 1, generator=generator)
        return tuple(draft[:row]), int(corrected)
    bonus = torch.multinomial(probs[num_drafted], 1, generator=generator)
    return tuple(draft), int(bonus)


def settle(
    allocator: BlockAllocator,
    request: DraftedRequest,
    end: int,
    num_drafted: int,
    accepted: Sequence[int],
    token_id: int,
) -> None:
    """After a drafted chunk ending at ``end`` was verified: drop the rejected draft tokens,
    append ``token_id``, record the computed positions (the last known token's and the
    accepted ones') and publish their full blocks, and give back the blocks past them."""
    rejected = num_drafted - len(accepted)
    outputs = request.sampling.output_token_ids
    if rejected:
        del outputs[-rejected:]
    outputs.append(token_id)
    commit_drafted_chunk(allocator, request, end, rejected)


def verify_drafts(
    sampler: Sampler,
    allocator: BlockAllocator,
    last_rows: Sequence[torch.Tensor],
    draft_logits: torch.Tensor,
    drafted: Sequence[DraftedWork],
    drafts: Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[int, ...]]:
    """:func:`verify` and :func:`settle` each drafted work: ``last_rows[i]`` (``[V]``) is
    ``drafted[i]``'s sampling row, ``draft_logits`` the rows of :func:`draft_rows` in
    ``drafted`` order. The step's token is appended to each request's outputs.

    Returns:
        The accepted draft tokens by request id.
    """
    accepted_ids: dict[str, tuple[int, ...]] = {}
    offset = 0
    for work, last in zip(drafted, last_rows, strict=True):
        request_id = work.request.request_id
        draft = drafts[request_id]
        rows = torch.cat((draft_logits[offset : offset + len(draft)], last[None]))  # [k + 1, V]
        offset += len(draft)
        accepted, token_id = verify(sampler, rows, work.request.sampling, draft)
        settle(allocator, work.request, work.end, len(draft), accepted, token_id)
        accepted_ids[request_id] = accepted
    return accepted_ids
