"""The schedule stage's structured-outputs bookkeeping: compiled grammars and matchers.

As vLLM's ``StructuredOutputManager`` (``vllm/v1/structured_output/__init__.py``), which lives
beside its scheduler: one :class:`GrammarManager` owns the grammar backend (a plugin of
``actorline.grammars``, loaded with the model's tokenizer on the first compile), a cache of
compiled grammars by constraint key, and the matcher of every running constrained request.
The schedule stage compiles on a worker thread (:meth:`GrammarManager.compile`, thread-safe),
admits the request to the scheduler only once its grammar is ready, fills the bitmask of the
requests that sample in each planned step (:meth:`GrammarManager.bitmask`) and advances each
matcher by the tokens the step produced (:meth:`GrammarManager.accept`).

A preempted request keeps its output tokens (recompute re-runs prompt plus outputs), so its
matcher, which has accepted exactly those tokens, stays where it is; a matcher that is ahead
of the request's outputs (a step's token dropped) is rolled back to them by
:meth:`GrammarManager.sync`. See ``docs/architecture.md`` §11, "Structured outputs".
Pure logic: no asyncio, no torch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from stages.errors import InvalidRequestError
from stages.structured.backend import (
    BITMASK_DTYPE,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
    bitmask_width,
    load_grammar_backend,
)
from stages.structured.limits import GrammarLimits, check_grammar_limits, compile_stack_bytes
from stages.structured.params import StructuredOutputsParams

__all__ = ["CompileThread", "GrammarConfig", "GrammarManager", "GrammarStats"]

logger = logging.getLogger("actorline.grammar")

#: the longest reason from the backend a request's error quotes
_MAX_REASON = 2000


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarConfig:
    """``model``: whose tokenizer the backend wraps (alias, HF directory or .gguf).
    ``backend``: a name in the ``actorline.grammars`` plugin group. ``cache_size``: compiled
    grammars kept (least recently used dropped first). ``limits``: the bounds a constraint
    must keep before it is compiled (:mod:`stages.structured.limits`).

    Raises:
        ValueError: an empty model or backend name, a cache size below 1, limits that are
            not a GrammarLimits.
    """

    model: str
    backend: str = "llguidance"
    cache_size: int = 256
    limits: GrammarLimits = dataclasses.field(default_factory=GrammarLimits)

    def __post_init__(self) -> None:
        for name in ("model", "backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if type(self.cache_size) is not int or self.cache_size < 1:
            raise ValueError(f"cache_size must be an integer >= 1, got {self.cache_size!r}")
        if not isinstance(self.limits, GrammarLimits):
            raise ValueError(f"limits must be a GrammarLimits, got {self.limits!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarStats:
    """Counters since start: grammars compiled (cache misses), requests served from the
    cache, compile failures, and the seconds spent compiling (backend loading excluded, in
    ``load_seconds``)."""

    compiled: int
    cache_hits: int
    failures: int
    compile_seconds: float
    load_seconds: float


class _Running:
    __slots__ = ("kind", "matcher", "num_tokens")

    def __init__(self, matcher: GrammarMatcher, kind: str) -> None:
        self.matcher = matcher
        self.kind = kind  # the constraint's kind ("json", "regex", ...), for errors
        self.num_tokens = 0  # output tokens the matcher has seen


def _default_tokenizer(model: str) -> Any:
    from stages.tokenize import load_tokenizer

    return load_tokenizer(model)


class GrammarManager:
    """Compiled grammars (cached) and one matcher per running constrained request.

    :meth:`set_engine_info`'s vocabulary and EOS ids must be known before the first
    :meth:`compile`. Only :meth:`compile` and :meth:`cached` may be called from another
    thread than the owner's.

    Args:
        config: backend, tokenizer and cache size.
        tokenizer_loader: loads the model's HF tokenizer (for tests to share one).
    """

    def __init__(
        self,
        config: GrammarConfig,
        *,
        tokenizer_loader: Callable[[str], Any] = _default_tokenizer,
    ) -> None:
        self.config = config
        self._tokenizer_loader = tokenizer_loader
        self._vocab_size: int | None = None
        self._eos_token_ids: tuple[int, ...] = ()
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()  # the backend's loading and the cache
        self._cache: collections.OrderedDict[tuple[str, str, bool, bool], CompiledGrammar] = (
            collections.OrderedDict()
        )
        self._running: dict[str, _Running] = {}
        self._compiled = self._hits = self._failures = 0
        self._compile_seconds = self._load_seconds = 0.0

    def set_engine_info(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """The model's vocabulary size (bitmask rows cover it) and end-of-sequence ids."""
        self._vocab_size = int(vocab_size)
        self._eos_token_ids = tuple(int(t) for t in eos_token_ids)

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    # ------------------------------------------------------------------ compiling

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar of ``params`` if the cache holds it (counted as a hit)."""
        with self._lock:
            compiled = self._cache.get(params.key)
            if compiled is not None:
                self._cache.move_to_end(params.key)
                self._hits += 1
            return compiled

    def compile(
        self, params: StructuredOutputsParams, *, request_id: str | None = None
    ) -> CompiledGrammar:
        """The compiled grammar of ``params``: from the cache, or compiled now (seconds
        for the first one, which loads the backend and the tokenizer). Thread-safe; meant
        for a worker thread.

        Run it on :meth:`compile_thread`: its stack holds the deepest grammar the limits
        admit, where another thread's may overflow (and kill the process).

        Raises:
            InvalidRequestError: the constraint is over a bound of ``config.limits``, or the
                backend refuses it; the field is ``structured_outputs.<kind>`` and the
                message names the bound or carries the backend's reason.
            RuntimeError: :meth:`set_engine_info` was not called.
            plugins.PluginError: the backend cannot be loaded.
        """
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        try:
            check_grammar_limits(params, self.config.limits, request_id=request_id)
        except InvalidRequestError:
            with self._lock:
                self._failures += 1
            raise
        backend = self.backend()
        began = time.perf_counter()
        try:
            compiled = backend.compile(params)
        except GrammarCompileError as exc:
            with self._lock:
                self._failures += 1
            reason = str(exc) or type(exc).__name__
            if len(reason) > _MAX_REASON:
                reason = reason[:_MAX_REASON] + "..."
            field = f"structured_outputs.{params.kind}"
            raise InvalidRequestError(
                f"{field} does not compile ({backend.name}): {reason}",
                field=field,
                request_id=request_id,
            ) from exc
        elapsed = time.perf_counter() - began
        with self._lock:
            self._compiled += 1
            self._compile_seconds += elapsed
            self._cache[params.key] = compiled
            self._cache.move_to_end(params.key)
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        logger.debug("compiled a %s grammar in %.1f ms", params.kind, elapsed * 1e3)
        return compiled

    def compile_thread(self, name: str = "actorline-grammar") -> CompileThread:
        """A new one-thread executor for :meth:`compile`, its stack sized to
        ``config.limits`` (:func:`~stages.structured.limits.compile_stack_bytes`)."""
        return CompileThread(compile_stack_bytes(self.config.limits), name=name)

    def backend(self) -> GrammarBackend:
        """The grammar backend, loaded (with the model's tokenizer) on the first call.

        Raises:
            RuntimeError: :meth:`set_engine_info` was not called.
            plugins.PluginError: the backend cannot be loaded.
        """
        with self._lock:
            if self._backend is not None:
                return self._backend
            if self._vocab_size is None:
                raise RuntimeError("GrammarManager.set_engine_info() must come before compile()")
            began = time.perf_counter()
            cls = load_grammar_backend(self.config.backend)
            tokenizer = self._tokenizer_loader(self.config.model)
            self._backend = cls(tokenizer, self._vocab_size, self._eos_token_ids)
            self._load_seconds = time.perf_counter() - began
            logger.info(
                "grammar backend %s ready in %.2f s", self.config.backend, self._load_seconds
            )
            return self._backend

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(
                self._compiled,
                self._hits,
                self._failures,
                self._compile_seconds,
                self._load_seconds,
            )

    # ------------------------------------------------------------------ matching

    def start(self, request_id: str, compiled: CompiledGrammar, kind: str = "") -> None:
        """Give ``request_id`` a fresh matcher of ``compiled`` (a constraint of ``kind``)."""
        self._running[request_id] = _Running(compiled.matcher(), kind)

    def kind(self, request_id: str) -> str:
        """The kind of ``request_id``'s constraint, as :meth:`start` was told ("" if not)."""
        return self._running[request_id].kind

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._running

    def __len__(self) -> int:
        return len(self._running)

    def finish(self, request_id: str) -> None:
        """Drop ``request_id``'s matcher (done, aborted or failed); unknown ids are ignored."""
        self._running.pop(request_id, None)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance ``request_id``'s matcher by its new output tokens.

        Returns:
            False when the grammar refused a token (the matcher has failed: the schedule
            stage ends the request with a typed error, :meth:`error` says why).
        """
        running = self._running[request_id]
        ok = True
        for token_id in token_ids:
            running.num_tokens += 1
            if not running.matcher.accept_token(token_id):
                ok = False
        return ok

    def error(self, request_id: str) -> str | None:
        """Why ``request_id``'s matcher failed (the backend's reason: a lexer or parser limit
        hit, a token it refused), or None while it is sound. A backend whose matchers have no
        ``error()`` method reports nothing."""
        error = getattr(self._running[request_id].matcher, "error", None)
        if error is None:
            return None
        reason = error()
        if reason is not None and len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + "..."
        return None if reason is None else str(reason)

    def sync(self, request_id: str, num_output_tokens: int) -> None:
        """Roll ``request_id``'s matcher back to the request's ``num_output_tokens`` outputs
        when it has seen more (a step's token was dropped). Never moves it forward.

        Raises:
            ValueError: the matcher has seen fewer tokens than the request has.
        """
        running = self._running[request_id]
        excess = running.num_tokens - num_output_tokens
        if excess < 0:
            raise ValueError(
                f"request {request_id}: its grammar saw {running.num_tokens} tokens, "
                f"fewer than its {num_output_tokens} outputs"
            )
        if excess:
            running.matcher.rollback(excess)
            running.num_tokens = num_output_tokens

    def bitmask(self, request_ids: Sequence[str]) -> np.ndarray:
        """The tokens each of ``request_ids`` (all running here) allows next: one row per
        id, :func:`~stages.structured.backend.bitmask_width` of the backend's vocabulary (at
        least the model's) words wide.

        Raises:
            RuntimeError: no backend is loaded (nothing was compiled).
        """
        if self._backend is None or self._vocab_size is None:
            raise RuntimeError("no grammar has been compiled")
        width = bitmask_width(self._backend.vocab_size)
        bitmask = np.empty((len(request_ids), width), BITMASK_DTYPE)
        self._backend.fill_bitmask([self._running[r].matcher for r in request_ids], bitmask)
        return bitmask


_STACK_SIZE_LOCK = threading.Lock()


class CompileThread(concurrent.futures.Executor):
    """An executor of one daemon thread with its own stack size (``stack_bytes``), started on
    the first :meth:`submit`.

    ``threading.stack_size`` is process-wide and applies to threads created after it is set;
    it is set only while this thread starts (under a lock) and put back at once, so the
    process's other threads keep their default stack.
    """

    def __init__(self, stack_bytes: int, *, name: str = "actorline-grammar") -> None:
        self.stack_bytes = int(stack_bytes)
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._shutdown = False
        self._lock = threading.Lock()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` on the thread.

        Raises:
            RuntimeError: after :meth:`shutdown`, or the thread cannot be started.
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a CompileThread after shutdown")
            if self._thread is None:
                self._thread = self._start()
            self._queue.put((future, fn, args, kwargs))
        return future

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(self.stack_bytes)
            try:
                thread.start()
            finally:
                threading.stack_size(previous)
        return thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            if cancel_futures:
                pending = []
                while True:
                    try:
                        pending.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for item in pending:
                    if item is not None:
                        item[0].cancel()
            self._queue.put(None)
            thread = self._thread
        if wait and thread is not None:
            thread.join()
