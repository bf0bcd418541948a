"""Cold start: a whole process from the shell to its first token, actorline against plain HF,
alternating, a fresh process each time.

- actorline: ``actorline generate "Hi" --max-tokens 1`` (the installed command, its default
  zmq topology: a frontend and an engine process): seconds until the first byte of the answer
  reaches its stdout, and until it exits;
- plain HF: a fresh Python that imports transformers, loads the tokenizer and the model with
  ``from_pretrained`` from the same converted model directory, runs ``generate`` for one token
  and prints it: seconds until the printed token, and until it exits.

Rounds alternate (actorline, HF, actorline, HF, ...), so both see the same machine; the OS page
cache holds the model files for both after the first round. It prints every round, the median
of each and the ratio of the medians (target: actorline <= 0.75x HF to the first token).

    actorline bench coldstart [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.bench.report import add_common_arguments, format_table, print_result, run_main

__all__ = [
    "HF_SCRIPT",
    "TARGET_RATIO",
    "ColdStartConfig",
    "ColdStartResult",
    "ColdStartRun",
    "actorline_command",
    "add_arguments",
    "format_coldstart",
    "hf_command",
    "main",
    "run_coldstart",
    "run_from_args",
    "time_to_output",
]

TARGET_RATIO = 0.75
ACTORLINE = "actorline generate"
HF = "plain HF"
HF_SCRIPT = """\
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
inputs = tokenizer(sys.argv[2], return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=1, do_sample=False)
sys.stdout.write(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:]) or "?")
sys.stdout.flush()
"""
"""The plain HF program: what a user of transformers writes to get one token."""
_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True, slots=True)
class ColdStartConfig:
    """``rounds`` alternating runs of each program on ``prompt``.

    Raises:
        ValueError: fewer than one round, or an empty prompt.
    """

    model: str = "smollm2-135m"
    prompt: str = "Hi"
    rounds: int = 5

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if not self.prompt:
            raise ValueError("prompt must not be empty")


@dataclasses.dataclass(frozen=True, slots=True)
class ColdStartRun:
    """One process: seconds to its first output byte and to its exit, and the CPU seconds
    (user + system) it and every process it started used in all (on a loaded machine the CPU
    work, not the overlap, decides the wall time)."""

    system: str
    first_output_seconds: float
    exit_seconds: float
    cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ColdStartResult:
    """Every run in order, each system's medians and actorline's ratio to HF."""

    model: str
    runs: tuple[ColdStartRun, ...]
    medians: dict[str, float]
    ratio: float
    target_ratio: float
    load_average: tuple[float, float, float]


def actorline_command(model: str, prompt: str) -> list[str]:
    """``actorline generate PROMPT --max-tokens 1 --model MODEL`` as installed beside this
    interpreter (``python -m pipeline.cli`` where the script is not there)."""
    script = Path(sys.executable).with_name("actorline")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]
    return [*head, "generate", prompt, "--max-tokens", "1", "--model", model]


def hf_command(model_dir: Path, prompt: str) -> list[str]:
    """The plain HF program (:data:`HF_SCRIPT`) in a fresh interpreter."""
    return [sys.executable, "-c", HF_SCRIPT, str(model_dir), prompt]


def time_to_output(command: Sequence[str]) -> tuple[float, float, float]:
    """Run ``command``; seconds from its start to the first byte on its stdout and to its
    exit, and the CPU seconds of its process tree (the children it waited for included).

    Raises:
        RuntimeError: it printed nothing, failed or ran past the time limit.
    """
    # NOTE: stderr goes to a file, not a pipe: a full pipe would block the program while this
    # process waits on its stdout.
    with tempfile.TemporaryFile() as errors:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors)
        assert process.stdout is not None
        first = process.stdout.read(1)
        first_seconds = time.perf_counter() - began
        try:
            process.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise RuntimeError(f"{command[0]} ran past {_TIMEOUT_S:.0f} s") from None
        exit_seconds = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if process.returncode != 0 or not first:
            errors.seek(0)
            tail = errors.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{' '.join(command[:3])} failed ({process.returncode}): {tail}")
    return first_seconds, exit_seconds, cpu


def run_coldstart(config: ColdStartConfig) -> ColdStartResult:
    """Alternate the two programs ``rounds`` times (see the module docstring)."""
    from stages.models import resolve_model

    model_dir = resolve_model(config.model).path
    commands = {
        ACTORLINE: actorline_command(config.model, config.prompt),
        HF: hf_command(model_dir, config.prompt),
    }
    if shutil.which(commands[ACTORLINE][0]) is None:
        raise RuntimeError(f"cannot run {commands[ACTORLINE][0]}")
    load_average = os.getloadavg()
    runs: list[ColdStartRun] = []
    for _ in range(config.rounds):
        for system, command in commands.items():
            first, exit_seconds, cpu = time_to_output(command)
            runs.append(ColdStartRun(system, first, exit_seconds, cpu))
    medians = {
        system: statistics.median(r.first_output_seconds for r in runs if r.system == system)
        for system in commands
    }
    return ColdStartResult(
        model=config.model,
        runs=tuple(runs),
        medians=medians,
        ratio=medians[ACTORLINE] / medians[HF],
        target_ratio=TARGET_RATIO,
        load_average=load_average,
    )


def format_coldstart(result: ColdStartResult) -> str:
    """The readable report."""
    rows = [
        [
            f"{index // 2 + 1}",
            run.system,
            run.first_output_seconds,
            run.exit_seconds,
            run.cpu_seconds,
        ]
        for index, run in enumerate(result.runs)
    ]
    verdict = "met" if result.ratio <= result.target_ratio else "not met"
    lines = [
        format_table(
            ["round", "system", "first token s", "exit s", "CPU s"],
            rows,
            title=f"cold start, a whole process to its first token: {result.model}; load "
            f"average {result.load_average[0]:.2f} at start",
        ),
        ", ".join(f"median {name}: {value:.2f} s" for name, value in result.medians.items()),
        f"ratio actorline / plain HF (first token, medians): {result.ratio:.2f}x "
        f"(target <= {result.target_ratio}x: {verdict})",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cold-start benchmark's command-line options."""
    add_common_arguments(parser, profile=False)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (5)")
    parser.add_argument("--prompt", default="Hi")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options and print the result; the exit status."""
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    result = run_coldstart(ColdStartConfig(model=args.model, prompt=args.prompt, rounds=rounds))
    print_result(result, format_coldstart(result), args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``actorline bench coldstart``."""
    return run_main(__doc__, add_arguments, run_from_args, argv)
