"""How the OpenMP workers of an engine process wait between parallel regions (the
``omp_wait_policy`` option; docs/architecture.md §6.5, docs/performance.md §13).

torch's CPU wheel ships its own GNU OpenMP runtime (``torch/lib/libgomp.so.1``), and the
native kernels link ``libgomp.so.1`` by soname, so every parallel region of a process (torch's
ops, MKL's, the step graph's) runs on that one runtime's worker threads. Between two regions
a GNU OpenMP worker spins ``GOMP_SPINCOUNT`` times on a ``pause`` instruction before it
sleeps on a futex: 300,000 spins by default (``OMP_WAIT_POLICY`` unset), which on a CPU whose
``pause`` takes ~100 cycles (Intel since Skylake) is 8-16 ms — longer than a whole decode step
of a small model. The worker then never sleeps during decode: it burns the other core while the
step's Python (sampler, scheduler, the stage hops) runs on one, and on a machine shared with
other work it takes that core from whoever needed it. The runtime reads these variables once,
when it is loaded (libgomp's ``initialize_env``), so they must be in the environment before
torch is imported: :func:`apply_omp_policy` runs first thing in a spawned host process
(:mod:`pipeline.runtime.host_main`), and the parent hands the policy down in
:data:`POLICY_ENV`.

- ``auto``: spin briefly (:data:`AUTO_SPIN_COUNT` pauses, ~25-50 µs here: about a futex
  wake, so back-to-back regions do not pay one, far short of the step's Python between two
  steps), and let the execute stage try one thread while the machine is oversubscribed
  (:mod:`stages.execute.contention`).
- ``active``: ``OMP_WAIT_POLICY=ACTIVE`` (spin without end: a machine the engine has to
  itself); ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once: a busy shared machine).

A value the user set (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment) wins over
every policy. Pure: no torch, no asyncio.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

__all__ = [
    "AUTO_SPIN_COUNT",
    "OMP_WAIT_POLICIES",
    "POLICY_ENV",
    "USER_VARIABLES",
    "apply_omp_policy",
    "omp_environment",
    "openmp_loaded",
    "wait_policy_in_effect",
]

#: the values of the ``omp_wait_policy`` option
OMP_WAIT_POLICIES = ("auto", "active", "passive")

#: the environment variable a parent sets for the host processes it spawns
POLICY_ENV = "ACTORLINE_OMP_WAIT_POLICY"

#: what the user may set instead of the option (each wins over it)
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

#: ``GOMP_SPINCOUNT`` under ``auto``: 1,000 pauses, ~25-50 µs on an Intel Xeon (measured:
#: 300,000 pauses took 7.8-16 ms there), less on CPUs with a shorter ``pause``; the count
#: libgomp itself falls to when it has more threads than CPUs (its throttled spin count,
#: libgomp/env.c). Passive waits beat libgomp's default and 10,000 pauses on a loaded machine
#: (docs/performance.md §13, "Threads between regions")
AUTO_SPIN_COUNT = 1_000


def _check(policy: str) -> None:
    if policy not in OMP_WAIT_POLICIES:
        raise ValueError(f"omp_wait_policy must be one of {OMP_WAIT_POLICIES}, got {policy!r}")


def omp_environment(policy: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables to add to ``environ`` for ``policy`` (none where the user set
    one of :data:`USER_VARIABLES`).

    Raises:
        ValueError: ``policy`` is not one of :data:`OMP_WAIT_POLICIES`.
    """
    _check(policy)
    if any(name in environ for name in USER_VARIABLES):
        return {}
    if policy == "active":
        return {"OMP_WAIT_POLICY": "ACTIVE"}
    if policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(AUTO_SPIN_COUNT)}


def openmp_loaded(maps: str = "/proc/self/maps") -> bool | None:
    """Whether a GNU OpenMP runtime is mapped into this process already (too late then to
    set its variables); None where ``maps`` cannot be read (not Linux)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as file:
            return any("libgomp" in line for line in file)
    except OSError:
        return None


def wait_policy_in_effect(environ: Mapping[str, str] | None = None) -> str:
    """How this process's OpenMP workers wait, in words for the log and ``EngineInfo``:
    ``"auto (GOMP_SPINCOUNT=10000)"``, ``"passive (OMP_WAIT_POLICY=PASSIVE)"``,
    ``"user (GOMP_SPINCOUNT=0)"``, or ``"runtime default"`` where nothing was set."""
    environ = os.environ if environ is None else environ
    policy = environ.get(POLICY_ENV, "")
    settings = " ".join(f"{name}={environ[name]}" for name in USER_VARIABLES if name in environ)
    if not settings:
        return "runtime default"
    if policy in OMP_WAIT_POLICIES and omp_environment(policy, {}) == {
        name: environ[name] for name in USER_VARIABLES if name in environ
    }:
        return f"{policy} ({settings})"
    return f"user ({settings})"


def apply_omp_policy(
    policy: str | None = None, environ: MutableMapping[str, str] | None = None
) -> bool:
    """Set ``policy`` (None: :data:`POLICY_ENV` of ``environ``, else ``auto``) in ``environ``
    (default ``os.environ``) for the OpenMP runtime this process will load, unless the user
    set one of :data:`USER_VARIABLES` or the runtime is loaded already. Returns whether the
    variables now in ``environ`` are the ones the runtime reads (False: it was loaded before;
    they then take effect in child processes only).

    Raises:
        ValueError: ``policy`` (or :data:`POLICY_ENV`) is not one of
            :data:`OMP_WAIT_POLICIES`.
    """
    environ = os.environ if environ is None else environ
    chosen = policy if policy is not None else environ.get(POLICY_ENV) or "auto"
    additions = omp_environment(chosen, environ)
    if environ is os.environ and openmp_loaded():
        return False
    environ.update(additions)
    environ[POLICY_ENV] = chosen
    return True
