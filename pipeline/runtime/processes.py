"""Internal: hosts in spawned processes, and the control channel to them.

A host process is started with ``python -m pipeline.runtime.host_main FD`` and a socket pair. The
parent first hands it, over that socket, multiprocessing's preparation data (``sys.path``, the
main module, so user stage classes resolve exactly as with multiprocessing's spawn) and the
host plan, pickled — parent to its own child, never from a network peer. After that the socket
carries only length-prefixed codec frames (control commands and replies; nothing unpickled).

The parent watches the child through a pidfd (readable the moment the process exits, so
SIGKILL and the OOM killer are noticed at once) and the socket; the child stops when the
socket closes, so a dead parent leaves no orphan. Unlike multiprocessing's spawn, this starts
no resource-tracker process, so a stopped pipeline leaves no process behind.

A host that listens on zmq links gets its private ipc directory from the parent (the zmq
transport's ``ipc_dir`` setting): the child removes it when it closes its transport, and the
parent once the child is gone, so not even a SIGKILLed host leaves ipc files behind. When the
parent itself is killed, its hosts, orphaned, remove the ipc directories they connected to
(the parent's and their siblings', all named ``actorline-zmq-*`` and all dead or dying) as
they exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import itertools
import logging
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from pipeline.runtime.control import (
    Ack,
    BindLinks,
    ConnectLinks,
    CutReplica,
    HostFailure,
    HostPlan,
    HostStatistics,
    LinkLost,
    LinksBound,
    QueryStatistics,
    StartStages,
    StopHost,
    TellRestored,
)
from pipeline.runtime.crash_note import CrashNoteFile, open_note
from pipeline.runtime.errors import (
    DeadlockError,
    GraphError,
    HostDiedError,
    PipelineClosedError,
    StageFailedError,
)
from pipeline.runtime.gc_policy import freeze_startup_heap
from pipeline.runtime.host import FailureCallback, LinkLostCallback, LocalHost
from pipeline.runtime.prespawn import host_command, preload_modules, take_prespawned
from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored
from pipeline.runtime.settings import child_environment, host_start
from pipeline.runtime.zygote import ForkedHost, fork_host, preload_of
from transports.codec import Codec
from transports.errors import DecodeError, PeerLostError
from transports.tasks import TaskSet
from transports.zmq import IPC_DIR_PREFIX, made_ipc_directory

__all__ = ["ProcessHost", "error_from_failure", "failure_message", "serve_host"]

logger = logging.getLogger("actorline.process")

_LENGTH = struct.Struct("!I")
_MAX_CONTROL_FRAME = 64 << 20
#: seconds a controller waits for a shutdown phase on top of the host's own bound
_STOP_MARGIN = 2.0
_ZMQ = "zmq"
#: how long an orphaned host waits to see its parent gone (the kernel closes a dying
#: process's sockets before it reparents its children)
_ORPHAN_GRACE = 2.0


def _with_ipc_dir(plan: HostPlan) -> tuple[HostPlan, str | None]:
    """The plan to hand a spawned host, and the ipc directory the parent made for it (None
    when the host listens on no zmq link, its zmq links are on tcp, or the settings name a
    directory already)."""
    if not any(link.transport == _ZMQ for link in plan.inbound):
        return plan, None
    settings = dict(plan.transport_settings)
    zmq_settings = dict(settings.get(_ZMQ) or {})
    if "ipc_dir" in zmq_settings or zmq_settings.get("tcp_interface") is not None:
        return plan, None  # a directory named already, or links on tcp: no ipc files
    directory = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
    settings[_ZMQ] = {**zmq_settings, "ipc_dir": directory}
    return dataclasses.replace(plan, transport_settings=tuple(settings.items())), directory


async def _parent_gone(parent: int, grace: float) -> bool:
    """Whether this process was reparented (its parent ``parent`` died) within ``grace``."""
    deadline = time.monotonic() + grace
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def failure_message(call_id: int, host: str, error: BaseException) -> HostFailure:
    """``error`` (a host's or its stage's failure) as the control message that carries it."""
    if isinstance(error, DeadlockError):
        return HostFailure(
            call_id,
            host,
            "",
            "DeadlockError",
            str(error),
            cycle=error.stages,
            capacities=error.capacities,
        )
    if isinstance(error, StageFailedError):
        return HostFailure(
            call_id,
            host,
            error.stage,
            error.remote_type,
            error.remote_message,
            error.remote_traceback,
        )
    if isinstance(error, PeerLostError):
        return HostFailure(
            call_id, host, "", "PeerLostError", str(error), silent_for=error.silent_for
        )
    return HostFailure(call_id, host, "", type(error).__qualname__, str(error))


def error_from_failure(failure: HostFailure) -> BaseException:
    """The error a :class:`HostFailure` carries, rebuilt on the controller's side."""
    if failure.error_type == "DeadlockError" and failure.cycle:
        return DeadlockError(failure.host, failure.cycle, failure.capacities)
    if failure.error_type == "PeerLostError" and not failure.stage:
        return PeerLostError(
            f"host {failure.host!r}: {failure.message}", silent_for=failure.silent_for
        )
    return StageFailedError(
        failure.stage or "(host)",
        failure.host,
        failure.error_type,
        failure.message,
        failure.traceback,
    )


