"""Host processes started ahead of the pipeline that will use them, so that a command's start-up
runs in two processes at once (docs/architecture.md §5, hosts; docs/performance.md §3).

A command that will start one engine (``actorline generate``, ``actorline serve``) calls
:func:`prespawn_host` first thing, before its own heavy imports. That starts
``python -m pipeline.runtime.host_main FD --preload MODULES`` at once: the child imports the
modules its stages will need (torch, transformers, the execute stage) and only then reads its
bootstrap from the socket, while the parent imports and checks its own side. The next host the
parent spawns (:meth:`pipeline.runtime.processes.ProcessHost.spawn`) takes the waiting process
instead of starting a new one; it gets its preparation data and plan exactly as a fresh host
does, so nothing about the host differs but when its imports ran.

A prespawned host nobody took is killed when the parent exits (an ``atexit`` hook), quietly: it
has no plan and holds nothing. A preload that fails to import is ignored by the child: the
stage that needs the module imports it again when it is built and reports the error then.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import socket
import subprocess
import sys
from collections.abc import Sequence

from pipeline.runtime.settings import child_environment

__all__ = [
    "PRELOAD_FLAG",
    "PrespawnedHost",
    "discard_prespawned",
    "host_command",
    "preload_modules",
    "prespawn_host",
    "take_prespawned",
]

PRELOAD_FLAG = "--preload"
"""host_main's option naming the modules to import before the bootstrap (comma-separated;
``module:attribute`` also reads an attribute, for packages that import lazily)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrespawnedHost:
    """A started host process waiting for its bootstrap on ``control`` (the parent's end),
    started with ``environment`` added to the parent's."""

    process: subprocess.Popen[bytes]
    control: socket.socket
    environment: tuple[tuple[str, str], ...] = ()


_waiting: list[PrespawnedHost] = []
_exit_hook = False


def host_command(control_fd: int, preload: Sequence[str] = ()) -> list[str]:
    """The command line of a host process on ``control_fd``, importing ``preload`` first."""
    command = [sys.executable, "-m", "pipeline.runtime.host_main", str(control_fd)]
    if preload:
        command += [PRELOAD_FLAG, ",".join(preload)]
    return command


def prespawn_host(preload: Sequence[str], environment: Sequence[tuple[str, str]] = ()) -> None:
    """Start a host process now that imports ``preload`` while this one goes on (see the
    module docstring), with ``environment`` added to this process's (what the host plan's
    ``environment`` will say: a host is taken only where the two agree); at most one waits at
    a time (a second call does nothing).

    Raises:
        OSError: the process could not be started.
    """
    if _waiting:
        return
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen(
            host_command(child_end.fileno(), preload),
            pass_fds=(child_end.fileno(),),
            stdin=subprocess.DEVNULL,
            env=child_environment(dict(environment)),
        )
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()
    global _exit_hook
    if not _exit_hook:
        atexit.register(discard_prespawned)
        _exit_hook = True
    _waiting.append(PrespawnedHost(process, parent_end, tuple(environment)))


def take_prespawned(environment: Sequence[tuple[str, str]] = ()) -> PrespawnedHost | None:
    """The waiting prespawned host, if one is still alive and was started with
    ``environment`` (it is then no longer waiting; one started with another is discarded:
    what its environment set, the OpenMP runtime has read already)."""
    while _waiting:
        host = _waiting[-1]
        if host.process.poll() is None and host.environment == tuple(environment):
            _waiting.pop()
            return host
        if host.process.poll() is None:
            discard_prespawned()
            return None
        _waiting.pop()
        host.control.close()
    return None


def discard_prespawned() -> None:
    """Kill and reap the prespawned host nobody took (at exit; also for tests)."""
    while _waiting:
        host = _waiting.pop()
        with contextlib.suppress(OSError):
            host.process.kill()
        host.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.process.wait(timeout=5)


def preload_modules(entries: Sequence[str]) -> None:
    """Import each ``module`` (or ``module:attribute``) of ``entries``, in the child, ignoring
    any that fails (see the module docstring)."""
    import importlib

    for entry in entries:
        name, _, attribute = entry.partition(":")
        try:
            module = importlib.import_module(name)
            if attribute:
                getattr(module, attribute)
        except Exception:  # reported again where the stage imports it
            continue
