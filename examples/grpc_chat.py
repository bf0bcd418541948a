"""A terminal chat with an ``actorline serve`` server, over gRPC.

It keeps the conversation (each turn is sent with the whole history, so the server's chat
template and prefix cache do the rest) and streams every reply as it is generated::

    actorline serve --api-key secret &                      # in another terminal
    python examples/grpc_chat.py --api-key secret
    python examples/grpc_chat.py --target host:50051 --tls --tls-ca server.crt

Type a message and press Enter. ``/reset`` forgets the conversation, ``/quit`` (or Ctrl-D)
leaves; Ctrl-C stops the reply being generated (the server aborts the request).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from pipeline.engine.errors import EngineDeadError
from pipeline.server.client import (
    AuthenticationError,
    Client,
    ServiceError,
    ServiceUnavailableError,
)
from stages.errors import InvalidRequestError, RequestError
from stages.params import SamplingParams, validate_sampling

__all__ = ["QUIT", "RESET", "ChatSession", "main"]

#: the commands a user can type instead of a message
QUIT = "/quit"
RESET = "/reset"
#: what the assistant's replies are prefixed with
REPLY_PREFIX = "assistant> "
USER_PROMPT = "you> "
#: exit status when the server cannot be used (unreachable, wrong key, engine dead)
EXIT_SERVER_ERROR = 1


class ChatSession:
    """One conversation with a Generation server: ``system`` (optional) and the history of
    completed exchanges, sent in full with every new message."""

    def __init__(
        self, client: Client, params: SamplingParams, *, system: str | None = None
    ) -> None:
        self.client = client
        self.params = params
        self.system = system
        self.history: list[dict[str, str]] = []

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages sent for the user message ``text``."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": text}]

    def send(self, text: str, write: Callable[[str], object]) -> str:
        """Send ``text``, pass each piece of the reply to ``write`` as it arrives, and return
        the whole reply. The exchange joins the history only once the reply is complete.

        Raises:
            RequestError: the server refused the message (too long, rate limited, ...).
            AuthenticationError, ServiceUnavailableError, EngineDeadError, ServiceError: the
                server cannot be used.
        """
        reply = []
        for output in self.client.generate(self.messages(text), self.params):
            if output.delta:
                write(output.delta)
                reply.append(output.delta)
        answer = "".join(reply)
        self.history += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
        ]
        return answer

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.history.clear()


def _read_line(stdin: TextIO, interactive: bool) -> str | None:
    """The next line the user typed, or None at end of input."""
    if interactive:
        try:
            return input(USER_PROMPT)
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None


def chat(session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Run the conversation loop until ``/quit`` or end of input; returns the exit status."""
    interactive = stdin.isatty()

    def write(piece: str) -> None:
        stdout.write(piece)
        stdout.flush()

    while True:
        try:
            line = _read_line(stdin, interactive)
        except KeyboardInterrupt:
            stdout.write("\n")
            return 0
        if line is None:
            return 0
        text = line.strip()
        if not text:
            continue
        if text == QUIT:
            return 0
        if text == RESET:
            session.reset()
            stderr.write("(conversation forgotten)\n")
            continue
        write(REPLY_PREFIX)
        try:
            session.send(text, write)
        except KeyboardInterrupt:
            stderr.write("\n(reply interrupted)\n")
            continue
        except AuthenticationError as exc:
            stderr.write(f"\nerror: the server refused the API key: {exc}\n")
            return EXIT_SERVER_ERROR
        except RequestError as exc:  # the message was refused, the conversation goes on
            stderr.write(f"\nerror: {exc}\n")
            continue
        except (ServiceUnavailableError, EngineDeadError, ServiceError) as exc:
            stderr.write(f"\nerror: {exc}\n")
            return EXIT_SERVER_ERROR
        write("\n")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="the server's host:port")
    parser.add_argument("--api-key", default=None, help="API key of the server, if it has keys")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    parser.add_argument("--tls-ca", default=None, help="PEM root certificate to trust (TLS)")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Chat on the terminal; returns the exit status (0 after /quit or end of input)."""
    args = _arguments(argv)
    tls: bool | bytes | None = None
    if args.tls_ca is not None:
        try:
            tls = Path(args.tls_ca).read_bytes()
        except OSError as exc:
            print(f"error: cannot read --tls-ca: {exc}", file=sys.stderr)
            return 2
    elif args.tls:
        tls = True
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    try:
        validate_sampling(params)
    except InvalidRequestError as exc:
        print(f"error: --{exc.field.replace('_', '-') if exc.field else 'option'}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    with Client(args.target, api_key=args.api_key, tls=tls) as client:
        try:
            status = client.health()
        except (ServiceUnavailableError, ServiceError) as exc:
            print(f"error: cannot reach {args.target}: {exc}", file=sys.stderr)
            return EXIT_SERVER_ERROR
        if status != "SERVING":
            print(f"error: {args.target} is {status}", file=sys.stderr)
            return EXIT_SERVER_ERROR
        session = ChatSession(client, params, system=args.system)
        return chat(session, sys.stdin, sys.stdout, sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
