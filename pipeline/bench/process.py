"""Measuring a process from outside: peak resident memory and CPU time, read from /proc
(Linux). Both return None where /proc is unavailable or the process is gone."""

from __future__ import annotations

import os

__all__ = ["child_pids", "cpu_seconds", "peak_rss_bytes", "rss_bytes"]


def _status_bytes(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set size so far (``VmHWM`` in /proc/<pid>/status)."""
    return _status_bytes(pid, "VmHWM:")


def rss_bytes(pid: int) -> int | None:
    """The process's resident set size now (``VmRSS`` in /proc/<pid>/status)."""
    return _status_bytes(pid, "VmRSS:")


def cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """User + system CPU seconds the process has used (all its threads; only thread id
    ``thread``'s where given: ``pid`` itself is the main thread), from /proc; None where
    unavailable."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        with open(path) as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime field 14, stime field 15 (1-based).
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The process's children now (every thread's ``children`` in /proc); empty where
    unavailable."""
    children: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listed:
                children.extend(int(child) for child in listed.read().split())
        except OSError:
            continue
    return sorted(set(children))
