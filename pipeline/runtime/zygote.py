"""Host processes forked from a zygote that has done a host's imports once (docs/architecture.md
§4.2, docs/performance.md §3).

A host started as ``python -m pipeline.runtime.host_main FD`` spends seconds of CPU on its
imports (torch alone ~2-3 s here) before it reads its plan. A process that starts many hosts
over its life pays that each time: a tensor- or pipeline-parallel engine's ranks, data-parallel
replicas, every restart of a host that died, a test suite's hundreds of engines. With the
``fork`` start (:func:`pipeline.runtime.settings.host_start`, the default on Linux) the first
spawn of a host starts a *zygote* instead: ``host_main FD --zygote``, which limits malloc
arenas and applies the OpenMP policy as a host does, imports what the plan's stages need
(their modules, when they are this project's: a user's module is imported by each host, as
before) and then forks one host per request. The forked child is a host whose imports are done:
it takes the requester's stdout and stderr, working directory and environment, and reads its
bootstrap from its control socket as a spawned host does. Its command line is the zygote's
(``host_main FD --zygote``): in ``ps`` a forked host is a child of a process of that name.
Python's ``forkserver`` start method works the same way (``Lib/multiprocessing/forkserver.py``);
hosts are not ``multiprocessing`` processes, so this is its own small server.

- **Exit status.** The zygote is each forked host's parent: it reaps the host when it exits and
  writes the exit code to a pipe whose read end the controller holds (:class:`ForkedHost`, the
  controller's ``Popen``); it also hands over a pidfd, so a signal never reaches a recycled pid.
  The controller's exit watch (§4.3) is unchanged.
- **Which zygote.** The OpenMP runtime, glibc and torch read parts of the environment once, as
  they load. A zygote therefore serves only hosts whose environment is its own but for the
  variables read later, at a call (:data:`LATE_VARIABLES`: ``ACTORLINE_*`` but the OpenMP wait
  policy, and pytest's per-test marker); another environment (another OpenMP policy, thread
  count or ``CUDA_VISIBLE_DEVICES``) gets a zygote of its own; at most :data:`MAX_ZYGOTES` live.
- **Fork safety.** A fork copies only the calling thread. A zygote that has Python threads after
  its imports (a module started one) refuses to fork, and its hosts are spawned. The BLAS
  pools numpy and scipy start as they load (OpenBLAS) re-create themselves in a child
  (``pthread_atfork``); GNU OpenMP starts its pool at the first parallel region, which no
  import runs.
- **Lifetime.** A zygote lives as long as the process that started it: it exits when its
  socket closes (so a killed controller leaves none) and is stopped at exit.

Where it cannot run (no pidfd or ``SCM_RIGHTS``, a zygote that failed to start or refused) the
host is spawned as before. Not pure: sockets, processes, signals.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import json
import logging
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.runtime.omp_policy import POLICY_ENV

__all__ = [
    "LATE_VARIABLES",
    "MAX_ZYGOTES",
    "ZYGOTE_FLAG",
    "ForkedHost",
    "fork_host",
    "preload_of",
    "serve_zygote",
    "stop_zygotes",
    "zygote_pids",
]

logger = logging.getLogger(__name__)

ZYGOTE_FLAG = "--zygote"
"""host_main's option that makes the process a zygote instead of a host."""

#: variables a process reads at a call, after its imports, so a zygote's children may differ
#: in them (each child gets its exact environment): the project's own settings but the
#: OpenMP policy (pipeline.runtime.settings reads each when asked), and the marker pytest sets
#: for each test
LATE_VARIABLES = ("ACTORLINE_", "PYTEST_CURRENT_TEST")

#: zygotes kept at once, one per environment; the least recently used is stopped for another
MAX_ZYGOTES = 4

#: the packages whose stage modules a zygote imports for its hosts (a user's module is
#: imported by each host, when it unpickles its plan, exactly as a spawned host does)
_OWN_PACKAGES = ("stages.", "plugins.", "pipeline.", "transports.")

