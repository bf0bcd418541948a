"""Looking at child processes through /proc (Linux), for tests that check nothing leaks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.runtime.zygote import ZYGOTE_FLAG

HOST_MAIN = "pipeline.runtime.host_main"

__all__ = ["HOST_MAIN", "child_processes", "is_zygote", "process_alive", "wait_until"]


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc/PID/stat after the command name: state, parent, ..."""
    return stat.read_text().rsplit(")", 1)[1].split()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody reaped yet has exited)."""
    try:
        return _stat_fields(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except OSError:
        return False


def child_processes(parent: int | None = None) -> dict[int, str]:
    """Live (non-zombie) processes whose parent is ``parent`` (default: this process), mapped
    to their command lines; a zygote (pipeline.runtime.zygote: it lives as long as its parent)
    counts as the hosts it forked, which are its parent's hosts."""
    found = _children(os.getpid() if parent is None else parent)
    for pid, command in list(found.items()):
        if is_zygote(command):
            del found[pid]
            found.update(_children(pid))
    return found


def is_zygote(command: str) -> bool:
    """Whether ``command`` (a command line, as :func:`child_processes` gives it) is a zygote's
    (its hosts show the same command line, but are its children)."""
    return HOST_MAIN in command and ZYGOTE_FLAG in command.split()


def _children(parent: int) -> dict[int, str]:
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry / "stat")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found[int(entry.name)] = command.strip()
    return found


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate`` holds within ``timeout`` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
