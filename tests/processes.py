"""Looking at child processes through /proc (Linux), for tests that check nothing leaks."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.runtime.zygote import zygote_pids

__all__ = ["child_processes", "process_alive"]


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
    to their command lines; a zygote of this process (pipeline.runtime.zygote, which lives as
    long as the process does) counts as the hosts it forked, which are this process's hosts."""
    if parent is None:
        zygotes = zygote_pids()
        found = _children(os.getpid())
        for zygote in zygotes & set(found):
            del found[zygote]
            found.update(_children(zygote))
        return found
    return _children(parent)


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