_EXIT = struct.Struct("i")
_READY_TIMEOUT_S = 120.0  # a zygote's imports: a few seconds; a loaded machine, more
_STATUS_GRACE_S = 5.0  # from a host's exit to its zygote's word of its status: milliseconds
_REPLY_TIMEOUT_S = 60.0  # a fork, and the imports a request adds
#: the exit code reported for a host whose zygote died before it could tell (the host's own
#: exit status is lost with its parent)
STATUS_LOST = 255


def _late(name: str) -> bool:
    return name != POLICY_ENV and name.startswith(LATE_VARIABLES)


def _key(environment: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in environment.items() if not _late(k)))


def preload_of(factories: Sequence[Any]) -> tuple[str, ...]:
    """The modules a zygote imports for a host running stages of ``factories``: each one's
    module where it belongs to this project, and what each names in its ``host_preload``
    (:class:`pipeline.runtime.stage.Stage`)."""
    modules = {getattr(factory, "__module__", "") or "" for factory in factories}
    named = [m for factory in factories for m in getattr(factory, "host_preload", ())]
    own = sorted(m for m in modules if m.startswith(_OWN_PACKAGES))
    return tuple(dict.fromkeys([*own, *named]))


# -- the controller's side -------------------------------------------------------------------


class ForkedHost:
    """The controller's handle on a host its zygote forked: the part of ``subprocess.Popen``
    a :class:`pipeline.runtime.processes.ProcessHost` uses (``pid``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, pid: int, pidfd: int, status: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._status = status  # the read end of the pipe the zygote writes the exit code to

    def _read_status(self, timeout: float | None) -> bool:
        """Whether the exit code is known after waiting up to ``timeout`` (None: no end). Once
        the host has exited, its zygote has :data:`_STATUS_GRACE_S` to tell its status (it
        reaps at once); a zygote that does not (gone, or stopped) leaves it
        :data:`STATUS_LOST`, so nobody waits on it without end."""
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._status, self._pidfd], [], [], timeout)
        if not ready:
            return False
        if self._status not in ready:  # exited: the zygote is about to tell
            ready, _, _ = select.select([self._status], [], [], _STATUS_GRACE_S)
        data = os.read(self._status, _EXIT.size) if ready else b""
        self.returncode = _EXIT.unpack(data)[0] if len(data) == _EXIT.size else None
        if self.returncode is None:  # the zygote is gone, the exit status with it
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                return False
            self.returncode = STATUS_LOST
        os.close(self._status)
        os.close(self._pidfd)
        return True

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(f"host {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Refused(Exception):
    """The zygote cannot fork hosts (it has threads, or it failed): spawn instead."""


class _Zygote:
    """One zygote process and the controller's end of its socket (used under ``_lock``)."""

    def __init__(self, environment: Mapping[str, str], preload: Sequence[str]) -> None:
        from pipeline.runtime.prespawn import host_command

        self.imported = set(preload)
        self._ready = False
        self._control, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [*host_command(child_end.fileno(), preload), ZYGOTE_FLAG],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                env=dict(environment),
            )
        except BaseException:
            self._control.close()
            raise
        finally:
            child_end.close()

    def _receive(self, timeout: float) -> tuple[dict[str, Any], list[int]]:
        self._control.settimeout(timeout)
        try:
            message, fds, _, _ = socket.recv_fds(self._control, 1 << 16, 2)
        except (OSError, TimeoutError) as exc:
            raise _Refused(f"no answer ({exc})") from exc
        if not message:
            for fd in fds:
                os.close(fd)
            raise _Refused(f"exited with status {self.process.poll()}")
        return json.loads(message), fds

    def fork(
        self,
        control: int,
        environment: Mapping[str, str],
        preload: Sequence[str],
        cancelled: threading.Event,
    ) -> ForkedHost | None:
        if not self._ready:
            hello, _ = self._receive(_READY_TIMEOUT_S)
            if hello.get("threads", 0) != 1:
                raise _Refused(f"it has {hello.get('threads')} Python threads after its imports")
            self._ready = True
        if cancelled.is_set():  # the caller gave up while the zygote imported
            return None
        request = {
            "cwd": os.getcwd(),
            "environment": dict(environment),
            "preload": [m for m in preload if m not in self.imported],
        }
        payload = json.dumps(request).encode()
        fds = [control, 1, 2]  # and what a spawned host inherits: stdout and stderr
        try:
            socket.send_fds(self._control, [payload], fds)
        except OSError as exc:
            raise _Refused(f"cannot be asked ({exc})") from exc
        reply, passed = self._receive(_REPLY_TIMEOUT_S)
        self.imported.update(request["preload"])
        if "error" in reply or len(passed) != 2:
            for fd in passed:
                os.close(fd)
            raise _Refused(reply.get("error", "no pidfd and status pipe"))
        return ForkedHost(int(reply["pid"]), passed[0], passed[1])

    def stop(self) -> None:
        self._control.close()  # the zygote exits on EOF
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_lock = threading.Lock()
_zygotes: collections.OrderedDict[tuple[tuple[str, str], ...], _Zygote | None] = (
    collections.OrderedDict()
)
_exit_hook = False


