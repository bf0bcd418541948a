"""The ``actorline`` command line.

Subcommands: ``generate`` (stream an answer), ``serve`` (the gRPC Generation service),
``bench`` (benchmarks), ``plugins`` (installed components per plugin group), ``models``
(prepare a model: convert and verify its cache, ``--force`` rebuilds it), ``demo`` (the
Collatz demo pipeline). Every failure prints one clear line to stderr and exits with a non-zero
status.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from pipeline.cli import bench as bench_commands
from pipeline.cli import llm as llm_commands
from pipeline.cli.errors import CliError

__all__ = ["build_parser", "main"]

Command = Callable[[argparse.Namespace], int]


def _plugins(args: argparse.Namespace) -> int:
    import plugins

    conflicts = {(c.group, c.name): c for c in plugins.conflicts()}
    for group, entries in plugins.describe().items():
        print(f"{group}  ({plugins.GROUPS[group].description})")
        targets = dict(entries)
        names = sorted(targets.keys() | {name for g, name in conflicts if g == group})
        for name in names:
            conflict = conflicts.get((group, name))
            if name in targets:
                print(f"  {name:<12} {targets[name]}")
            if conflict is None:
                continue
            if conflict.ambiguous:
                print(f"  {name:<12} AMBIGUOUS, not loadable: " + " / ".join(conflict.others))
            else:
                for other in conflict.others:
                    print(f"  {name:<12} {other}: shadowed by the built-in")
        if not names:
            print("  (none)")
    return 0


def _models(args: argparse.Namespace) -> int:
    from stages.models import ModelError, resolve_model

    try:
        # NOTE: every cached file hashed, not only those whose stat changed (a deliberate
        # command can afford it: 0.4 s for the default model)
        resolved = resolve_model(args.model, rebuild=args.force, verify_all=True)
    except ModelError as exc:
        raise CliError(str(exc), 2) from exc
    print(f"{resolved.name}: {resolved.path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pipeline.demo import Job, collatz_pipeline
    from pipeline.runtime.caller import Caller

    async def run() -> None:
        pipeline = collatz_pipeline()
        if args.transport != "memory":
            pipeline.place("step", "worker")
        print(pipeline.describe())
        transport = "zmq" if args.transport == "memory" else args.transport
        async with await pipeline.start(
            transport=transport, compression=args.compression
        ) as running:
            caller = Caller(running, "jobs", "results", key=lambda m: m.job_id)
            values = tuple(range(1, args.count + 1))
            result = await caller.call(Job("demo", values))
            for value, steps in zip(values, result.steps.tolist()):
                print(f"collatz({value}) reaches 1 in {steps} steps")
            await caller.aclose()

    asyncio.run(run())
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors, like every other bad input of the CLI (argparse's
    own prints the whole usage block first). Subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``actorline`` command line's parser, every command and its flags (what :func:`main`
    parses; the deploy test checks the manifests' commands against it). Given the
    ``command`` a command line runs, a command other than ``bench`` gets ``bench`` by name
    and help only (see :func:`pipeline.cli.bench.add_placeholder`)."""
    parser = _Parser(
        prog="actorline", description="actorline: LLM inference as a pipeline of actors."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plugins_parser = commands.add_parser("plugins", help="list installed plugins per group")
    plugins_parser.set_defaults(run=_plugins)

    models = commands.add_parser("models", help="manage models")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    prepare = models_commands.add_parser(
        "prepare", help="resolve a model (convert and cache a GGUF) and print its directory"
    )
    prepare.add_argument("model", nargs="?", default="smollm2-135m")
    prepare.add_argument(
        "--force",
        action="store_true",
        help="convert a GGUF model again, replacing its cache (a corrupt one included)",
    )
    prepare.set_defaults(run=_models)

    demo = commands.add_parser("demo", help="run the Collatz demo pipeline")
    demo.add_argument("--transport", default="zmq", choices=("memory", "zmq", "grpc"))
    demo.add_argument("--compression", default=None, choices=("zstd",))
    demo.add_argument("--count", type=int, default=10)
    demo.set_defaults(run=_demo)

    llm_commands.add_commands(commands)
    if command is None or command == "bench":
        bench_commands.add_commands(commands)
    else:
        bench_commands.add_placeholder(commands)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs (its first argument, the top level having no options but
    ``--help``), or None when it starts with an option."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(arguments))
    args = parser.parse_args(arguments)
    run: Command = args.run
    try:
        return run(args)
    except CliError as exc:
        print(f"actorline: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print("actorline: interrupted", file=sys.stderr)
        return 130
