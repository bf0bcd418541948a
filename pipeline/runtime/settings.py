"""Environment variables, read here and nowhere else.

- ``ACTORLINE_CACHE_DIR``: where converted models are cached (default
  ``$XDG_CACHE_HOME/actorline`` or ``~/.cache/actorline``).
- ``ACTORLINE_LOG_LEVEL``: log level of the ``actorline`` loggers (default ``WARNING``).
- ``ACTORLINE_HOST_START``: how a host process starts: ``fork`` (default on Linux: forked by a
  zygote that has done a host's imports once, :mod:`pipeline.runtime.zygote`) or ``spawn`` (a
  fresh interpreter for each host).
- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: vLLM's switch of its runtime LoRA endpoints, honoured
  by ``actorline serve`` as ``--enable-lora-runtime-updates`` (``1`` or ``true``, any case).

:func:`child_environment` is the environment a program this process starts gets (the
benchmarks' peers): this process's, with some variables set or removed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "HOST_STARTS",
    "cache_dir",
    "child_environment",
    "host_start",
    "log_level",
    "runtime_lora_updating",
]

#: the values of ``ACTORLINE_HOST_START``
HOST_STARTS = ("fork", "spawn")


def cache_dir() -> Path:
    """The actorline cache directory (not created here)."""
    explicit = os.environ.get("ACTORLINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actorline"


def log_level() -> str:
    return os.environ.get("ACTORLINE_LOG_LEVEL", "WARNING").upper()


def host_start() -> str:
    """How host processes start (``ACTORLINE_HOST_START``; see the module docstring).

    Raises:
        ValueError: the variable names no start method.
    """
    value = os.environ.get("ACTORLINE_HOST_START", "fork").strip().lower()
    if value not in HOST_STARTS:
        raise ValueError(
            f"ACTORLINE_HOST_START={value!r} is not a host start method: use one of "
            + ", ".join(HOST_STARTS)
        )
    return value


def runtime_lora_updating() -> bool:
    """Whether vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on (read as vLLM's ``envs.py``
    reads it: ``1`` or ``true``, any case)."""
    value = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    return value.strip().lower() in ("1", "true")


def child_environment(overrides: dict[str, str | None]) -> dict[str, str]:
    """A copy of this process's environment with ``overrides`` applied: a string sets the
    variable, ``None`` removes it."""
    environment = dict(os.environ)
    for name, value in overrides.items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return environment
