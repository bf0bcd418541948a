"""The draft model of speculative decoding (``speculative_config`` method ``draft_model``,
docs/speculative.md): a second, smaller model, run by the execute stage beside the target.

As vLLM V1's drafters (``vllm/v1/spec_decode/draft_model.py``, ``eagle.py``): after the target
has sampled a step, the draft model runs ``k`` greedy steps from each drafting request's
tokens (its accepted ones and the token just sampled) and the drafts go back to the scheduler
with the step's result (:attr:`stages.messages.StepResult.draft_token_ids`); the scheduler
sends them, cut to what its budget leaves, with the request's next chunk, whose verification
(:mod:`stages.execute.speculative`) is unchanged: the draft is greedy, so its distribution
``q`` is a point mass on the drafted token and the rejection sampler keeps the target's
distribution exactly at any temperature.

The draft model is loaded by the same :class:`~stages.execute.runner.ModelRunner` as the
target, with its own options (:meth:`stages.execute.config.ExecuteConfig.draft_config`) and
its own KV cache of as many blocks as the target's, so it holds what the target holds. Its
cache is rolled back to the tokens the target accepted (:meth:`ModelRunner.rewind`: rejected
positions are overwritten by the next chunk); it publishes nothing to a prefix cache. A
request the target finishes or preempts is dropped here too (its draft blocks freed); a
resumed one is registered again with all its tokens as its prompt.

The drafter's interface is two messages' worth (:class:`DraftQuery` in, proposals out, plus
the requests to forget, :mod:`stages.execute.draft_messages`): with ``placement`` ``"engine"``
(the default) it runs in-process on the execute stage's worker thread
(:meth:`Drafter.execute`); with ``"host"`` the draft stage runs it on a host of its own
(:mod:`stages.execute.draft_stage`) and the execute stage only tracks what to draft
(:class:`~stages.execute.draft_tracker.DraftTracker`). Either way a drafter that raises
costs its drafts, never a request: it is logged once and drafts no more
(``StepResult.drafts_dropped`` counts the requests that went without).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from stages.execute.config import ExecuteConfig, ExecuteConfigError
from stages.execute.draft_messages import DraftQuery
from stages.execute.draft_tracker import DraftTracker, with_dropped
from stages.execute.runner import ModelRunner, PreparedStep
from stages.messages import (
    EngineInfo,
    EngineRequest,
    ScheduledChunk,
    SchedulerStep,
    StepResult,
)
from stages.params import SamplingParams
from stages.speculative import SpeculativeConfig

__all__ = ["CATCH_UP_TOKENS", "DraftQuery", "Drafter"]

logger = logging.getLogger("actorline.execute")

#: the most tokens of one request the draft model catches up with in one step (a new
#: request's prompt, a resumed one's tokens): its prefill is spread over the target's first
#: decode steps instead of delaying one of them by all of it
CATCH_UP_TOKENS = 64

#: how the draft model samples: greedily (a point-mass draft distribution)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@dataclasses.dataclass(slots=True)
class _Drafting:
    """A request as the draft runner holds it: its known tokens there (prompt then outputs,
    the last draft included) and how long its prompt there is."""

    tokens: list[int]
    prompt_len: int
    #: the tokens of the last query (their count): the target only appends to those
    confirmed: int = 0


class Drafter:
    """The execute stage's draft model (see the module docstring).

    Args:
        config: the execute stage's config; its ``speculative_config`` has method
            ``draft_model``.
        target: the target's runner (loaded), whose request tokens the drafts follow; None
            in a draft stage (:mod:`stages.execute.draft_stage`), which is told the target's
            info (:meth:`load`) and the tokens (:meth:`propose`).

    Raises:
        ExecuteConfigError: ``config`` names no draft model.
    """

    def __init__(self, config: ExecuteConfig, target: ModelRunner | None = None) -> None:
        spec = config.speculative_config
        if spec is None or not spec.drafts_in_execute:
            raise ExecuteConfigError("speculative_config", "names no draft model")
        self.spec: SpeculativeConfig = spec
        self.config = config
        self.target = target
        self.runner: ModelRunner | None = None
        self.tracker = DraftTracker(spec)
        #: why the drafter drafts no more (it raised once), or None
        self.failure: BaseException | None = None
        self._drafting: dict[str, _Drafting] = {}
        self._step_id = 0
        self._forgotten: list[str] = []  # dropped here, freed in the draft runner's next step

    def load(self, target: EngineInfo | None = None) -> EngineInfo:
        """Load the draft model with as many KV blocks as the target's (``target``: the
        target's info; by default its runner's).

        Returns:
            The draft model's engine info.
        Raises:
            ExecuteConfigError: (``speculative_config``) the draft model's vocabulary is not
                the target's.
            stages.models.ModelError, UnsupportedModelError: as :meth:`ModelRunner.load`.
        """
        if target is None and self.target is not None:
            target = self.target.info
        if target is None:
            raise RuntimeError("the target runner must be loaded before its drafter")
        draft = self.config.draft_config(num_blocks=target.num_blocks)
        self.runner = ModelRunner(draft)
        self.runner.chunks_as_rows = True
        info = self.runner.load()
        if info.vocab_size != target.vocab_size:
            raise ExecuteConfigError(
                "speculative_config",
                f"the draft model {draft.model!r} has a vocabulary of {info.vocab_size} "
                f"tokens, the target {target.model!r} {target.vocab_size}: a draft model "
                "must share the target's tokenizer",
            )
        logger.info("execute: draft model %s loaded (%s)", draft.model, info)
        return info

    # ----------------------------------------------------------------- the stage's glue
    def execute(self, step: SchedulerStep) -> StepResult:
        """Run ``step`` on the target, then draft for the requests that got tokens.

        Returns:
            The target's result with ``draft_token_ids``.
        Raises:
            As :meth:`ModelRunner.execute` (before any drafting; drafting itself never
            raises, :meth:`after_step`).
        """
        assert self.target is not None
        result = self.target.execute(step)
        return self.after_step(step, result)

    def after_run(self, prepared: PreparedStep) -> StepResult:
        """Run ``prepared`` on the target (rank 0 of tensor parallelism, whose other ranks run
        its shard), then draft as :meth:`execute` does."""
        assert self.target is not None
        return self.after_step(prepared.step, self.target.run(prepared))

    def after_step(self, step: SchedulerStep, result: StepResult) -> StepResult:
        """Track ``step``'s requests (:class:`~stages.execute.draft_tracker.DraftTracker`)
        and draft for those that may. A drafter that raises is logged once and drafts no
        more: the result goes without drafts, ``drafts_dropped`` counting the requests that
        asked for one."""
        assert self.target is not None
        queries, forget = self.tracker.observe(step, result, self.target.output_token_ids)
        if self.failure is not None:
            return with_dropped(result, len(queries))
        try:
            drafts = self.propose(queries, forget)
        except Exception as exc:  # NOTE: a drafter bug costs the drafts, never the step
            self.failure = exc
            logger.exception(
                "execute: the draft model failed; decoding goes on without speculation"
            )
            return with_dropped(result, len(queries))
        if not drafts:
            return result
        return dataclasses.replace(result, draft_token_ids=drafts)

    # ----------------------------------------------------------------- the drafter proper
    def propose(
        self, queries: Sequence[DraftQuery], forget: Sequence[str] = ()
    ) -> dict[str, tuple[int, ...]]:
        """Drop the requests ``forget`` (finished or preempted: their draft blocks are freed),
        then draft for ``queries``: every query's draft tokens come from one batched draft step
        per position (the first also catches each request's draft cache up with its tokens).

        Returns:
            request id -> its draft (greedy; shorter or absent where the draft model's length
            or its KV cache ran out).
        Raises:
            RuntimeError: :meth:`load` was not called.
        """
        runner = self.runner
        if runner is None:
            raise RuntimeError("Drafter.load() must be called before propose()")
        for request_id in forget:
            if self._drafting.pop(request_id, None) is not None:
                self._forgotten.append(request_id)
        new_requests: list[EngineRequest] = []
        chunks: list[ScheduledChunk] = []
        wanted: dict[str, int] = {}
        for query in queries:
            if (
                not query.token_ids
                or len(query.token_ids) + query.num_tokens > runner.max_model_len
            ):
                continue
            chunk = self._catch_up(query.request_id, list(query.token_ids), new_requests)
            chunks.append(chunk)
            wanted[query.request_id] = query.num_tokens
        drafts: dict[str, list[int]] = {request_id: [] for request_id in wanted}
        while chunks or self._forgotten:
            result = self._run(new_requests, chunks)
            new_requests = []
            for request_id in result.preempted:  # the draft cache ran out: no draft
                drafts.pop(request_id, None)
                self._drafting.pop(request_id)
                self._forgotten.append(request_id)
            chunks = []
            for request_id, token_id in zip(result.request_ids, result.token_ids, strict=True):
                if request_id not in drafts:
                    continue
                drafted = self._drafting[request_id].tokens
                drafted.append(token_id)
                drafts[request_id].append(token_id)
                if len(drafts[request_id]) < wanted[request_id]:
                    chunks.append(ScheduledChunk(request_id, len(drafted) - 1, 1))
        return {request_id: tuple(tokens) for request_id, tokens in drafts.items() if tokens}

    def forget_all(self) -> None:
        """Drop every request the draft cache holds (a fresh target: none of its requests
        are these), freeing their blocks."""
        self.propose((), tuple(self._drafting))

    def _catch_up(
        self, request_id: str, tokens: list[int], new_requests: list[EngineRequest]
    ) -> ScheduledChunk:
        """The chunk that brings the draft runner's copy of ``request_id`` to ``tokens`` and
        samples its first draft token: its cache rolled back to the longest prefix it shares
        with ``tokens`` (rejected drafts out) and the rest computed; a request it does not
        hold yet (or holds with another prompt) is registered with ``tokens`` as its prompt.
        At most :data:`CATCH_UP_TOKENS` are computed: a chunk that stops short of the end
        samples nothing, so the request gets no draft this step."""
        assert self.runner is not None
        held = self._drafting.get(request_id)
        if held is not None:
            known = held.tokens
            limit = min(len(known), len(tokens))
            # NOTE: the last query's tokens begin these (the target appends only), so the
            # shared prefix is looked for past them; their last token is checked anyway
            common = held.confirmed if 0 < held.confirmed <= limit else 0
            if common and known[common - 1] != tokens[common - 1]:
                common = 0
            while common < limit and known[common] == tokens[common]:
                common += 1
            # tokens it holds already: where all are computed, the last one is computed again
            # to sample after it (a rewind that keeps everything just reads the count)
            if (
                common == len(tokens)
                and self.runner.rewind(request_id, len(known) - held.prompt_len, ()) >= common
            ):
                common -= 1
            if common >= held.prompt_len:
                computed = self.runner.rewind(request_id, common - held.prompt_len, tokens[common:])
                held.tokens, held.confirmed = tokens, len(tokens)
                size = min(len(tokens) - computed, CATCH_UP_TOKENS)
                return ScheduledChunk(request_id, computed, size)
            # NOTE: cannot happen while the target only appends; kept exact anyway
            del self._drafting[request_id]
            self._forgotten.append(request_id)
            self._run([], [])
        self._drafting[request_id] = _Drafting(tokens, len(tokens), len(tokens))
        new_requests.append(EngineRequest(request_id, tuple(tokens), _GREEDY))
        return ScheduledChunk(request_id, 0, min(len(tokens), CATCH_UP_TOKENS))

    def _run(
        self, new_requests: Sequence[EngineRequest], chunks: Sequence[ScheduledChunk]
    ) -> StepResult:
        """One step of the draft runner; it first frees the requests dropped since the last."""
        assert self.runner is not None
        self._step_id += 1
        finished, self._forgotten = tuple(self._forgotten), []
        return self.runner.execute(
            SchedulerStep(
                self._step_id,
                new_requests=tuple(new_requests),
                chunks=tuple(chunks),
                finished=finished,
            )
        )
