"""A chat in the browser, built on actorline's OpenAI-compatible HTTP front end.

It is the product's HTTP server (:class:`pipeline.server.http.server.HttpServer`) with one
route added: ``/`` serves ``browser_chat.html``, a single static page (no build step, nothing
from the network) that streams each reply from ``/v1/chat/completions`` as it is generated
and has a Stop button, which aborts the request in the engine::

    python examples/browser_chat.py --model smollm2-135m --port 8000
    # then open http://127.0.0.1:8000/ in a browser

Prints ``chat page on URL`` once the engine is up; stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from fastapi.responses import HTMLResponse

from pipeline import AsyncEngine
from pipeline.server.auth import ApiKeys
from pipeline.server.http.server import HttpServer

__all__ = ["PAGE", "add_page", "main"]

#: the chat page, next to this file
PAGE = Path(__file__).with_name("browser_chat.html")
READY_PREFIX = "chat page on "


def add_page(server: HttpServer) -> None:
    """Serve the chat page at ``/`` of ``server``'s app."""
    page = PAGE.read_text()

    @server.app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)


async def serve(args: argparse.Namespace) -> None:
    """Run the engine and the server until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with AsyncEngine(args.model, num_blocks=args.num_blocks) as engine:
        server = HttpServer(engine, api_keys=ApiKeys.load(args.api_key))
        add_page(server)
        url = await server.start(args.host, args.port)
        print(f"{READY_PREFIX}{url.removesuffix('/v1')}/", flush=True)
        try:
            await stop.wait()
        finally:
            await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: pick a free port")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks")
    parser.add_argument("--api-key", action="append", default=[], help="accepted key (repeatable)")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
