"""Scheduling policies: which waiting request runs next, which running one is preempted.

A policy is a plugin of the ``actorline.schedulers`` entry-point group (protocol version 1,
checked by :mod:`plugins`). The scheduler (:mod:`stages.scheduler`) keeps all bookkeeping and
asks the policy only two questions, passing read-only :class:`RequestView` objects:

- :meth:`SchedulingPolicy.order_waiting`: the waiting requests in the order to admit them;
- :meth:`SchedulingPolicy.select_victim`: the running request to preempt when KV blocks run out.

It also tells the policy what happens (``on_arrival``, ``on_step``, ``on_finish``) so a policy
can learn. Built in: ``fcfs``, ``priority`` (as vLLM's ``--scheduling-policy``) and ``sjf``.
Everything here is pure Python (no asyncio, zmq, grpc or torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

from plugins import SCHEDULERS, PluginError, load_instance

__all__ = [
    "API_VERSION",
    "FcfsPolicy",
    "PolicyConstructionError",
    "PriorityPolicy",
    "RequestView",
    "SchedulingPolicy",
    "ShortestJobFirstPolicy",
    "StepObservation",
    "load_policy",
]

API_VERSION = 1


@runtime_checkable
class RequestView(Protocol):
    """What a policy may read about one request (the scheduler owns the state).

    ``arrival_time`` is the scheduler's clock when the request reached it; ``arrival_index``
    counts arrivals (0, 1, 2, ...) and breaks ties between equal times.
    ``num_computed_tokens`` is 0 for a request waiting after preemption (it is recomputed).
    """

    @property
    def request_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def arrival_index(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class StepObservation:
    """What one engine step did: ``duration`` seconds of model forward (wall time of the step
    when execute does not report it) for ``num_prefill_tokens`` prompt/recompute tokens and
    ``num_decode_tokens`` single-token decodes.

    Raises:
        ValueError: a negative or non-finite value.
    """

    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.duration) or self.duration < 0:
            raise ValueError(f"duration must be a finite number >= 0, got {self.duration!r}")
        if self.num_prefill_tokens < 0:
            raise ValueError(f"num_prefill_tokens must be >= 0, got {self.num_prefill_tokens}")
        if self.num_decode_tokens < 0:
            raise ValueError(f"num_decode_tokens must be >= 0, got {self.num_decode_tokens}")


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The ``actorline.schedulers`` protocol, version 1.

    A plugin is a class with ``api_version = 1``, a ``name`` and the five methods below; it
    is constructed with no arguments by :func:`load_policy`. Methods are called from the
    scheduler's single thread, between steps; they must not keep the views they are given
    beyond the call except by request id.
    """

    api_version: ClassVar[int]
    name: str

    def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
        """Return ``waiting`` reordered: the first is admitted first. Must be a permutation."""
        ...

    def select_victim(self, running: Sequence[RequestView]) -> RequestView:
        """Return the request of ``running`` (never empty) to preempt."""
        ...

    def on_arrival(self, request: RequestView) -> None:
        """A request reached the scheduler."""
        ...

    def on_step(self, observation: StepObservation) -> None:
        """An engine step finished."""
        ...

    def on_finish(self, request: RequestView) -> None:
        """A request finished or was aborted; it will not be seen again."""
        ...


def _arrival_key(request: RequestView) -> tuple[float, int]:
    return (request.arrival_time, request.arrival_index)


class _NoHooks:
    """Policies that do not learn: the notification hooks do nothing."""

    api_version: ClassVar[int] = API_VERSION

    def on_arrival(self, request: RequestView) -> None:
        return None

    def on_step(self, observation: StepObservation) -> None:
        return None

    def on_finish(self, request: RequestView) -> None:
        return None


class FcfsPolicy(_NoHooks):
    """First come, first served: admit in arrival order; preempt the latest arrival
    (vLLM ``fcfs``)."""

    name = "fcfs"

    def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
        return sorted(waiting, key=_arrival_key)

    def select_victim(self, running: Sequence[RequestView]) -> RequestView:
        return max(running, key=_arrival_key)


class PriorityPolicy(_NoHooks):
    """Smaller ``priority`` value first, ties by arrival; preempt the largest priority value,
    then the latest arrival (vLLM ``priority``)."""

    name = "priority"

    def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
        return sorted(waiting, key=lambda r: (r.priority, *_arrival_key(r)))

    def select_victim(self, running: Sequence[RequestView]) -> RequestView:
        return max(running, key=lambda r: (r.priority, *_arrival_key(r)))