class _ControlChannel:
    """Length-prefixed codec frames over an asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.codec = Codec()

    def send(self, message: object) -> None:
        payload, buffers = self.codec.encode(message)
        assert not buffers, "control messages carry no out-of-band buffers"
        self.writer.write(_LENGTH.pack(len(payload)) + payload)

    async def receive(self) -> object:
        """The next control message. Raises EOFError when the peer is gone."""
        while True:
            try:
                (length,) = _LENGTH.unpack(await self.reader.readexactly(_LENGTH.size))
                if length > _MAX_CONTROL_FRAME:
                    raise EOFError(f"control frame of {length} bytes is too large")
                data = await self.reader.readexactly(length)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise EOFError("control channel closed") from exc
            try:
                return self.codec.decode(data)
            except DecodeError as exc:
                logger.warning("ignoring an undecodable control message: %s", exc)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


# -- the child side ------------------------------------------------------------------------------


def serve_host(control_fd: int, preload: Sequence[str] = ()) -> None:
    """Entry point of a host process (``python -m pipeline.runtime.host_main FD``); a
    prespawned one imports ``preload`` before it reads its bootstrap."""
    # NOTE: Ctrl-C reaches the whole process group; the controller decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=control_fd)
    sock.setblocking(True)
    preload_modules(preload)
    preparation, plan = _receive_bootstrap(sock)
    multiprocessing.spawn.prepare(preparation)
    plan = pickle.loads(plan)
    assert isinstance(plan, HostPlan)
    logging.basicConfig(
        level=plan.log_level,
        format=f"%(asctime)s %(levelname)s [{plan.name}:%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(_serve(plan, sock))


def _bootstrap(name: str, plan: HostPlan) -> bytes:
    """What a host reads first: multiprocessing's preparation data and its pickled plan."""
    preparation = _preparation(f"actorline-{name}")
    main_importable = "init_main_from_path" in preparation or "init_main_from_name" in preparation
    return pickle.dumps((preparation, _pickled_plan(plan, main_importable)))