def _supported() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "pidfd_open")
        and hasattr(signal, "pidfd_send_signal")
        and hasattr(socket, "send_fds")
    )


def _fork_host(
    control: int,
    environment: Mapping[str, str],
    preload: Sequence[str],
    cancelled: threading.Event,
) -> ForkedHost | None:
    """:func:`fork_host`'s work, in a worker thread. A caller cancelled meanwhile (``cancelled``
    set) gets no host: none is forked after it, and one forked as it was cancelled is killed
    and reaped before the thread ends (asyncio.run waits for the thread), so a start that
    timed out leaves no process behind."""
    try:
        host = _fork_host_on(control, environment, preload, cancelled)
    finally:
        os.close(control)
    if host is not None and cancelled.is_set():
        host.kill()
        host.wait()
        return None
    return host


def _fork_host_on(
    control: int,
    environment: Mapping[str, str],
    preload: Sequence[str],
    cancelled: threading.Event,
) -> ForkedHost | None:
    global _exit_hook
    key = _key(environment)
    with _lock:
        if key in _zygotes:
            _zygotes.move_to_end(key)
            zygote = _zygotes[key]
            if zygote is None:  # refused before: this environment's hosts are spawned
                return None
        else:
            while len(_zygotes) >= MAX_ZYGOTES:
                _, old = _zygotes.popitem(last=False)
                if old is not None:
                    old.stop()
            try:
                zygote = _Zygote(environment, preload)
            except OSError as exc:
                logger.warning("cannot start a zygote for hosts (%s); spawning them", exc)
                _zygotes[key] = None
                return None
            _zygotes[key] = zygote
            if not _exit_hook:
                atexit.register(stop_zygotes)
                _exit_hook = True
        try:
            return zygote.fork(control, environment, preload, cancelled)
        except _Refused as exc:
            logger.warning("the hosts' zygote cannot fork (%s); spawning hosts instead", exc)
            zygote.stop()
            _zygotes[key] = None
            return None


async def fork_host(
    control: socket.socket, environment: Mapping[str, str], preload: Sequence[str] = ()
) -> ForkedHost | None:
    """A host forked, on ``control`` (the child's end of its control socket), by the zygote of
    ``environment``, which first imports ``preload`` (see :func:`preload_of`); the zygote is
    started on first use. None where the host has to be spawned instead (see the module
    docstring). The zygote's first answer waits for its imports, hence the worker thread."""
    if not _supported():
        return None
    cancelled = threading.Event()
    # the worker thread's own copy: a cancelled caller closes its end while the thread goes on
    control_copy = os.dup(control.fileno())
    future = asyncio.get_running_loop().run_in_executor(
        None, _fork_host, control_copy, environment, preload, cancelled
    )
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancelled.set()  # (the thread forks nothing more, and kills what it forks meanwhile)
        future.add_done_callback(_kill_forked)  # what it forked before it could know
        raise


