"""Printing benchmark results: plain-text tables and JSON, and the options every benchmark
shares (``--json``, ``--quick``, ``--model``, ``--profile``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "add_common_arguments",
    "add_ray_arguments",
    "asks_for_ray",
    "format_rate",
    "format_table",
    "print_result",
    "run_main",
    "to_json",
]


def add_common_arguments(parser: argparse.ArgumentParser, *, profile: bool = True) -> None:
    """``--model``, ``--quick``, ``--json`` and (optionally) ``--profile``."""
    from pipeline.engine.option_fields import add_option_argument
    from pipeline.engine.options import EngineOptions

    add_option_argument(parser, EngineOptions, "model")
    parser.add_argument(
        "--quick", action="store_true", help="a small run for smoke tests (numbers not meaningful)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    if profile:
        parser.add_argument(
            "--profile",
            action="store_true",
            help="print where the time goes per stage (from the pipeline's statistics)",
        )


def add_ray_arguments(parser: argparse.ArgumentParser, *, help: str) -> None:
    """``--ray [ADDRESS]`` (``help``: what the benchmark does on Ray) and
    ``--ray-auth-token-file``."""
    from pipeline.engine.option_fields import add_option_argument
    from pipeline.engine.options import EngineOptions

    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help=help)
    add_option_argument(parser, EngineOptions, "ray_auth_token_file")


def asks_for_ray(args: argparse.Namespace) -> bool:
    """Whether the options of :func:`add_ray_arguments` ask for a run on Ray.

    Raises:
        ValueError: ``--ray-auth-token-file`` without ``--ray``.
    """
    if args.ray is None and args.ray_auth_token_file is not None:
        raise ValueError("--ray-auth-token-file is the token of a Ray cluster: give --ray too")
    return args.ray is not None


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str = ""
) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(value) for value in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(cells[0]))
    out.append("  ".join("-" * width for width in widths))
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def format_rate(value: float) -> str:
    """Tokens per second for prose: ``12,345 tok/s``."""
    return f"{value:,.0f} tok/s"


def to_json(result: Any) -> str:
    """A dataclass result as indented JSON (NaN written as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(dataclasses.asdict(result)), indent=2)


def print_result(result: Any, text: str, as_json: bool) -> None:
    """Print ``result`` as JSON, or its readable ``text``."""
    print(to_json(result) if as_json else text, flush=True)


def run_main(
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run_from_args: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """A benchmark's ``main``: its parser (described by the first line of ``doc``), then run.

    Returns:
        The exit status ``run_from_args`` gives.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