def _receive_bootstrap(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    def exactly(count: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < count:
            chunk = sock.recv(count - len(chunks))
            if not chunk:
                raise SystemExit("actorline host: the parent went away during start-up")
            chunks += chunk
        return bytes(chunks)

    (length,) = _LENGTH.unpack(exactly(_LENGTH.size))
    # NOTE: the bootstrap comes from our own parent process over an inherited socket pair
    # (like multiprocessing's spawn); nothing received later is unpickled.
    preparation, plan_bytes = pickle.loads(exactly(length))
    return preparation, plan_bytes


async def _serve(plan: HostPlan, sock: socket.socket) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    control = _ControlChannel(reader, writer)
    built = False
    parent = os.getppid()
    peer_dirs: set[str] = set()  # other hosts' ipc directories this one connected to
    orphaned = False

    def report(error: BaseException) -> None:
        with contextlib.suppress(Exception):
            control.send(failure_message(0, plan.name, error))

    def report_link_lost(link_id: str, detail: str) -> None:
        with contextlib.suppress(Exception):
            control.send(LinkLost(0, plan.name, link_id, detail))

    open_note(plan.crash_note)
    host = LocalHost(plan, report, on_link_lost=report_link_lost)

    async def run_command(command: Any) -> bool:
        """Run one command; True once the host should exit."""
        nonlocal built
        call_id = command.call_id
        try:
            if isinstance(command, BindLinks) and command.replica:
                control.send(LinksBound(call_id, await host.rebind_replica(command.replica)))
            elif isinstance(command, ConnectLinks) and command.replica:
                made = map(made_ipc_directory, command.addresses.values())
                peer_dirs.update(directory for directory in made if directory is not None)
                await host.reconnect_replica(command.replica, command.addresses)
                control.send(Ack(call_id))
            elif isinstance(command, TellRestored):
                restored = ReplicaRestored(
                    command.replica_set, command.replica, command.hosts, command.restored
                )
                await host.replica_restored(restored)
                control.send(Ack(call_id))
            elif isinstance(command, BindLinks):
                if not built:
                    built = True
                    try:
                        host.build()
                    except Exception as exc:
                        raise host._stage_error("(constructor)", exc) from exc
                control.send(LinksBound(call_id, await host.bind_links()))
            elif isinstance(command, ConnectLinks):
                made = map(made_ipc_directory, command.addresses.values())
                peer_dirs.update(directory for directory in made if directory is not None)
                await host.connect_links(command.addresses)
                control.send(Ack(call_id))
            elif isinstance(command, StartStages):
                await host.start_stages()
                if plan.tune_gc:
                    freeze_startup_heap()
                control.send(Ack(call_id))
            elif isinstance(command, QueryStatistics):
                control.send(Ack(call_id, host.statistics()))
            elif isinstance(command, CutReplica):
                await host.cut_replica(command.lost, tell=command.tell)
                control.send(Ack(call_id))
            elif isinstance(command, StopHost):
                if command.phase == 1:
                    await host.quiesce(command.timeout, abort=command.abort)
                else:
                    await host.release(command.timeout, abort=command.abort)
                control.send(Ack(call_id))
                return command.phase != 1
        except Exception as exc:
            with contextlib.suppress(Exception):
                control.send(failure_message(call_id, plan.name, exc))
        return False

    commands = TaskSet(f"host {plan.name} commands")
    try:
        while True:
            try:
                command = await control.receive()
            except EOFError:
                orphaned = True
                break  # the controller is gone: stop
            task = commands.spawn(run_command(command), name=f"command:{type(command).__name__}")
            if isinstance(command, StopHost) and command.phase != 1:
                await task
                with contextlib.suppress(Exception):
                    await writer.drain()
                break
    finally:
        await host.stop(abort=True)  # no-op after an orderly StopHost
        control.close()
        # A parent that was killed cannot remove its ipc directory, nor those it made for
        # its hosts: the orphans do. Only once the parent is certainly dead (it may also have
        # just closed the socket while alive and still using its directory).
        if orphaned and peer_dirs and await _parent_gone(parent, _ORPHAN_GRACE):
            for directory in peer_dirs:
                shutil.rmtree(directory, ignore_errors=True)
        await commands.aclose()  # (what asyncio.run would cancel next)


# -- the controller side -------------------------------------------------------------------------


class ProcessHost:
    """The controller's handle on a host running in a spawned process."""

    def __init__(
        self,
        plan: HostPlan,
        on_failure: FailureCallback,
        on_link_lost: LinkLostCallback | None = None,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self._on_failure = on_failure
        self._on_link_lost = on_link_lost
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._control: _ControlChannel | None = None
        self._process: subprocess.Popen[bytes] | ForkedHost | None = None
        self._pidfd: int | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"process host {plan.name}")  # the control reader
        self._stopping = False
        self._gone = False
        self._exited = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ipc_dir: str | None = None
        self._note: CrashNoteFile | None = None
        self._last_note = ""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def spawn(self) -> None:
        """Start the host process and hand it its plan."""
        prespawned = take_prespawned(self.plan.environment)
        if prespawned is not None:
            # started ahead by prespawn_host: its imports have been running meanwhile
            parent_end = prespawned.control
            try:
                plan, self._ipc_dir = _with_ipc_dir(self._noted_plan())
                bootstrap = _bootstrap(self.name, plan)
            except BaseException:
                self._remove_ipc_dir()
                self._remove_note()
                parent_end.close()
                prespawned.process.kill()
                prespawned.process.wait()
                raise
            self._process = prespawned.process
        else:
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                plan, self._ipc_dir = _with_ipc_dir(self._noted_plan())
                bootstrap = _bootstrap(self.name, plan)
                environment = child_environment(dict(self.plan.environment))
                if host_start() == "fork":  # (None: it cannot fork here; spawn it)
                    preload = preload_of([spec.factory for spec in self.plan.stages])
                    self._process = await fork_host(child_end, environment, preload)
                if self._process is None:
                    self._process = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                        host_command(child_end.fileno()),
                        pass_fds=(child_end.fileno(),),
                        stdin=subprocess.DEVNULL,
                        env=environment,
                    )
            except BaseException:
                self._remove_ipc_dir()
                self._remove_note()
                parent_end.close()  # (a host forked after all sees its socket close, and exits)
                raise
            finally:
                child_end.close()
        # NOTE: a prespawned child reads this once its preload is done; until then the socket
        # buffers it (the bootstrap is a few KB; sendall waits only past the buffer's size).
        parent_end.sendall(_LENGTH.pack(len(bootstrap)) + bootstrap)
        loop = self._loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_unix_connection(sock=parent_end)
        self._control = _ControlChannel(reader, writer)
        self._reader_task = self._tasks.spawn(self._read_control(), name=f"control:{self.name}")
        try:
            self._pidfd = os.pidfd_open(self._process.pid)
            loop.add_reader(self._pidfd, self._on_exit)
        except (AttributeError, OSError):  # no pidfd: the control socket's EOF tells instead
            self._pidfd = None

    def _noted_plan(self) -> HostPlan:
        """The plan with a fresh crash-note file named in it (the plan as is if none can
        be made: notes are a diagnostic)."""
        try:
            self._note = CrashNoteFile()
        except OSError:
            return self.plan
        return dataclasses.replace(self.plan, crash_note=self._note.path)

    def last_note(self) -> str:
        """What the host last noted it was doing (its crash note, see
        :mod:`pipeline.runtime.crash_note`; "" for nothing). Kept once the process is gone."""
        if self._note is not None:
            self._last_note = self._note.read()
        return self._last_note

    def _remove_note(self) -> None:
        note, self._note = self._note, None
        if note is not None:
            self._last_note = note.read()
            note.remove()

    async def _read_control(self) -> None:
        assert self._control is not None
        while True:
            try:
                message = await self._control.receive()
            except EOFError:
                if self._pidfd is None:
                    self._on_exit()
                return
            call_id = getattr(message, "call_id", 0)
            future = self._calls.pop(call_id, None) if call_id else None
            if future is not None:
                if not future.done():
                    future.set_result(message)
            elif isinstance(message, HostFailure) and not self._stopping:
                self._on_failure(error_from_failure(message))
            elif (
                isinstance(message, LinkLost)
                and not self._stopping
                and self._on_link_lost is not None
            ):
                self._on_link_lost(message.link_id, message.detail)

    def _on_exit(self) -> None:
        if self._gone:
            return
        assert self._loop is not None and self._process is not None
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
        self._gone = True
        self._exited.set()
        exitcode = self._process.wait()
        self._remove_ipc_dir()
        self._remove_note()
        doing = self._last_note
        error = HostDiedError(self.name, exitcode, doing)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if not self._stopping:
            self._on_failure(error)

    def _remove_ipc_dir(self) -> None:
        """Remove the host's ipc directory (the host is gone, or never started)."""
        directory, self._ipc_dir = self._ipc_dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    async def _call(self, command_type: type, *args: Any, timeout: float | None = None) -> Any:
        if self._gone or self._control is None or self._loop is None:
            if self._stopping:  # stopped by its controller, not dead
                raise PipelineClosedError(f"host {self.name!r} is stopped")
            code = self._process.returncode if self._process else None
            raise HostDiedError(self.name, code)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._control.send(command_type(call_id, *args))
            reply = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)
        if isinstance(reply, HostFailure):
            raise error_from_failure(reply)
        return reply

    async def bind_links(self) -> dict[str, str]:
        reply = await self._call(BindLinks)
        assert isinstance(reply, LinksBound)
        return reply.addresses

    async def connect_links(self, addresses: dict[str, str]) -> None:
        await self._call(ConnectLinks, addresses)

    async def start_stages(self) -> None:
        await self._call(StartStages)

    def links_to(self, replica: str) -> bool:
        """Whether this host has a contained link to or from replica ``replica``
        (``"set/replica"``)."""
        return any(link.contained == replica for link in (*self.plan.inbound, *self.plan.outbound))

    async def cut_replica(
        self, lost: ReplicaLost, timeout: float = 5.0, *, tell: bool = True
    ) -> None:
        """Have the host cut its links to the lost replica (:meth:`LocalHost.cut_replica`).
        Never raises (a host that cannot answer is failing on its own)."""
        with contextlib.suppress(Exception):
            await self._call(CutReplica, lost, tell, timeout=timeout)

    async def rebind_replica(self, key: str) -> dict[str, str]:
        """Have the host listen afresh for its links from restored replica ``key``
        (:meth:`LocalHost.rebind_replica`); returns their addresses.

        Raises:
            HostDiedError: the host is gone. StageFailedError: the host failed doing it.
        """
        reply = await self._call(BindLinks, key)
        assert isinstance(reply, LinksBound)
        return reply.addresses

    async def reconnect_replica(self, key: str, addresses: dict[str, str]) -> None:
        """Have the host connect its links to restored replica ``key`` and take them back
        into use (:meth:`LocalHost.reconnect_replica`). Raises as :meth:`rebind_replica`."""
        await self._call(ConnectLinks, addresses, key)

    async def replica_restored(self, restored: ReplicaRestored) -> None:
        """Have the host tell its stages linked to the replica that it runs again
        (:meth:`LocalHost.replica_restored`). Raises as :meth:`rebind_replica`."""
        await self._call(
            TellRestored,
            restored.replica_set,
            restored.replica,
            restored.hosts,
            restored.restored,
        )

    async def statistics(self) -> HostStatistics:
        reply = await self._call(QueryStatistics, timeout=10.0)
        assert isinstance(reply, Ack) and reply.statistics is not None
        return reply.statistics

    async def _wait_exit(self, timeout: float) -> bool:
        process = self._process
        assert process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while process.poll() is None:
            if self._pidfd is not None:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._exited.wait()), remaining)
                if self._gone:
                    return True
            else:  # NOTE: without a pidfd there is no exit event to wait on
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(0.02)
        return True

    async def exited(self, grace: float) -> bool:
        """Whether the host process has exited, or exits within ``grace`` seconds. An exit
        seen here is reported as it would be by the exit watch (HostDiedError through
        ``on_failure``, unless the host is being stopped)."""
        if self._process is None or self._loop is None:
            return False
        if not self._gone:
            if not await self._wait_exit(grace):
                return False
            self._on_exit()
        return True

    def _phase_timeout(self, phase: int, timeout: float) -> float:
        """How long the host may take for shutdown ``phase`` when each step gets
        ``timeout``: phase 1 cancels its tasks, stops each stage and closes each sender in
        turn; phase 2 closes each receiver and each transport."""
        plan = self.plan
        if phase == 1:
            steps = 1 + len(plan.stages) + len(plan.outbound)
        else:
            links = (*plan.inbound, *plan.outbound)
            steps = len(plan.inbound) + len({link.transport for link in links})
        return max(steps, 1) * timeout + _STOP_MARGIN

    async def quiesce(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown phase 1 (see :meth:`LocalHost.quiesce`; each step of it gets ``timeout``).
        Never raises."""
        self._stopping = True
        if self._process is not None and not self._gone:
            with contextlib.suppress(Exception):
                await self._call(
                    StopHost, 1, abort, timeout, timeout=self._phase_timeout(1, timeout)
                )

    async def stop(self, timeout: float = 5.0, *, abort: bool = False) -> None:
        """Shutdown phase 2: ask the host to release its links and exit, wait for the
        process; terminate, then kill, if it does not exit. Idempotent; never raises."""
        self._stopping = True
        process = self._process
        if process is None:
            return
        if not self._gone:
            with contextlib.suppress(Exception):
                await self._call(
                    StopHost, 2, abort, timeout, timeout=self._phase_timeout(2, timeout)
                )
        if not await self._wait_exit(timeout):
            logger.warning("host %s did not exit; terminating pid %s", self.name, process.pid)
            process.terminate()
            if not await self._wait_exit(1.0):
                process.kill()
        await self._release()

    def kill_now(self) -> None:
        """Forced end, the part that does not wait: SIGKILL the process if it still runs and
        remove its ipc directory. Idempotent; never raises."""
        self._stopping = True
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(OSError):
                process.kill()  # (a no-op once the process has been reaped)
        self._remove_ipc_dir()
        if process is None or process.returncode is not None:
            self._remove_note()

    async def kill(self) -> None:
        """Forced end (also of a shutdown cut short): :meth:`kill_now`, then reap the process
        and close the control channel. Idempotent; never raises."""
        self.kill_now()
        if self._process is None:
            return
        await self._wait_exit(_STOP_MARGIN)
        await self._release()

    async def _release(self) -> None:
        """Reap the (exited or killed) process and release what the controller holds for it:
        the ipc directory, the pidfd, the control reader and channel. Idempotent."""
        process = self._process
        assert process is not None
        process.wait()
        if self._loop is not None:
            self._on_exit()  # (once) calls still waiting for an answer fail; nothing reported
        self._remove_ipc_dir()
        self._remove_note()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._gone = True
        self._exited.set()
        reader, self._reader_task = self._reader_task, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        if self._control is not None:
            self._control.close()


def _preparation(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a spawned host named ``name``.

    NOTE: for a script read from stdin (``python - <<EOF``) the main module's file is
    ``"<stdin>"``, which the host cannot import; it then runs as under Python's interactive
    mode, whose main module has no file either: the host does not import the main module
    (and :func:`_pickled_plan` refuses a stage that needs it).
    """
    preparation = multiprocessing.spawn.get_preparation_data(name)
    preparation.pop("authkey", None)  # the host uses no multiprocessing connections
    main_path = preparation.get("init_main_from_path")
    if main_path is not None and not os.path.isfile(main_path):
        del preparation["init_main_from_path"]
    return preparation


class _MainChecker(pickle.Pickler):
    """A pickler that refuses what only the calling process's main module defines."""

    def reducer_override(self, obj: Any) -> Any:
        if getattr(obj, "__module__", None) == "__main__" and (
            isinstance(obj, type) or callable(obj)
        ):
            raise _FromMain(getattr(obj, "__qualname__", repr(obj)))
        return NotImplemented


class _FromMain(Exception):
    """Raised by :class:`_MainChecker`: ``args[0]`` names what the main module defines."""


def _check_main_free(plan: HostPlan) -> None:
    """Raise GraphError, naming the stage, if a stage's class or config needs the calling
    process's main module, which a spawned host cannot import here."""
    for spec in plan.stages:
        try:
            _MainChecker(io.BytesIO()).dump((spec.factory, spec.config))
        except _FromMain as found:
            raise GraphError(
                f"stage {spec.name!r} cannot run on host {plan.name!r}: {found.args[0]} is "
                "defined in the main script, which a spawned host cannot import (it was read "
                "from stdin, or typed at the interactive prompt); define it in a module, or "
                "run the stage on the main host"
            ) from None
        except (pickle.PicklingError, AttributeError, TypeError):
            continue  # not picklable at all: _pickled_plan names why


def _pickled_plan(plan: HostPlan, main_importable: bool = True) -> bytes:
    """``plan`` pickled for its spawned host; ``main_importable``: whether the host can import
    the calling process's main module (a script file or module, not stdin or the prompt).

    Raises:
        GraphError: a stage's class or config cannot be pickled (a class defined inside a
            function, a lambda or an open file in the config, ...), or needs a main module
            the host cannot import, naming the stage.
    """
    if not main_importable:
        _check_main_free(plan)
    try:
        return pickle.dumps(plan)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        for spec in plan.stages:
            try:
                pickle.dumps((spec.factory, spec.config))
            except (pickle.PicklingError, AttributeError, TypeError) as stage_exc:
                raise GraphError(
                    f"stage {spec.name!r} cannot run on host {plan.name!r}: a spawned host "
                    f"gets its stage's class and config by pickle, and {stage_exc} (define the "
                    "class at module level; keep the config plain data)"
                ) from stage_exc
        raise GraphError(f"the plan of host {plan.name!r} cannot be pickled: {exc}") from exc