def _kill_forked(future: asyncio.Future[ForkedHost | None]) -> None:
    """Kill and reap the host a cancelled :func:`fork_host` forked."""
    if future.cancelled() or future.exception() is not None:
        return
    host = future.result()
    if host is not None:
        host.kill()
        host.wait()


def stop_zygotes() -> None:
    """Stop every zygote (at exit; also for tests). Hosts already forked go on."""
    with _lock:
        while _zygotes:
            _, zygote = _zygotes.popitem()
            if zygote is not None:
                zygote.stop()


def zygote_pids() -> set[int]:
    """The pids of the zygotes this process runs."""
    with _lock:
        return {z.process.pid for z in _zygotes.values() if z is not None}


# -- the zygote's side -----------------------------------------------------------------------


def _python_threads() -> int:
    return threading.active_count()


def _import(modules: Sequence[str]) -> None:
    """Import ``modules`` (see :func:`pipeline.runtime.prespawn.preload_modules`). Nothing is
    frozen here: a host freezes its start-up heap itself, as its plan's ``tune_gc`` says."""
    from pipeline.runtime.prespawn import preload_modules

    if modules:
        preload_modules(modules)


def serve_zygote(control_fd: int, preload: Sequence[str]) -> int | None:
    """Run a zygote on ``control_fd``: import ``preload``, then fork a host for each request.
    Returns only in a forked child, with the fd of its host control socket (the caller then
    serves the host); None when the zygote should exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a host: the controller decides
    # (the thread that started it may have had SIGCHLD blocked, and the zygote reaps on it)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    sock = socket.socket(fileno=control_fd)
    sock.setblocking(True)
    _import(preload)
    threads = _python_threads()
    sock.send(json.dumps({"threads": threads}).encode())
    if threads != 1:
        sock.recv(1)  # until the controller closes: it spawns its hosts
        return None
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    statuses: dict[int, int] = {}  # a live host's pid -> the write end of its status pipe
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            write_end = statuses.pop(pid, None)
            if write_end is not None:
                with contextlib.suppress(OSError):
                    os.write(write_end, _EXIT.pack(os.waitstatus_to_exitcode(status)))
                os.close(write_end)

    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_read, 512):
                        pass
                reap()
                continue
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not message:
                return None  # the controller is gone, or done
            request = json.loads(message)
            try:
                _import(request.get("preload", ()))
                if _python_threads() != 1:
                    raise RuntimeError("a preloaded module started a Python thread")
                pid = os.fork()
            except Exception as exc:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
                continue
            if pid == 0:  # the host: leave the zygote behind, take the requester's stdio
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                sock.close()
                for fd in (wake_read, wake_write, *statuses.values()):
                    os.close(fd)
                host_control, stdout, stderr = fds
                os.dup2(stdout, 1)
                os.dup2(stderr, 2)
                os.close(stdout)
                os.close(stderr)
                os.chdir(request["cwd"])
                # the requester's late variables; the rest are the zygote's (the requester's,
                # and what the zygote set before its imports: the OpenMP policy's variables)
                environment = {k: v for k, v in os.environ.items() if not _late(k)}
                environment.update((k, v) for k, v in request["environment"].items() if _late(k))
                os.environ.clear()
                os.environ.update(environment)
                return host_control
            for fd in fds:
                os.close(fd)
            status_read, status_write = os.pipe2(os.O_CLOEXEC)
            statuses[pid] = status_write
            pidfd = os.pidfd_open(pid)  # (not reaped before reap(): the pid is this child's)
            try:
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd, status_read])
            finally:
                os.close(pidfd)
                os.close(status_read)
