"""The Stage: an actor with a bounded mailbox, named input and output ports.

A stage is built from plain, picklable config (so a spawned process can build it), loads heavy
resources in :meth:`Stage.start`, then handles one message at a time. Dispatch is on the
message's type, declared with :func:`handles`::

    class Square(Stage):
        inputs = ("in",)
        outputs = ("out",)

        @handles(Number)
        async def on_number(self, message: Number) -> None:
            await self.emit("out", Number(message.value ** 2))

A handler that raises fails the pipeline (supervision): every pending call gets a
:class:`~pipeline.runtime.errors.StageFailedError`, unless the stage's :meth:`Stage.recover`
contains the failure: a stage whose messages belong to independent units of work (one request
each) answers the unit whose message failed and goes on (docs/architecture.md, "Failure: one
request or the pipeline"). Bad input from callers should be answered with a typed error
message in the first place; a raise that nothing contains means the stage itself is broken.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pipeline.runtime.errors import PipelineError, UnhandledMessageError
from transports.errors import EndOfStream, LinkClosedError, PeerLostError

if TYPE_CHECKING:
    from pipeline.runtime.host import LocalHost
    from pipeline.runtime.replicas import ReplicaLost, ReplicaRestored

__all__ = ["Handler", "Stage", "handles", "recoverable"]

T = TypeVar("T")
Handler = Callable[[Any], Awaitable[None]]
_HANDLES_ATTRIBUTE = "__actorline_handles__"


def handles(*message_types: type, port: str | None = None) -> Callable[[T], T]:
    """Mark an ``async def handler(self, message)`` method as the handler of ``message_types``
    (arriving on ``port``, or on any port when None)."""
    if not message_types:
        raise TypeError("handles() needs at least one message type")

    def mark(function: T) -> T:
        name = getattr(function, "__qualname__", repr(function))
        _check_async_method(function, f"handler {name}", ("self", "message"))
        existing = getattr(function, _HANDLES_ATTRIBUTE, ())
        setattr(function, _HANDLES_ATTRIBUTE, (*existing, *((port, t) for t in message_types)))
        return function

    return mark


#: what a handler may raise that no stage can recover from: the runtime's and the links' own
#: failures (an EncodeError, one message a link cannot carry, is the message's, not the
#: link's) and broken invariants
_NEVER_RECOVERED = (PipelineError, EndOfStream, LinkClosedError, PeerLostError, AssertionError)


def recoverable(error: BaseException) -> bool:
    """Whether a stage may recover from ``error`` raised by one of its handlers (see
    :meth:`Stage.recover`): any Exception but the runtime's and the links' own failures
    (a lost or closed link, a deadlock, an unknown port or message type) and an
    AssertionError (a broken invariant)."""
    return isinstance(error, Exception) and not isinstance(error, _NEVER_RECOVERED)


def _check_async_method(function: object, what: str, parameters: tuple[str, ...]) -> None:
    """Raise TypeError (naming ``what``) unless ``function`` is an ``async def`` that can be
    called with ``parameters``."""
    if not inspect.iscoroutinefunction(function):
        raise TypeError(f"{what} must be an 'async def' method")
    try:
        inspect.signature(function).bind(*(None for _ in parameters))
    except TypeError:
        raise TypeError(f"{what} must take ({', '.join(parameters)})") from None


class Stage:
    """Base class of every pipeline stage.

    Class attributes: ``inputs`` / ``outputs`` (port names), ``optional_outputs`` (outputs
    a pipeline may leave linked to nothing, their messages then dropped; every other output
    must be linked, or the pipeline does not start), ``mailbox_capacity`` (the bound of the
    inbox shared by all input ports), ``host_preload`` (modules, or ``module:attribute`` for
    packages that import lazily, that the stage imports as it starts: a host zygote imports
    them once for all the hosts it forks, :mod:`pipeline.runtime.zygote`). Subclasses override
    :meth:`start`, :meth:`stop` and declare handlers with :func:`handles`, or override
    :meth:`handle` entirely.
    """

    api_version: ClassVar[int] = 1
    inputs: ClassVar[tuple[str, ...]] = ("in",)
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    optional_outputs: ClassVar[tuple[str, ...]] = ()
    mailbox_capacity: ClassVar[int] = 1024
    host_preload: ClassVar[tuple[str, ...]] = ()
    _handler_table: ClassVar[dict[tuple[str | None, type], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[tuple[str | None, type], str] = {}
        for klass in reversed(cls.__mro__):
            for attribute, value in vars(klass).items():
                for key in getattr(value, _HANDLES_ATTRIBUTE, ()):
                    table[key] = attribute
        cls._handler_table = table
        if "handle" in vars(cls):
            _check_async_method(
                vars(cls)["handle"], f"{cls.__qualname__}.handle", ("self", "message", "port")
            )
        for name in cls.optional_outputs:
            if name not in cls.outputs:
                raise TypeError(
                    f"{cls.__qualname__}: optional output {name!r} is not among its outputs "
                    f"{cls.outputs}"
                )
        for ports in (cls.inputs, cls.outputs):
            if isinstance(ports, str) or len(set(ports)) != len(ports):
                raise TypeError(f"{cls.__qualname__}: ports must be a tuple of distinct names")

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self._host: LocalHost | None = None
        self._name = type(self).__name__
        self._handlers: dict[tuple[str | None, type], Handler] = {
            key: getattr(self, attribute) for key, attribute in self._handler_table.items()
        }
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # -- lifecycle (override) -----------------------------------------------------------------

    async def start(self) -> None:
        """Load resources (models, tokenizers). Called once before any message arrives."""

    async def stop(self) -> None:
        """Release resources. Called once at shutdown, after the last message."""

    def idle(self) -> bool:
        """False while the stage holds work not visible in its mailbox (e.g. queued requests);
        a graceful shutdown waits for every stage to be idle."""
        return True

    async def recover(self, message: Any, port: str, error: Exception) -> bool:
        """A handler raised ``error`` on ``message`` (arrived on ``port``). Return True once
        the failure is contained: whatever ``message`` belongs to (one request, say) was
        answered, and the stage's own state is as if the message had not come, so the stage
        goes on with its next message. Return False (the default) when it cannot be: the
        stage is broken, and the pipeline fails.

        Never called for the runtime's own errors (a lost or closed link, a deadlock, an
        unknown port or message type) nor for an AssertionError (a broken invariant): those
        always fail the pipeline. If this raises, the pipeline fails with ``error``.
        """
        return False

    def contained(self, error: Exception, message: object, request_id: str) -> None:
        """Log and count a failure this stage's handler contained itself: request
        ``request_id``'s part of ``message``, a message of many requests (one row of a
        batch), raised ``error`` and the handler answered that request with a typed error
        and went on with the rest. The host logs and counts it as it does what
        :meth:`recover` contains (``StageStatistics.recovered``; docs/architecture.md §7.2):
        the first failure of each exception type with its traceback, later ones in one line,
        so that a request repeated at will cannot flood the log.

        Raises:
            RuntimeError: the stage is not running in a pipeline.
        """
        if self._host is None:
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        self._host.contained(self._name, error, message, request_id)

    async def on_replica_lost(self, lost: ReplicaLost) -> None:
        """A replica this stage is linked to failed and was cut off (see
        :mod:`pipeline.runtime.replicas`): nothing more arrives from it, what is sent to it
        is dropped. Called in turn with the handlers, after every message the replica had
        sent this stage. The default does nothing."""

    async def on_replica_restored(self, restored: ReplicaRestored) -> None:
        """A replica this stage is linked to, lost earlier, runs again on fresh hosts (see
        :meth:`RunningPipeline.restore_replica
        <pipeline.runtime.running.RunningPipeline.restore_replica>`): what is sent to it is
        delivered again. Called in turn with the handlers. The default does nothing."""

    # -- messages -----------------------------------------------------------------------------

    async def handle(self, message: Any, port: str) -> None:
        """Dispatch ``message`` (arrived on ``port``) to its handler by type.

        Raises:
            UnhandledMessageError: no handler for this type on this port.
        """
        handlers = self._handlers
        kind = type(message)
        handler = handlers.get((port, kind)) or handlers.get((None, kind))
        if handler is None:
            for base in kind.__mro__[1:]:
                handler = handlers.get((port, base)) or handlers.get((None, base))
                if handler is not None:
                    handlers[(port, kind)] = handler
                    break
            else:
                raise UnhandledMessageError(
                    f"stage {self.name!r} has no handler for {kind.__qualname__} on port {port!r}"
                )
        await handler(message)

    async def emit(self, port: str, message: object, *, to: str | None = None) -> None:
        """Send ``message`` to every link of output ``port`` (waits while a link is full), or
        with ``to`` only to the links of ``port`` into the stage named ``to``.

        Raises:
            GraphError: ``port`` is not one of this stage's outputs, or ``to`` names a stage
                that ``port`` is not linked to.
        """
        if self._host is None:
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        await self._host.emit(self._name, port, message, to)

    def colocated(self, port: str) -> Stage | None:
        """The stage this stage's output ``port`` is linked to, when the port has exactly one
        link and that stage runs on this stage's host (same process, same event loop); None
        otherwise (no link, several, an exit, or a stage on another host). Such a stage's
        methods may be called directly through :meth:`call` instead of a message (the
        schedule stage calls its execute stage so, docs/architecture.md §2.7).

        Raises:
            RuntimeError: the stage is not running in a pipeline.
        """
        if self._host is None:
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        return self._host.colocated(self._name, port)

    async def call(self, stage: Stage, handler: Callable[[Any], Awaitable[T]], message: Any) -> T:
        """Run ``handler(message)``, a method of the :meth:`colocated` ``stage``, in this
        stage's task, as if ``stage`` handled a message: counted in ``stage``'s statistics
        (messages handled, handle seconds), and a raise fails the pipeline as ``stage``'s
        failure before it propagates here. ``stage``'s own handlers still run one at a time
        in its task; the caller makes sure the two do not step on each other.

        Raises:
            RuntimeError: the stage is not running in a pipeline.
            whatever ``handler`` raises.
        """
        if self._host is None:
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        return await self._host.call(stage.name, handler, message)

    def record_work(self, seconds: float) -> None:
        """Count ``seconds`` of this stage's work done outside its handlers (a loop it
        spawned) as one message handled, in its statistics (docs/architecture.md §7.2), so
        profiles see it.

        Raises:
            RuntimeError: the stage is not running in a pipeline.
        """
        if self._host is None:
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        self._host.record_work(self._name, seconds)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` on the stage's event loop beside its handlers: background work
        that awaits something slow (a job on a worker thread), then acts, without holding up
        the messages behind it. It runs between the handlers' awaits, never inside one
        handler's synchronous code. If it raises, the stage fails as if a handler had; when
        the host stops, what still runs is cancelled. (A stage with background work should
        say so in :meth:`idle`.)

        Raises:
            RuntimeError: the stage is not running in a pipeline.
        """
        if self._host is None:
            coroutine.close()
            raise RuntimeError(f"stage {self.name!r} is not running in a pipeline")
        self._host.spawn(self._name, coroutine)

    # -- helpers ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The stage's name in its pipeline."""
        return self._name

    @property
    def host_name(self) -> str:
        """The name of the host the stage runs on ("" before the pipeline places it)."""
        return self._host.name if self._host is not None else ""

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"actorline.stage.{self._name}")

    async def run_in_thread(self, function: Callable[..., T], *args: Any) -> T:
        """Run blocking ``function(*args)`` on this stage's own worker thread (one thread per
        stage, so thread-affine work such as a model's forward pass stays on one thread)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"actorline-{self._name}"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args))

    def _bind(self, host: LocalHost, name: str) -> None:
        self._host = host
        self._name = name

    def _shutdown_executor(self) -> None:
        """Release the worker thread without blocking the event loop: jobs not started yet
        are cancelled; a job already running (its awaiting task was cancelled) finishes on
        its own, then the thread exits. (The interpreter joins the thread at exit; a host
        process that does not exit in time is terminated by its controller.)"""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
