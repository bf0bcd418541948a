"""Load-time checks remembered: a model load whose checks all passed once on this machine, with
this code and these libraries, skips them the next time (docs/performance.md §3).

At load the model runner checks its own paths against the model's: each kind of swapped
linear against ``F.linear`` (:mod:`stages.execute.cpu`), each fused op against the module it
replaces (:mod:`stages.execute.fused`), and paged attention against the model's own attention on
a few tokens (the runner's probe). For a given checkpoint, code, library versions, compiled
kernels and configuration these computations are deterministic, so once they agreed they agree
again; repeating them is start-up time spent on the way to the first token. The same reasoning
lets the compiled kernels be cached (:mod:`stages.execute.native`).

:func:`probe_key` hashes everything the checks' outcome depends on: the checkpoint's files
(names, sizes, modification times), the source of the execute stage's modules, the versions
the caller passes (Python, torch, transformers), the compiled kernel libraries (their names
carry their source, flags and CPU) and the configuration fields that change what runs. A key
is recorded (:func:`record_passed`) only after every check passed; anything that changes makes
a new key, whose first load checks again. Pure logic over files: no torch here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["checks_passed", "probe_key", "record_passed"]

_SOURCES = Path(__file__).parent


def _files(directory: Path) -> Iterable[str]:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            stat = path.stat()
            yield f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}"


def probe_key(
    model_dir: Path,
    versions: Mapping[str, str],
    libraries: Iterable[Path],
    config: Mapping[str, object],
) -> str:
    """The key of one load's checks (see the module docstring)."""
    digest = hashlib.sha256()
    for part in _files(model_dir):
        digest.update(part.encode() + b"\0")
    for source in sorted(_SOURCES.rglob("*.py")) + sorted(_SOURCES.rglob("*.c")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(json.dumps(dict(versions), sort_keys=True).encode())
    digest.update("\0".join(sorted(path.name for path in libraries)).encode())
    digest.update(json.dumps({k: repr(v) for k, v in config.items()}, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def checks_passed(cache: Path, key: str) -> bool:
    """Whether a load with ``key`` passed every check before (a record under ``cache``)."""
    return (cache / "probes" / key).is_file()


def record_passed(cache: Path, key: str, model_dir: Path) -> None:
    """Remember that a load with ``key`` passed every check (written whole or not at all; a
    cache directory that cannot be written is ignored: the next load checks again)."""
    directory = cache / "probes"
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".probe-")
        with os.fdopen(handle, "w") as out:
            json.dump({"model": str(model_dir)}, out)
        os.replace(temporary, directory / key)
