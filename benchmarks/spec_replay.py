"""How many steps speculative decoding's proposer would save, without timing anything
(docs/speculative.md, "Tuning the n-gram proposer"): the latency bench's prompts (``--prompts
chat|copy``, :mod:`pipeline.bench.latency`) are answered once, greedy with ``ignore_eos``,
without speculation; then each ``--speculative-config`` is replayed over those answers with the
scheduler's own :class:`stages.speculative.Speculator` (its proposer and back-off): a step drafts
what the speculator proposes for the tokens so far, the draft's longest prefix equal to the
answer is accepted, and the step yields it plus one token. A greedy answer is the same with and
without speculation (tests/pipeline/engine/test_speculative.py), so the step counts are exact,
and a loaded machine cannot blur them.

Per config it prints the decode steps against the tokens (the first token comes from the
prompt's pass, as in the bench), the bound that step count puts on the speed-up, the drafted
steps and the acceptance rate, and the bound per prompt (prompt 1 is the latency bench's one
stream). ``--row-cost C`` also prints an estimate with each drafted row costing ``C`` of a
one-row step (0.02 on this machine kind, quiet: a 5-row step is ~1.07x a one-row step).

    python -m benchmarks.spec_replay --prompts copy --count 8 --tokens 256 \\
        --speculative-config '{"num_speculative_tokens": 4, "prompt_lookup_max": 5,
                               "prompt_lookup_min": 5}' \\
        --speculative-config '{"num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from stages.speculative import SpeculativeConfig, Speculator, parse_speculative_config

__all__ = [
    "Replay",
    "ReplayConfig",
    "add_arguments",
    "format_replay",
    "main",
    "replay",
    "run_replay",
]

_REQUEST = "replayed"


@dataclasses.dataclass(frozen=True, slots=True)
class Replay:
    """One answer replayed: its decode ``tokens`` (after the first) in ``steps``, of which
    ``drafted_steps`` verified a draft, with the draft and accepted tokens, and the drafted
    rows (each drafted step's draft length) summed for the cost estimate."""

    tokens: int
    steps: int
    drafted_steps: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def bound(self) -> float:
        """The speed-up the step count allows: tokens per step (1 without speculation)."""
        return self.tokens / self.steps if self.steps else 1.0

    def estimate(self, row_cost: float) -> float:
        """The speed-up with each drafted row costing ``row_cost`` of a one-row step."""
        cost = self.steps + row_cost * self.draft_tokens
        return self.tokens / cost if cost else 1.0


def replay(config: SpeculativeConfig, prompt: Sequence[int], answer: Sequence[int]) -> Replay:
    """``answer`` (greedy, the first token from the prompt's pass) decoded again with ``config``'s
    proposer and back-off, as the scheduler drafts: at most ``max_tokens`` left - 1 tokens.

    Raises:
        ValueError: ``config`` is ``draft_model`` (no proposer to replay).
        plugins.PluginError: its proposer does not load.
    """
    if config.drafts_in_execute:
        raise ValueError("spec_replay replays a proposer; draft_model drafts in execute")
    speculator = Speculator(config)
    tokens = [*prompt, *answer[:1]]
    done = min(1, len(answer))
    steps = drafted = 0
    while done < len(answer):
        limit = len(answer) - done - 1
        draft = speculator.propose(_REQUEST, tokens, limit) if limit >= 1 else ()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        if draft:
            speculator.observe(_REQUEST, len(draft), accepted)
            drafted += 1
        steps += 1
        tokens.extend(answer[done : done + accepted + 1])
        done += accepted + 1
    stats = speculator.stats()
    return Replay(
        max(0, len(answer) - 1),
        steps,
        drafted,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The prompts (the latency bench's ``chat`` or ``copy``, the first ``count``), the tokens
    answered per prompt, the configs replayed (their JSON), the model and the row cost.

    Raises:
        ValueError: a bad count, kind, row cost or config.
    """

    speculative_configs: tuple[str, ...]
    prompts: str = "copy"
    count: int = 8
    tokens: int = 256
    model: str = "smollm2-135m"
    row_cost: float | None = None

    def __post_init__(self) -> None:
        from pipeline.bench.latency import PROMPT_KINDS

        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}")
        if self.count < 1 or self.tokens < 2:
            raise ValueError("count must be >= 1 and tokens >= 2")
        if self.row_cost is not None and self.row_cost < 0:
            raise ValueError(f"row_cost must be >= 0, got {self.row_cost}")
        if not self.speculative_configs:
            raise ValueError("give at least one --speculative-config")
        for text in self.speculative_configs:
            parsed = parse_speculative_config(text)
            if parsed is None or parsed.drafts_in_execute:
                raise ValueError(f"{text!r}: spec_replay replays a proposer, not draft_model")


def _answers(config: ReplayConfig) -> tuple[list[list[int]], list[list[int]]]:
    from pipeline.bench.latency import copy_prompts
    from pipeline.bench.workload import WorkloadSpec, make_workload, prompt_ids
    from pipeline.engine.llm import LLM
    from stages.params import SamplingParams
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    texts = [r.prompt for r in make_workload(WorkloadSpec(num_requests=config.count, seed=0))]
    if config.prompts == "copy":
        texts = copy_prompts(texts)
    prompts = [prompt_ids(tokenizer, text) for text in texts]
    params = SamplingParams(temperature=0.0, max_tokens=config.tokens, ignore_eos=True)
    with LLM(config.model) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [list(output.token_ids) for output in outputs]


def run_replay(
    config: ReplayConfig, answered: tuple[list[list[int]], list[list[int]]] | None = None
) -> dict[str, Any]:
    """Answer the prompts (or take ``answered``: prompts and answers) and replay each config;
    the result as JSON-ready data."""
    prompts, answers = answered if answered is not None else _answers(config)
    rows = []
    for text in config.speculative_configs:
        spec = parse_speculative_config(text)
        assert spec is not None
        runs = [replay(spec, prompt, answer) for prompt, answer in zip(prompts, answers)]
        total = Replay(*(sum(getattr(r, f.name) for r in runs) for f in dataclasses.fields(Replay)))
        rows.append(
            {
                "config": spec.to_json(),
                "tokens": total.tokens,
                "steps": total.steps,
                "drafted_steps": total.drafted_steps,
                "draft_tokens": total.draft_tokens,
                "accepted_tokens": total.accepted_tokens,
                "bound": total.bound,
                "estimate": None if config.row_cost is None else total.estimate(config.row_cost),
                "per_prompt": [r.bound for r in runs],
            }
        )
    return {"prompts": config.prompts, "count": len(prompts), "rows": rows}


def format_replay(result: dict[str, Any]) -> str:
    """One block per config: steps, bound, drafted steps, acceptance, per-prompt bounds."""
    lines = [f"{result['count']} {result['prompts']} prompts, greedy answers replayed"]
    for row in result["rows"]:
        rate = row["accepted_tokens"] / row["draft_tokens"] if row["draft_tokens"] else 0.0
        estimate = "" if row["estimate"] is None else f", estimate {row['estimate']:.2f}x"
        lines.append(
            f"{row['config']}\n  {row['steps']} steps for {row['tokens']} tokens: bound "
            f"{row['bound']:.2f}x{estimate}; {row['drafted_steps']} drafted steps, acceptance "
            f"{rate:.2f}; per prompt " + " ".join(f"{b:.2f}" for b in row["per_prompt"])
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay's options."""
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON")
    parser.add_argument("--prompts", default="copy", help="chat or copy (the latency bench's)")
    parser.add_argument("--count", type=int, default=8, help="prompts answered (8)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per answer (256)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--row-cost", type=float, default=None, help="a drafted row's cost")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quick", action="store_true", help="2 prompts of 24 tokens")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = ReplayConfig(
            tuple(args.speculative_config) or ('{"num_speculative_tokens": 4}',),
            prompts=args.prompts,
            count=2 if args.quick else args.count,
            tokens=24 if args.quick else args.tokens,
            model=args.model,
            row_cost=args.row_cost,
        )
    except ValueError as error:
        parser.error(str(error))
    result = run_replay(config)
    print(json.dumps(result) if args.json else format_replay(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
