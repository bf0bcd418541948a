"""What one client may hold on the servers' listeners: connections, how long a request's head
and body may take to arrive, how long an idle connection is kept, concurrent gRPC streams, and
how many logprobs one request may ask for, whether a request may bring its own chat template
(docs/serving.md, "Connection limits").

:class:`ListenerLimits` is one frozen value passed to ``serve()``, the HTTP server and the gRPC
server alike. Importable without uvicorn, FastAPI or gRPC (the CLI shows the defaults in its
help without loading the servers).

The connection cap is per listener, and it is lowered to what the process's file descriptor
limit (``RLIMIT_NOFILE``) can hold beside the engine's own descriptors
(:func:`connection_cap`): a server that runs out of descriptors cannot accept anyone, so the
cap refuses (or makes room) before the kernel does.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import Any

from pipeline.engine.option_fields import check_options, option
from stages.errors import InvalidRequestError
from stages.messages import ChatRendering
from stages.params import MAX_LOGPROBS

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_GRPC_IDLE_TIMEOUT",
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_KEEP_ALIVE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_LOGPROB_ENTRIES",
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_MAX_STREAMS_PER_CONNECTION",
    "LIMITS_GROUP",
    "MAX_EMBEDDING_INPUTS",
    "RESERVED_DESCRIPTORS",
    "ListenerLimits",
    "check_logprob_entries",
    "check_request_template",
    "connection_cap",
]

#: connections each listener holds at once (lowered to fit the descriptor limit)
DEFAULT_MAX_CONNECTIONS = 1000
#: seconds from a connection's opening (or the first byte of its next request) to the end of
#: the request head: HTTP headers, the gRPC handshake up to the client's HTTP/2 settings
DEFAULT_HEADER_TIMEOUT = 10.0
#: seconds from the end of an HTTP request head to the end of its body
DEFAULT_BODY_TIMEOUT = 30.0
#: seconds an HTTP connection is kept open between requests (uvicorn's default)
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0
#: seconds a gRPC connection with no call running is kept open (it is then sent GOAWAY; the
#: client reconnects on its next call)
DEFAULT_GRPC_IDLE_TIMEOUT = 60.0
#: concurrent gRPC calls on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS)
DEFAULT_MAX_STREAMS_PER_CONNECTION = 128
#: concurrent gRPC calls in all; more are RESOURCE_EXHAUSTED
DEFAULT_MAX_STREAMS = 1024
#: logprobs one request may ask for, counted as choices x max_tokens x (1 + top logprobs):
#: 2**20, a whole chat answer of about 60 MiB of JSON at the bound (64 choices of 780 tokens
#: with 20 alternatives each)
DEFAULT_MAX_LOGPROB_ENTRIES = 2**20
#: the inputs of one embeddings request, HTTP or gRPC (OpenAI's bound), each an engine request
MAX_EMBEDDING_INPUTS = 2048
#: descriptors kept for everything but the listeners' connections: the engine's links and
#: pipes, the model's files, the tokenizer, logs
RESERVED_DESCRIPTORS = 128


def _limit(default: float, kind: str, text: str) -> Any:
    """A field of :class:`ListenerLimits` and its ``actorline serve`` flag
    (:mod:`pipeline.engine.option_fields`)."""
    return option(default, help=text, kind=kind, commands=("serve",), group=LIMITS_GROUP)


#: the help group of the flags
LIMITS_GROUP = "connection limits (each listener; docs/serving.md)"


@dataclasses.dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The bounds of the HTTP and gRPC listeners (see the module docstring; each field's help
    says what it means, and is its ``actorline serve`` flag's: docs/options.md).

    Raises (from the constructor): ValueError for a count that is not an integer >= 1 or a
    timeout that is not a finite number > 0.
    """

    max_connections: int = _limit(
        DEFAULT_MAX_CONNECTIONS, "int>=1",
        "open connections; at the cap a new one closes the one that waited longest for a "
        "request (or is refused); lowered to fit `ulimit -n`",
    )  # fmt: skip
    header_timeout: float = _limit(
        DEFAULT_HEADER_TIMEOUT, "finite seconds>0",
        "seconds a request head (HTTP headers; gRPC handshake) may take to arrive",
    )  # fmt: skip
    body_timeout: float = _limit(
        DEFAULT_BODY_TIMEOUT, "finite seconds>0", "seconds an HTTP request body may take to arrive"
    )
    keep_alive_timeout: float = _limit(
        DEFAULT_KEEP_ALIVE_TIMEOUT, "finite seconds>0",
        "seconds an HTTP connection is kept open between requests",
    )  # fmt: skip
    grpc_idle_timeout: float = _limit(
        DEFAULT_GRPC_IDLE_TIMEOUT, "finite seconds>0",
        "seconds a gRPC connection with no call is kept open",
    )  # fmt: skip
    max_streams_per_connection: int = _limit(
        DEFAULT_MAX_STREAMS_PER_CONNECTION, "int>=1", "concurrent gRPC calls on one connection"
    )
    max_streams: int = _limit(
        DEFAULT_MAX_STREAMS, "int>=1", "concurrent gRPC calls in all; more are RESOURCE_EXHAUSTED"
    )
    max_logprob_entries: int = _limit(
        DEFAULT_MAX_LOGPROB_ENTRIES, "int>=1",
        "logprobs one request may ask for (choices x max_tokens x (1 + top logprobs)); more is "
        "400 / INVALID_ARGUMENT",
    )  # fmt: skip
    trust_request_chat_template: bool = option(
        False, kind="bool", commands=("serve",), group=LIMITS_GROUP,
        help="accept a request's own chat_template (rendered in jinja2's sandbox, but free to "
        "loop for long: trusted clients only); off, such a request is 400 / INVALID_ARGUMENT",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_options(self)


def connection_cap(limits: ListenerLimits, listeners: int = 2) -> int:
    """The connections one of ``listeners`` listeners may hold: ``limits.max_connections``,
    lowered so that every listener at its cap still leaves :data:`RESERVED_DESCRIPTORS` of the
    process's soft ``RLIMIT_NOFILE`` free (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    room = (soft - RESERVED_DESCRIPTORS) // max(1, listeners)
    return max(16, min(limits.max_connections, room))


def check_request_template(rendering: ChatRendering | None, trusted: bool) -> None:
    """Refuse a request that brings its own chat template to a server that does not trust
    them (vLLM's ``--trust-request-chat-template``, ``vllm/entrypoints/launchers/cli_args.py``:
    a sandboxed template can still spend the tokenizer's time on purpose). Pure.

    Raises:
        InvalidRequestError: naming ``chat_template``.
    """
    if rendering is not None and rendering.template and not trusted:
        raise InvalidRequestError(
            "chat_template: this server does not accept a request's own chat template (start "
            "it with actorline serve --trust-request-chat-template to allow trusted clients "
            "to send one)",
            field="chat_template",
        )


def check_logprob_entries(
    choices: int,
    max_tokens: int | None,
    logprobs: int | None,
    max_model_len: int,
    limit: int,
    prompt_logprobs: int | None = None,
) -> None:
    """Refuse a request whose answer could carry more than ``limit`` logprobs: ``choices``
    choices of up to ``max_tokens`` tokens (None: up to ``max_model_len``), each token with
    itself and ``logprobs`` alternatives (None: no logprobs asked, nothing to check). With
    ``prompt_logprobs`` (the prompt's tokens scored too, -1: the whole vocabulary, at most
    :data:`~stages.params.MAX_LOGPROBS`), the prompt and the output together count as up to
    ``max_model_len`` tokens with the larger of the two top counts. Pure.

    Raises:
        InvalidRequestError: over the limit (field ``logprobs``, or ``prompt_logprobs`` when
            the prompt's scores are what was asked), naming the bound.
    """
    if logprobs is None and prompt_logprobs is None:
        return
    if prompt_logprobs is None:
        assert logprobs is not None
        tokens = max_tokens if max_tokens is not None else max_model_len
        top = logprobs
        spelled = (
            f"max_tokens {max_tokens}"
            if max_tokens is not None
            else (f"up to the model's {max_model_len} tokens (no max_tokens)")
        )
        field = "logprobs"
    else:
        tokens = max_model_len
        top = max(logprobs or 0, MAX_LOGPROBS if prompt_logprobs == -1 else prompt_logprobs)
        spelled = f"up to the model's {max_model_len} prompt and output tokens"
        field = "logprobs" if logprobs is not None else "prompt_logprobs"
    entries = choices * tokens * (1 + top)
    if entries > limit:
        raise InvalidRequestError(
            f"the answer could carry {entries} logprobs ({choices} choice(s) x {spelled} x "
            f"(1 + {top} top logprobs)); this server sends at most {limit} per request "
            "(actorline serve --max-logprob-entries): ask for fewer choices, tokens or top "
            "logprobs",
            field=field,
        )
