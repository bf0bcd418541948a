"""Prompt logprobs (vLLM's ``prompt_logprobs``): the log-probability of each prompt token
given the tokens before it, computed by the model runner from the logits of the prompt's own
positions, for the requests that ask and only for them.

The logits at position ``p`` are the model's distribution of token ``p + 1``, so a prompt of
``P`` tokens has ``P - 1`` scores (its first token has none: vLLM and OpenAI return null
there). A chunk ``[start, end)`` of a prefill computes the rows ``start .. end - 1``: those
below ``P - 1`` score a prompt token (row ``P - 1`` is the sampling row, whose distribution
gives the first generated token its ordinary logprobs). The runner adds these rows to the
LM head's rows of the step (``logits_to_keep``), so a request that did not ask costs nothing.

Scores build up over the steps a chunked prefill takes and are sent once, with the request's
first token (:class:`~stages.messages.StepResult`). A request whose prompt is still being
scored reads nothing from the prefix cache (vLLM v1 does the same:
``vllm/v1/core/kv_cache_manager.py``, ``get_computed_blocks`` skips the lookup for requests
that need prompt logprobs), so every position is computed here; its blocks are still
published for others. A preempted request keeps its scores and does not score a row twice.

As vLLM's, the scores are of the raw logits (before any penalty, bias or grammar), in fp32,
with the rank of the prompt token (1: the most likely) and the top alternatives asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from stages.messages import Logprobs
from stages.params import SamplingParams

__all__ = [
    "ROWS_PER_SLICE",
    "PromptRows",
    "PromptScores",
    "ScoredChunk",
    "chunk_targets",
    "fill_prompt_rows",
    "new_prompt_scores",
    "prompt_rows",
    "score_prompt_rows",
    "score_rows",
]

#: log-softmax runs over this many rows at a time: a long prompt's fp32 copy of its logits
#: stays at most ``ROWS_PER_SLICE x vocabulary`` floats beside the model's own
ROWS_PER_SLICE = 256


@dataclasses.dataclass(slots=True)
class PromptScores:
    """One request's prompt scores so far (the runner keeps it with the request, across
    preemption). ``scored``: rows done, so tokens ``1 .. scored`` have their entry;
    ``num_top``: top alternatives per position; ``sent``: the entries went out (and were
    dropped here)."""

    prompt_token_ids: tuple[int, ...]
    num_top: int
    entries: list[Logprobs] = dataclasses.field(default_factory=list)
    scored: int = 0
    sent: bool = False

    @property
    def owed(self) -> bool:
        """Whether some prompt token still has no score."""
        return self.scored < len(self.prompt_token_ids) - 1

    def rows(self, start: int, end: int) -> range:
        """The positions of a chunk computing ``[start, end)`` whose rows score a prompt token
        not scored yet.

        NOTE: scoring is contiguous from position 0, since such a request takes nothing from
        the prefix cache while it owes scores: a chunk never starts past ``scored``.
        """
        last = len(self.prompt_token_ids) - 1  # row P - 1 samples; it scores no prompt token
        first = max(start, self.scored)
        assert start <= self.scored or first >= min(end, last), "prompt rows skipped"
        return range(first, min(end, last))

    def take(self) -> tuple[Logprobs, ...] | None:
        """The entries to send with the request's first token (once; None after, or while
        some are owed)."""
        if self.sent or self.owed:
            return None
        self.sent = True
        entries, self.entries = tuple(self.entries), []
        return entries


def new_prompt_scores(
    params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int
) -> PromptScores | None:
    """The scores to fill for a request (None: it did not ask). ``prompt_logprobs`` -1 means
    the whole vocabulary (validation allowed it only for a small one)."""
    asked = params.prompt_logprobs
    if asked is None:
        return None
    num_top = vocab_size if asked == -1 else min(asked, vocab_size)
    return PromptScores(tuple(prompt_token_ids), num_top)


@dataclasses.dataclass(frozen=True, slots=True)
class ScoredChunk:
    """The rows one chunk adds: ``positions`` of the request whose ``scores`` they fill, at
    rows ``first_row ..`` of the extra logits."""

    scores: PromptScores
    positions: range
    first_row: int


@dataclasses.dataclass(frozen=True, slots=True)
class PromptRows:
    """A step's extra LM-head rows: ``packed_rows[i]`` is the packed-batch index of extra
    logits row ``i``; ``chunks`` say whose they are."""

    packed_rows: tuple[int, ...]
    chunks: tuple[ScoredChunk, ...]


def prompt_rows(chunks: Sequence[tuple[PromptScores | None, int, int, int]]) -> PromptRows:
    """The extra rows of a step from its chunks: ``(scores, start, end, packed_end)`` each
    (``scores`` None: the request asked for nothing; ``packed_end``: one past the chunk's
    last row in the packed batch, whose rows are positions ``start .. end - 1``)."""
    packed: list[int] = []
    scored: list[ScoredChunk] = []
    for scores, start, end, packed_end in chunks:
        if scores is None or not scores.owed:
            continue
        positions = scores.rows(start, end)
        if not positions:
            continue
        scored.append(ScoredChunk(scores, positions, len(packed)))
        offset = packed_end - end  # packed index of position p is p + offset
        packed.extend(position + offset for position in positions)
    return PromptRows(tuple(packed), tuple(scored))


def score_prompt_rows(logits: torch.Tensor, rows: PromptRows) -> None:
    """Fill each chunk's scores from ``logits`` (``[len(rows.packed_rows), V]``, the extra
    rows in order): the next prompt token's logprob and rank at each position, and the top
    alternatives."""
    for chunk in rows.chunks:
        scores = chunk.scores
        positions = chunk.positions
        first = chunk.first_row
        scores.entries += score_rows(
            logits[first : first + len(positions)], chunk_targets(chunk), scores.num_top
        )
        scores.scored = positions.stop


def chunk_targets(chunk: ScoredChunk) -> tuple[int, ...]:
    """The prompt token each of ``chunk``'s rows scores (the one after its position)."""
    positions = chunk.positions
    return chunk.scores.prompt_token_ids[positions.start + 1 : positions.stop + 1]


