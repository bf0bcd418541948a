"""What speculative decoding costs where nothing is accepted (docs/speculative.md, "Where
nothing is accepted"): one request's decode steps through a real :class:`ModelRunner`, in one
process, ``--steps`` plain one-row steps against ``--steps`` steps whose drafts the proposer's
back-off (:class:`stages.speculative.Backoff` with :data:`PROPOSER_FREE_MISSES`) lets through,
every draft ``k`` tokens that are all rejected (an id the model does not choose), the two
alternated in every round, best and median of ``--rounds``. Both yield one token a step, so the
ratio of their times is the speed-up (below 1: the loss) of a stream whose every draft misses,
for its execute stage alone (the rest of a step costs the same with and without; a whole stream
loses less). On a loaded machine the rounds' totals drift; it also prints the median one-row
and drafted step, weighed by the share of drafted steps (the steadier figure).

    python -m benchmarks.spec_miss_cost --steps 100 --rounds 5 --k 4 --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["MissCostConfig", "add_arguments", "format_miss_cost", "main", "run_miss_cost"]


@dataclasses.dataclass(frozen=True, slots=True)
class MissCostConfig:
    """The model and dtype, the steps per variant and round, the rounds and the draft length.

    Raises:
        ValueError: a count below 1.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    steps: int = 100
    rounds: int = 5
    k: int = 4

    def __post_init__(self) -> None:
        if min(self.steps, self.rounds, self.k) < 1:
            raise ValueError("steps, rounds and k must be >= 1")


def run_miss_cost(config: MissCostConfig) -> dict[str, Any]:
    """Both variants alternated (see the module docstring); the result as JSON-ready data:
    per variant the seconds of each round, and the drafted steps and accepted tokens."""
    from pipeline.bench.workload import WorkloadSpec, make_workload, prompt_ids
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner
    from stages.messages import EngineRequest, ScheduledChunk, SchedulerStep
    from stages.params import SamplingParams
    from stages.speculative import PROPOSER_FREE_MISSES, Backoff
    from stages.tokenize import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    prompt = tuple(prompt_ids(tokenizer, make_workload(WorkloadSpec(num_requests=2))[1].prompt))
    runner = ModelRunner(ExecuteConfig(model=config.model, dtype=config.dtype))
    runner.load()
    assert runner.info is not None
    wrong = runner.info.vocab_size - 1  # an id no greedy step of the model picks here
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    step = 1
    runner.execute(
        SchedulerStep(
            step,
            new_requests=(EngineRequest("r", prompt, params),),
            chunks=(ScheduledChunk("r", 0, len(prompt)),),
        )
    )
    position = len(prompt)
    seconds: dict[str, list[float]] = {"plain": [], "drafts missing": []}
    step_seconds: dict[str, list[float]] = {"one row": [], "drafted": []}
    drafted = accepted = 0
    for index in range(config.rounds):
        order = list(seconds) if index % 2 == 0 else list(reversed(seconds))
        for variant in order:
            backoff = Backoff(PROPOSER_FREE_MISSES)
            start = time.perf_counter()
            for _ in range(config.steps):
                step += 1
                draft: tuple[int, ...] = ()
                if variant != "plain" and not backoff.skips("r"):
                    draft = (wrong,) * config.k
                chunk = ScheduledChunk("r", position, 1 + len(draft), draft)
                began = time.perf_counter()
                result = runner.execute(SchedulerStep(step, chunks=(chunk,)))
                step_seconds["drafted" if draft else "one row"].append(time.perf_counter() - began)
                taken = len(result.accepted_token_ids.get("r", ()))
                if draft:
                    backoff.observe("r", taken)
                    drafted += 1
                    accepted += taken
                position += 1 + taken
            seconds[variant].append(time.perf_counter() - start)
    plain, missing = seconds["plain"], seconds["drafts missing"]
    # NOTE: the rounds' totals drift with a loaded machine's load; the median step of each
    # kind, weighed by how many of each the back-off lets through, is steadier
    one_row = statistics.median(step_seconds["one row"])
    drafted_row = statistics.median(step_seconds["drafted"])
    share = drafted / (config.rounds * config.steps)
    return {
        "config": dataclasses.asdict(config),
        "seconds": seconds,
        "drafted_steps": drafted,
        "accepted_tokens": accepted,
        "ratio_best": min(plain) / min(missing),
        "ratio_median": statistics.median(plain) / statistics.median(missing),
        "one_row_step_ms": 1000 * one_row,
        "drafted_step_ms": 1000 * drafted_row,
        "ratio_from_steps": one_row / ((1 - share) * one_row + share * drafted_row),
    }


def format_miss_cost(result: dict[str, Any]) -> str:
    """Each variant's rounds, and the ratios."""
    config = result["config"]
    lines = [
        f"{config['model']} {config['dtype']}: {config['steps']} decode steps per variant and "
        f"round, drafts of {config['k']} rejected tokens where the back-off lets them"
    ]
    for variant, rounds in result["seconds"].items():
        lines.append(f"  {variant}: " + " ".join(f"{s:.2f}" for s in rounds) + " s")
    lines.append(
        f"  {result['drafted_steps']} drafted steps in all, {result['accepted_tokens']} tokens "
        f"accepted; speed with / without drafts: best {result['ratio_best']:.3f}x, median "
        f"{result['ratio_median']:.3f}x"
    )
    lines.append(
        f"  median steps: one row {result['one_row_step_ms']:.1f} ms, drafted "
        f"{result['drafted_step_ms']:.1f} ms; weighed by the back-off's share of drafted steps: "
        f"{result['ratio_from_steps']:.3f}x"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement's options."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=100, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--k", type=int, default=4, help="tokens per (rejected) draft")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = MissCostConfig(
            model=args.model,
            dtype=args.dtype,
            steps=10 if args.quick else args.steps,
            rounds=2 if args.quick else args.rounds,
            k=args.k,
        )
    except ValueError as error:
        parser.error(str(error))
    result = run_miss_cost(config)
    print(json.dumps(result) if args.json else format_miss_cost(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
