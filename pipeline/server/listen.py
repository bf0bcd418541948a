"""Where the servers listen: the default host, ``host:port`` formatting, and the listening
socket of the HTTP front end (bound before it serves, so a port that cannot be had is an
:class:`OSError` naming the address)."""

from __future__ import annotations

import socket

__all__ = ["DEFAULT_HOST", "format_address", "listening_socket"]

#: listen on loopback only unless told otherwise
DEFAULT_HOST = "127.0.0.1"


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0 picks a free one).

    Raises:
        OSError: the host does not resolve or the address cannot be bound (the message names
            the address).
    """
    address = format_address(host, port)
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, bound = infos[0]
        listener = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind(bound)
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        raise OSError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    return listener
