"""A tiny FCFS scheduler loop that drives a ModelRunner in tests (the real scheduler lives in
stages/scheduler.py; these tests must not depend on it), and per-request HF references."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from stages.execute.runner import ModelRunner
from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep, StepResult

# Greedy equality is only meaningful where the reference's top-2 logits are apart by more than
# float noise between two correct attention implementations (measured < 1e-5 here).
MIN_REFERENCE_MARGIN = 1e-4
# The same holds for a mixture of experts' routing: where the last chosen expert's router logit
# and the first left out are within float noise, the two sides may route a token differently,
# and that changes the hidden state by far more than noise (a Mixtral of the model table had a
# 6e-8 gap on a prompt token, which flipped a later greedy token of margin 6e-3 on one machine).
MIN_ROUTER_MARGIN = 1e-4


@dataclasses.dataclass
class _Tracked:
    request: EngineRequest
    computed: int = 0
    outputs: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.outputs)


@dataclasses.dataclass
class DriveReport:
    outputs: dict[str, list[int]]
    results: list[StepResult]
    steps: list[SchedulerStep]

    @property
    def max_requests_per_step(self) -> int:
        return max(len(step.chunks) for step in self.steps)

    @property
    def preempted_by_execute(self) -> set[str]:
        return {request_id for result in self.results for request_id in result.preempted}

    @property
    def cached_tokens(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for result in self.results:
            for request_id, cached in result.cached_tokens.items():
                merged[request_id] = max(merged.get(request_id, 0), cached)
        return merged


def drive(
    runner: ModelRunner,
    requests: Sequence[EngineRequest],
    *,
    chunk_size: int = 1 << 20,
    max_batch_tokens: int = 1 << 20,
    max_running: int = 64,
    preempt_after: dict[str, int] | None = None,
    max_steps: int = 2000,
) -> DriveReport:
    """Run ``requests`` to completion: every step gives each running request (oldest first)
    a chunk of up to ``chunk_size`` of its uncomputed tokens within ``max_batch_tokens``.
    Requests execute preempts go back to the front of the queue and restart from 0;
    ``preempt_after[id] = k`` makes the scheduler preempt ``id`` once it has ``k`` outputs."""
    assert runner.info is not None
    eos = set(runner.info.eos_token_ids)
    waiting = collections.deque(_Tracked(request) for request in requests)
    running: list[_Tracked] = []
    registered: set[str] = set()
    to_preempt = dict(preempt_after or {})
    finished: list[str] = []
    preempted: list[str] = []
    outputs: dict[str, list[int]] = {}
    results: list[StepResult] = []
    steps: list[SchedulerStep] = []
    for step_id in range(max_steps):
        if not waiting and not running:
            break
        while waiting and len(running) < max_running:
            running.append(waiting.popleft())
        new_requests = []
        chunks = []
        budget = max_batch_tokens
        for tracked in running:
            request_id = tracked.request.request_id
            if request_id not in registered:
                registered.add(request_id)
                new_requests.append(tracked.request)
            size = min(tracked.num_tokens - tracked.computed, chunk_size, budget)
            if size > 0:
                chunks.append(ScheduledChunk(request_id, tracked.computed, size))
                budget -= size
        step = SchedulerStep(
            step_id, tuple(new_requests), tuple(chunks), tuple(finished), tuple(preempted)
        )
        finished, preempted = [], []
        result = runner.execute(step)
        steps.append(step)
        results.append(result)
        by_id = {tracked.request.request_id: tracked for tracked in running}
        for chunk in chunks:
            tracked = by_id[chunk.request_id]
            if chunk.request_id in result.preempted:
                tracked.computed = 0
                running.remove(tracked)
                waiting.appendleft(tracked)
                continue
            end = chunk.start + chunk.num_tokens
            tracked.computed = max(end, result.cached_tokens.get(chunk.request_id, 0))
        for request_id, token_id in zip(result.request_ids, result.token_ids, strict=True):
            tracked = by_id[request_id]
            tracked.outputs.append(token_id)
            params = tracked.request.params
            done = len(tracked.outputs) >= params.max_tokens or (
                token_id in eos and not params.ignore_eos
            )
            if done:
                running.remove(tracked)
                finished.append(request_id)
                outputs[request_id] = tracked.outputs
            elif to_preempt.get(request_id) == len(tracked.outputs):
                del to_preempt[request_id]
                running.remove(tracked)
                tracked.computed = 0
                waiting.append(tracked)
                preempted.append(request_id)
    else:
        raise AssertionError(f"requests did not finish in {max_steps} steps")
    if finished:
        results.append(runner.execute(SchedulerStep(max_steps, finished=tuple(finished))))
    return DriveReport(outputs, results, steps)


class HFReference:
    """Per-request greedy ``generate`` of the plain HF model (no batching), memoized."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            with torch.inference_mode():
                generated = self.model.generate(
                    torch.tensor([list(prompt)]),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tokens = generated.sequences[0, len(prompt) :].tolist()
            for step, logits in enumerate(generated.logits):
                top = torch.topk(logits[0].float(), 2).values
                margin = (top[0] - top[1]).item()
                assert margin > MIN_REFERENCE_MARGIN, (
                    f"reference near-tie at output {step} (margin {margin:.2e}): pick prompts "
                    "or a seed with separated logits rather than loosening the check"
                )
            self._check_routing([*prompt, *tokens[:-1]])
            self._memo[key] = tokens
        return self._memo[key]

    def _check_routing(self, sequence: Sequence[int]) -> None:
        """For a mixture of experts, every routing choice over ``sequence`` (the prompt and
        the tokens fed back) must be apart from the next expert by more than float noise."""
        chosen = getattr(self.model.config, "num_experts_per_tok", None)
        if not chosen:
            return
        with torch.inference_mode():
            routed = self.model(torch.tensor([list(sequence)]), output_router_logits=True)
        for layer, logits in enumerate(routed.router_logits):
            top = torch.topk(logits.float().reshape(len(sequence), -1), chosen + 1).values
            gaps = top[:, chosen - 1] - top[:, chosen]
            position = int(gaps.argmin())
            assert gaps[position] > MIN_ROUTER_MARGIN, (
                f"reference routing near-tie in layer {layer} at position {position} (gap "
                f"{gaps[position].item():.2e}): pick prompts or a seed that route apart"
            )