class ShortestJobFirstPolicy(_NoHooks):
    """Shortest predicted remaining work first; preempt the longest.

    Remaining work (seconds) = tokens still to compute before the next sample * seconds per
    prefill token + tokens still to generate (``max_tokens`` - generated) * seconds per decode
    token. Both rates start at a prior and follow an exponentially weighted moving average of
    the observed steps: a prefill-only step updates the prefill rate, a decode-only step the
    decode rate, and a mixed step scales both by observed / predicted duration.

    Raises:
        ValueError: a prior that is not > 0 or a ``smoothing`` outside (0, 1].
    """

    name = "sjf"

    # Priors for a small model on CPU; only their ratio matters until steps are observed.
    DEFAULT_SECONDS_PER_PREFILL_TOKEN = 1e-4
    DEFAULT_SECONDS_PER_DECODE_TOKEN = 1e-3
    DEFAULT_SMOOTHING = 0.1

    def __init__(
        self,
        seconds_per_prefill_token: float = DEFAULT_SECONDS_PER_PREFILL_TOKEN,
        seconds_per_decode_token: float = DEFAULT_SECONDS_PER_DECODE_TOKEN,
        smoothing: float = DEFAULT_SMOOTHING,
    ) -> None:
        for field, value in (
            ("seconds_per_prefill_token", seconds_per_prefill_token),
            ("seconds_per_decode_token", seconds_per_decode_token),
        ):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.seconds_per_prefill_token = float(seconds_per_prefill_token)
        self.seconds_per_decode_token = float(seconds_per_decode_token)
        self.smoothing = float(smoothing)

    def predict_remaining(self, request: RequestView) -> float:
        """Predicted seconds of work left for ``request``."""
        remaining_prefill = max(request.num_tokens - request.num_computed_tokens, 0)
        remaining_decode = max(request.max_tokens - request.num_output_tokens, 0)
        return (
            remaining_prefill * self.seconds_per_prefill_token
            + remaining_decode * self.seconds_per_decode_token
        )

    def order_waiting(self, waiting: Sequence[RequestView]) -> Sequence[RequestView]:
        return sorted(waiting, key=lambda r: (self.predict_remaining(r), *_arrival_key(r)))

    def select_victim(self, running: Sequence[RequestView]) -> RequestView:
        return max(running, key=lambda r: (self.predict_remaining(r), *_arrival_key(r)))

    def _blend(self, current: float, observed: float) -> float:
        return (1.0 - self.smoothing) * current + self.smoothing * observed

    def on_step(self, observation: StepObservation) -> None:
        prefill, decode = observation.num_prefill_tokens, observation.num_decode_tokens
        if observation.duration <= 0 or prefill + decode == 0:
            return
        if decode == 0:
            observed = observation.duration / prefill
            self.seconds_per_prefill_token = self._blend(self.seconds_per_prefill_token, observed)
        elif prefill == 0:
            observed = observation.duration / decode
            self.seconds_per_decode_token = self._blend(self.seconds_per_decode_token, observed)
        else:
            predicted = (
                prefill * self.seconds_per_prefill_token + decode * self.seconds_per_decode_token
            )
            scale = observation.duration / predicted
            self.seconds_per_prefill_token = self._blend(
                self.seconds_per_prefill_token, self.seconds_per_prefill_token * scale
            )
            self.seconds_per_decode_token = self._blend(
                self.seconds_per_decode_token, self.seconds_per_decode_token * scale
            )


class PolicyConstructionError(PluginError, RuntimeError):
    """A scheduler plugin imported fine but could not be constructed (cause chained)."""


def load_policy(name: str) -> SchedulingPolicy:
    """Load the ``actorline.schedulers`` plugin ``name`` and construct it (no arguments).

    Raises:
        plugins.PluginNotFoundError: no such policy (the message lists the installed ones).
        plugins.PluginLoadError: its entry point failed to import.
        plugins.PluginProtocolError: it lacks a method or attribute of the protocol.
        PolicyConstructionError: its constructor raised, or the instance's ``name`` is not a
            string.
    """
    policy: SchedulingPolicy = load_instance(SCHEDULERS, name, PolicyConstructionError)
    return policy
