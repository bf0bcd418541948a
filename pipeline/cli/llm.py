"""The LLM subcommands of the ``actorline`` CLI (generate, serve)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pipeline.cli.errors import CliError

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from pipeline.engine.options import EngineOptions
    from stages.messages import RequestOutput

__all__ = [
    "EXIT_BROKEN_PIPE",
    "add_commands",
    "add_engine_arguments",
    "engine_options_from",
    "sampling_from",
    "structured_outputs_from",
]

#: the largest TCP port number
_MAX_PORT = 65535
#: the exit status of ``generate`` when stdout is closed under it: a process killed by
#: SIGPIPE reports 128 + SIGPIPE to the shell
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def add_engine_arguments(parser: argparse.ArgumentParser, command: str = "generate") -> None:
    """The flags of the engine options ``command`` takes (``generate``: those of every command
    that runs an engine; ``serve``: its own besides), derived from the fields of
    :class:`~pipeline.engine.options.EngineOptions` (docs/options.md)."""
    from pipeline.engine.option_fields import add_option_arguments
    from pipeline.engine.options import EngineOptions

    add_option_arguments(parser, EngineOptions, command)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--ignore-eos", action="store_true")
    group = parser.add_argument_group(
        "structured outputs (one of them; see docs/structured-outputs.md)"
    )
    group.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="JSON without whitespace between tokens",
    )
    group.add_argument(
        "--disable-additional-properties",
        action="store_true",
        help="a schema's objects with properties but no additionalProperties allow no other keys",
    )
    structured = group.add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", metavar="FILE", default=None, help="the answer is JSON valid under it"
    )
    structured.add_argument(
        "--json-object", action="store_true", help="the answer is a JSON object"
    )
    structured.add_argument("--regex", default=None, help="the answer matches this regex")
    structured.add_argument(
        "--choice", action="append", default=None, help="the answer is one of these (repeatable)"
    )
    structured.add_argument(
        "--grammar",
        metavar="FILE",
        default=None,
        help="the answer is a sentence of this Lark or GBNF grammar",
    )


def engine_options_from(args: argparse.Namespace, command: str = "serve") -> dict[str, Any]:
    """The EngineOptions keyword arguments the engine flags parsed into ``args`` give (those
    of ``command`` that ``args`` has: a parser of ``generate`` has no serve-only flag)."""
    from pipeline.engine.option_fields import flag_values
    from pipeline.engine.options import EngineOptions

    return flag_values(args, EngineOptions, command)


def structured_outputs_from(args: argparse.Namespace) -> Any:
    """The StructuredOutputsParams the options ask for (None: no constraint).

    Raises:
        InvalidRequestError: a schema or grammar file that cannot be read, naming the option.
    """
    from stages.errors import InvalidRequestError
    from stages.structured.params import StructuredOutputsParams

    def read(option: str, path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(
                f"{option} {path}: cannot be read ({exc})", field=option
            ) from None

    compact = bool(getattr(args, "disable_any_whitespace", False))
    if getattr(args, "json_schema", None) is not None:
        return StructuredOutputsParams(
            json=read("--json-schema", args.json_schema),
            disable_any_whitespace=compact,
            disable_additional_properties=bool(
                getattr(args, "disable_additional_properties", False)
            ),
        )
    if getattr(args, "grammar", None) is not None:
        return StructuredOutputsParams(grammar=read("--grammar", args.grammar))
    if getattr(args, "regex", None) is not None:
        return StructuredOutputsParams(regex=args.regex)
    if getattr(args, "choice", None):
        return StructuredOutputsParams(choice=tuple(args.choice))
    if getattr(args, "json_object", False):
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    return None


def sampling_from(args: argparse.Namespace) -> Any:
    from stages.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_outputs_from(args),
    )


def preflight(args: argparse.Namespace, **extra_options: Any) -> tuple[EngineOptions, Any, Any]:
    """Check the model and the parameters before starting anything (clear one-line errors).
    Commands without sampling options (serve) get None for the parameters. ``extra_options``:
    more EngineOptions fields (serve's rate limits, ...).

    Returns:
        The engine options, the sampling parameters and the resolved model.
    Raises:
        CliError: with status 2 for bad input.
    """
    import plugins
    from pipeline.engine.options import EngineOptions
    from pipeline.engine.presets import check_parallelism, llm_pipeline
    from stages.errors import InvalidRequestError
    from stages.models import ModelError, resolve_model
    from stages.params import validate_sampling
    from stages.policies import load_policy

    try:
        options = EngineOptions.create(**engine_options_from(args), **extra_options)
        # NOTE: building the pipeline builds every stage's config as the engine will
        # (ExecuteConfig: device, KV cache sizes, max_model_len; the scheduler's and admit's),
        # each validated in its __post_init__, without loading the model.
        llm_pipeline(options)
        params = sampling_from(args) if hasattr(args, "max_tokens") else None
        if params is not None:
            validate_sampling(params)
        load_policy(args.scheduler)  # imported and constructed, as the engine will
        resolved = resolve_model(args.model)
        check_parallelism(options)
        if options.quantization == "gguf" and resolved.gguf is None:
            raise ValueError(
                "quantization 'gguf' runs a GGUF file's own weights, and "
                f"{args.model!r} is an HF checkpoint; use a .gguf model or --quantization int8"
            )
    except (ModelError, InvalidRequestError, ValueError, TypeError, plugins.PluginError) as exc:
        raise CliError(_config_message(exc), 2) from exc
    return options, params, resolved


def _config_message(error: BaseException) -> str:
    """The one-line message for a bad option: a stage config's error names the field alone
    (``device must be ...``), as the other option errors do, not the config class."""
    message = str(error)
    field = getattr(error, "field", None)
    if isinstance(field, str):
        prefix, dot, rest = message.partition(f".{field} ")
        if dot and prefix.isidentifier() and prefix.endswith("Config"):
            return f"{field} {rest}"
    return message


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of what is still buffered
    does not fail on the closed pipe again (the recipe of Python's ``signal`` docs, "Note on
    SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _prespawn_engine(args: argparse.Namespace) -> None:
    """Start the engine process now, importing torch and transformers while this one imports
    and checks its own side (pipeline.runtime.prespawn); the engine takes it when it starts.
    Also start loading the tokenizer here, on a thread (stages.tokenize.prefetch_tokenizer),
    instead of after the engine process is up. Not with ``--ray``: the engine's hosts are
    Ray actors then, and a local one would wait unused until exit."""
    from pipeline.runtime.omp_policy import OMP_WAIT_POLICIES, POLICY_ENV, apply_omp_policy

    policy = getattr(args, "omp_wait_policy", "auto")
    # memory: one process, no engine host
    if getattr(args, "transport", "zmq") != "memory" and getattr(args, "ray", None) is None:
        from pipeline.engine.presets import engine_preload
        from pipeline.runtime.prespawn import prespawn_host

        preload = engine_preload(args.model, getattr(args, "model_impl", "auto"))
        with contextlib.suppress(OSError):  # the engine then starts its host as usual
            prespawn_host(preload, ((POLICY_ENV, policy),))
    elif policy in OMP_WAIT_POLICIES:  # the engine runs here: before torch is imported
        apply_omp_policy(policy)
    from stages.tokenize import prefetch_tokenizer

    prefetch_tokenizer(args.model)


def _generate(args: argparse.Namespace) -> int:
    _prespawn_engine(args)
    from pipeline.engine.async_engine import AsyncEngine
    from pipeline.engine.prompts import check_prompt
    from pipeline.runtime.errors import PipelineError
    from pipeline.runtime.ray_connection import RayConnectionError
    from stages.errors import RequestError
    from stages.models import has_chat_template

    prompt = args.prompt
    if not isinstance(prompt, str) or not prompt:
        raise CliError("the prompt is empty", 2)
    options, params, resolved = preflight(args)
    chat = not args.no_chat_template and has_chat_template(resolved.path)
    try:  # the validation core of every front end, once, before the engine starts
        checked = check_prompt(prompt, params, chat_template=chat)
    except RequestError as exc:
        raise CliError(str(exc), 2) from exc

    async def run() -> None:
        async with AsyncEngine(options=options) as engine:
            # NOTE: aclosing: a write that fails (stdout closed) ends the stream at once,
            # which aborts the request in the engine.
            outputs = cast(
                "AsyncGenerator[RequestOutput, None]",
                engine.generate(checked),  # checked above: not again
            )
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    sys.stdout.write(output.delta)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()

    try:
        asyncio.run(run())
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, with the status of a process
        # killed by SIGPIPE, as the shell tools in the pipeline do.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (RequestError, RayConnectionError) as exc:
        raise CliError(str(exc), 2) from exc
    except PipelineError as exc:
        raise CliError(str(exc), 1) from exc
    return 0


def _front_end_ports(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The gRPC and HTTP ports asked for (None: that front end is off): ``--grpc-port`` (or
    its old name ``--port``) and ``--http-port``; with neither, gRPC on the default port;
    with only ``--http-port``, HTTP alone.

    Raises:
        CliError: a port out of range, ``--port`` and ``--grpc-port`` both given, or the two
            front ends on the same port.
    """
    from pipeline.server.serve import DEFAULT_PORT

    if args.grpc_port is not None and args.port is not None:
        raise CliError("--port is the old name of --grpc-port; give one of them", 2)
    grpc_flag = "--grpc-port" if args.grpc_port is not None else "--port"
    grpc_port = args.grpc_port if args.grpc_port is not None else args.port
    for flag, port in (
        (grpc_flag, grpc_port),
        ("--http-port", args.http_port),
        ("--metrics-port", args.metrics_port),
    ):
        if port is not None and not 0 <= port <= _MAX_PORT:
            raise CliError(f"{flag} must be in [0, {_MAX_PORT}], got {port}", 2)
    if grpc_port is None and args.http_port is None:
        grpc_port = DEFAULT_PORT
    if grpc_port is not None and grpc_port == args.http_port and grpc_port != 0:
        raise CliError(f"{grpc_flag} and --http-port must differ, got {grpc_port} for both", 2)
    return grpc_port, args.http_port


def _serve(args: argparse.Namespace) -> int:
    _prespawn_engine(args)
    import logging

    from pipeline.runtime import settings
    from pipeline.runtime.errors import PipelineError
    from pipeline.runtime.ray_connection import RayConnectionError
    from pipeline.server.auth import ApiKeys
    from pipeline.server.serve import SERVICE_NAME, ServerTLS, serve

    grpc_port, http_port = _front_end_ports(args)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together", 2)
    if args.tls_client_ca and not args.tls_cert:
        raise CliError("--tls-client-ca needs --tls-cert and --tls-key", 2)
    for flag, limit in (
        ("--requests-per-second", args.requests_per_second),
        ("--tokens-per-second", args.tokens_per_second),
    ):
        if limit is not None and not limit > 0:
            raise CliError(f"{flag} must be > 0, got {limit}", 2)
    if not 0 < args.rate_limit_burst < math.inf:
        raise CliError(f"--rate-limit-burst must be > 0 seconds, got {args.rate_limit_burst}", 2)
    if not args.grace >= 0:
        raise CliError(f"--grace must be >= 0 seconds, got {args.grace}", 2)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise CliError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}", 2)
    limits = _listener_limits(args)
    from pipeline.server.lora_modules import LoRAModules

    try:
        lora_modules = LoRAModules.parse(args.lora_modules)
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    if lora_modules and not args.enable_lora:
        raise CliError("--lora-modules serves LoRA adapters: give --enable-lora too", 2)
    if settings.runtime_lora_updating() and not args.enable_lora_runtime_updates:
        if not args.enable_lora:
            raise CliError(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: runtime LoRA updates need --enable-lora",
                2,
            )
        args.enable_lora_runtime_updates = True
    try:
        api_keys = ApiKeys.load(args.api_key, args.api_key_file)
    except (OSError, ValueError) as exc:
        raise CliError(f"API keys: {exc}", 2) from exc
    try:
        lora_modules.check_bindings(
            api_keys.tenant_adapters().values(),
            args.enable_lora,
            args.enable_lora_runtime_updates,
        )
    except ValueError as exc:
        raise CliError(f"API keys: {exc}", 2) from exc
    try:
        tls = (
            ServerTLS.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
            if args.tls_cert
            else None
        )
    except (OSError, ValueError) as exc:
        raise CliError(str(exc), 2) from exc
    # NOTE: as vLLM, a port that cannot be had is an argument error before the model loads
    # (a probe: another process could still take the port in between, then serve fails).
    if grpc_port is not None:
        _check_listenable("--grpc-port" if args.grpc_port is not None else "--port", args.host,
                          grpc_port)  # fmt: skip
    if http_port is not None:
        _check_listenable("--http-port", args.host, http_port)
    if args.metrics_port is not None:
        _check_listenable("--metrics-port", args.metrics_host, args.metrics_port)
    engine_options, _, _ = preflight(args, tenant_limits=api_keys.tenant_limits())
    logging.basicConfig(
        level=args.log_level or settings.log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    def ready(address: str) -> None:
        print(f"serving {SERVICE_NAME} on {address}", flush=True)

    def http_ready(url: str) -> None:
        print(f"serving OpenAI-compatible API on {url}", flush=True)

    def metrics_ready(url: str) -> None:
        print(f"metrics on {url}", flush=True)

    try:
        asyncio.run(
            serve(
                engine_options,
                host=args.host,
                port=grpc_port,
                http_port=http_port,
                api_keys=api_keys,
                tls=tls,
                grace=args.grace,
                on_ready=ready,
                on_http_ready=http_ready,
                metrics_host=args.metrics_host,
                metrics_port=args.metrics_port,
                on_metrics_ready=metrics_ready,
                served_model_name=args.served_model_name,
                max_request_bytes=args.max_request_bytes,
                limits=limits,
                lora_modules=lora_modules,
            )
        )
    except RayConnectionError as exc:  # the cluster given refuses: an argument error
        raise CliError(str(exc), 2) from exc
    except (OSError, PipelineError) as exc:
        raise CliError(str(exc), 1) from exc
    return 0


def _listener_limits(args: argparse.Namespace) -> Any:
    """The :class:`~pipeline.server.limits.ListenerLimits` of the flags.

    Raises:
        CliError: a value out of range (exit 2), naming its flag.
    """
    from pipeline.engine.option_fields import flag_values
    from pipeline.server.limits import ListenerLimits

    try:
        return ListenerLimits(**flag_values(args, ListenerLimits, "serve"))
    except ValueError as exc:
        flag, _, rest = str(exc).partition(" ")
        raise CliError(f"--{flag.replace('_', '-')} {rest}", 2) from exc


def _check_listenable(flag: str, host: str, port: int) -> None:
    """Raise CliError (exit 2) unless a TCP socket can listen on ``host``:``port`` now."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise CliError(f"{flag}: cannot resolve host {host!r}: {exc}", 2) from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen()
        except OSError as exc:
            raise CliError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror}", 2) from exc


def _add_serve_command(commands: Any) -> None:
    from pipeline.server.http.defaults import DEFAULT_MAX_REQUEST_BYTES
    from pipeline.server.serve import DEFAULT_GRACE_SECONDS, DEFAULT_HOST, DEFAULT_PORT

    serve = commands.add_parser(
        "serve",
        help="serve the gRPC Generation service and/or the OpenAI-compatible HTTP API",
        description="Serve actorline.v1.Generation (with gRPC health and reflection) and/or "
        "the OpenAI-compatible HTTP API from one engine. Prints 'serving "
        "actorline.v1.Generation on HOST:PORT' and/or 'serving OpenAI-compatible API on "
        "URL' once ready; stops cleanly on SIGINT or SIGTERM.",
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    server.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help=f"gRPC port (0: pick a free one); the default, {DEFAULT_PORT}, unless only "
        "--http-port is given",
    )
    server.add_argument("--port", type=int, default=None, help="the old name of --grpc-port")
    server.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port (0: pick a free one); off by "
        "default",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the HTTP API (default: --model)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) the HTTP API serves as models of these names, "
        'as vLLM\'s: name=path or \'{"name": ..., "path": ...}\' (needs --enable-lora; '
        "docs/lora.md)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help=f"largest HTTP request body accepted; larger ones get 413 "
        f"(default {DEFAULT_MAX_REQUEST_BYTES}, 1 MiB)",
    )
    server.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        help="seconds in-flight calls get to end at shutdown",
    )
    server.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: pick a free "
        "port; prints 'metrics on URL' after the serving lines); off by default (the HTTP "
        "API serves them at /metrics too)",
    )
    server.add_argument(
        "--metrics-host", default=DEFAULT_HOST, help="address the metrics endpoint listens on"
    )
    from pipeline.engine.option_fields import add_option_arguments
    from pipeline.server.limits import ListenerLimits

    add_option_arguments(serve, ListenerLimits, "serve")
    auth = serve.add_argument_group("authentication and limits")
    auth.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key (repeatable; visible in the process list, so prefer a file)",
    )
    auth.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        help="file of API keys, one per line: KEY [REQUESTS_PER_SECOND TOKENS_PER_SECOND]",
    )
    tls = serve.add_argument_group("TLS")
    tls.add_argument("--tls-cert", default=None, help="PEM certificate chain of the server")
    tls.add_argument("--tls-key", default=None, help="PEM private key of the server")
    tls.add_argument(
        "--tls-client-ca", default=None, help="PEM CA that client certificates must chain to"
    )
    add_engine_arguments(serve, "serve")
    serve.set_defaults(run=_serve)


def add_commands(commands: Any) -> None:
    generate = commands.add_parser("generate", help="stream an answer to a prompt")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--no-chat-template", action="store_true", help="send the prompt as raw text"
    )
    add_engine_arguments(generate)
    add_sampling_arguments(generate)
    generate.set_defaults(run=_generate)
    _add_serve_command(commands)