def fill_prompt_rows(entries: Sequence[Logprobs], rows: PromptRows) -> None:
    """Fill each chunk's scores with ``entries`` (one per extra row, in order) that
    :func:`score_rows` computed elsewhere: a pipeline-parallel engine's last shard, which
    holds the logits (:mod:`stages.execute.pp_sampling`).

    Raises:
        ValueError: not one entry per row.
    """
    if len(entries) != len(rows.packed_rows):
        raise ValueError(
            f"{len(entries)} prompt-logprob entries for {len(rows.packed_rows)} scored rows"
        )
    for chunk in rows.chunks:
        first = chunk.first_row
        chunk.scores.entries += entries[first : first + len(chunk.positions)]
        chunk.scores.scored = chunk.positions.stop


def score_rows(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[Logprobs]:
    """The score of ``targets[i]`` under row ``i`` of ``logits`` (``[R, V]``): its logprob
    (fp32 log-softmax of the raw logits) and rank, and the ``num_top`` most likely tokens,
    ``ROWS_PER_SLICE`` rows at a time."""
    device = logits.device
    entries: list[Logprobs] = []
    for first in range(0, len(targets), ROWS_PER_SLICE):
        part = targets[first : first + ROWS_PER_SLICE]
        logprobs = logits[first : first + len(part)].float().log_softmax(dim=-1)  # [R, V]
        target_ids = torch.tensor(part, device=device).unsqueeze(1)  # [R, 1]
        chosen = logprobs.gather(1, target_ids)  # [R, 1]
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # [R]; 1 = the most likely
        top_ids: list[list[int]] = [[] for _ in part]
        top_values: list[list[float]] = [[] for _ in part]
        if num_top > 0:
            top = logprobs.topk(num_top, dim=-1)  # [R, k]
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for index, (token, value) in enumerate(
            zip(target_ids.squeeze(1).tolist(), chosen.squeeze(1).tolist(), strict=True)
        ):
            entries.append(
                Logprobs(
                    token_id=token,
                    logprob=value,
                    rank=ranks[index],
                    top_token_ids=tuple(top_ids[index]),
                    top_logprobs=tuple(top_values[index]),
                )
            )
    return entries
