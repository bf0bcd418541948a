"""Crash notes: a few bytes a host process writes about what it is doing, that its parent
reads once it died (docs/architecture.md §4.7).

The parent (:class:`~pipeline.runtime.processes.ProcessHost`) makes a small file per host
(:class:`CrashNoteFile`) and names it in the host's plan; the host maps it
(:func:`open_note`) and a stage writes one line per unit of work (:func:`note`: the engine
writes the request ids of each step before running it). The write is a copy into shared
memory, no system call, so it costs next to nothing per step. When the process dies (SIGKILL,
a crash in native code) the page is still in the file, and the parent names what was running
in the line that reports the death. A host without a note file (a Ray host, a stage in the
main process) writes nowhere: :func:`note` is then a no-op.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile

__all__ = ["NOTE_SIZE", "CrashNoteFile", "close_note", "note", "open_note"]

#: bytes of a note file (a note longer than this is cut; the last byte ends the text)
NOTE_SIZE = 512

_mapped: mmap.mmap | None = None


class CrashNoteFile:
    """The parent's side: a zeroed file of :data:`NOTE_SIZE` bytes, read after the host died.

    Raises (from the constructor): OSError when the file cannot be made.
    """

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="actorline-note-")
        try:
            os.write(fd, bytes(NOTE_SIZE))
        finally:
            os.close(fd)

    def read(self) -> str:
        """The host's latest note ("" if it wrote none, or the file is gone)."""
        try:
            with open(self.path, "rb") as file:
                data = file.read(NOTE_SIZE)
        except OSError:
            return ""
        return data.split(b"\0", 1)[0].decode("utf-8", "replace")

    def remove(self) -> None:
        """Delete the file. Idempotent; never raises."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def open_note(path: str) -> None:
    """In the host process: map the note file ``path`` ("" for none), for :func:`note`.
    A file that cannot be mapped leaves notes off (they are a diagnostic, never a failure)."""
    global _mapped
    close_note()
    if not path:
        return
    try:
        with open(path, "r+b") as file:
            _mapped = mmap.mmap(file.fileno(), NOTE_SIZE)
    except (OSError, ValueError):
        _mapped = None


def close_note() -> None:
    """Unmap the note file, if one is mapped."""
    global _mapped
    mapped, _mapped = _mapped, None
    if mapped is not None:
        with contextlib.suppress(Exception):
            mapped.close()


def note(text: str) -> None:
    """Record ``text`` as what this process is doing (cut to :data:`NOTE_SIZE` - 1 bytes);
    a no-op without a note file."""
    mapped = _mapped
    if mapped is None:
        return
    data = text.encode("utf-8", "replace")[: NOTE_SIZE - 1]
    mapped[: len(data) + 1] = data + b"\0"
