"""The converted-model cache (stages/models.py, docs/models.md "The model cache"): written whole
or not at all, each file's size and sha256 recorded and checked on load, a damaged file a typed
error naming it and the command that rebuilds it. The model is a tiny GGUF file (about 5.8 MB
converted); the CLI's side is tests/pipeline/cli/test_model_cache_cli.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import stages.models as models
from pipeline import LLM
from stages.models import (
    ModelCacheCorruptError,
    ModelCacheFullError,
    ModelError,
    ModelFormatError,
    resolve_model,
)
from tests.conftest import share_kernels, small_tmpfs


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own, without models (never the shared real cache; the
    run's compiled kernels linked in)."""
    monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(share_kernels(tmp_path / "cache")))
    return tmp_path / "cache"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def zero_bytes(path: Path) -> None:
    """4 KiB in the middle zeroed in place, the file's mtime put back: only its ctime (which
    no one can set) tells it changed."""
    before = path.stat()
    with path.open("r+b") as handle:
        handle.seek(before.st_size // 2)
        handle.write(bytes(4096))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "zeroed": zero_bytes,
    "truncated": truncate,
    "random bytes": random_bytes,
}


def marker(entry: Path) -> dict[str, object]:
    return dict(json.loads((entry / "complete").read_text()))


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_file_is_a_typed_error_and_the_rebuild_fixes_it(
    tiny_gguf: Path, cache: Path, damage: str
) -> None:
    entry = resolve_model(tiny_gguf).path
    weights = entry / "model.safetensors"
    written = sha256(weights)
    DAMAGE[damage](weights)
    with pytest.raises(ModelCacheCorruptError) as caught:
        resolve_model(tiny_gguf)
    error = caught.value
    assert isinstance(error, ModelFormatError)
    command = f"actorline models prepare {tiny_gguf.resolve()} --force"
    assert (error.path, error.rebuild) == (str(weights), command)
    assert str(weights) in str(error) and command in str(error)
    assert "\n" not in str(error)
    # the command the error names rebuilds it: the same bytes as the first conversion
    assert resolve_model(tiny_gguf, rebuild=True).path == entry
    assert sha256(weights) == written
    assert resolve_model(tiny_gguf).path == entry


def test_a_missing_cache_file_is_the_same_typed_error(tiny_gguf: Path, cache: Path) -> None:
    entry = resolve_model(tiny_gguf).path
    (entry / "tokenizer.json").unlink()
    with pytest.raises(ModelCacheCorruptError, match=r"tokenizer\.json is missing; rebuild"):
        resolve_model(tiny_gguf)


def test_the_python_api_raises_the_typed_error(tiny_gguf: Path, cache: Path) -> None:
    weights = resolve_model(tiny_gguf).path / "model.safetensors"
    zero_bytes(weights)
    with pytest.raises(
        ModelCacheCorruptError, match=re.escape(f"{weights} does not match the sha256")
    ):
        LLM(str(tiny_gguf), transport="memory", num_blocks=16)


def test_a_start_hashes_only_files_changed_since_their_last_check(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes a start cheap: the conversion records each file's stat with its hash, and
    later loads compare stats; a file whose stat moved (touched, copied) is hashed once."""
    entry = resolve_model(tiny_gguf).path
    hashed: list[str] = []
    real_sha256 = models._sha256

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real_sha256(path)

    monkeypatch.setattr(models, "_sha256", counting)
    resolve_model(tiny_gguf)
    assert hashed == []
    os.utime(entry / "tokenizer.json")
    resolve_model(tiny_gguf)
    resolve_model(tiny_gguf)
    assert hashed == ["tokenizer.json"]
    hashed.clear()
    resolve_model(tiny_gguf, verify_all=True)  # `actorline models prepare` hashes every file
    assert sorted(hashed) == sorted(
        n for n in json.loads((entry / "complete").read_text())["files"]
    )


def test_an_old_marker_is_verified_and_upgraded_in_place(tiny_gguf: Path, cache: Path) -> None:
    """A cache written before checksums (``complete`` held only the source) is converted
    again to check it: the same bytes keep their files (a process reading them sees no
    change), the marker gains the record."""
    entry = resolve_model(tiny_gguf).path
    weights = entry / "model.safetensors"
    new_marker = marker(entry)
    (entry / "complete").write_text(json.dumps({"source": str(tiny_gguf)}))
    (entry / "verified").unlink()
    inode = weights.stat().st_ino
    assert resolve_model(tiny_gguf).path == entry
    assert marker(entry) == new_marker
    assert weights.stat().st_ino == inode


def test_an_old_marker_over_damaged_bytes_is_rebuilt(tiny_gguf: Path, cache: Path) -> None:
    entry = resolve_model(tiny_gguf).path
    weights = entry / "model.safetensors"
    written = sha256(weights)
    (entry / "complete").write_text(json.dumps({"source": str(tiny_gguf)}))
    zero_bytes(weights)
    assert resolve_model(tiny_gguf).path == entry
    assert sha256(weights) == written
    assert dict(marker(entry)["files"])["model.safetensors"]["sha256"] == written  # type: ignore[index]


def test_a_stale_temporary_directory_of_a_killed_run_is_removed(
    tiny_gguf: Path, cache: Path
) -> None:
    entry = resolve_model(tiny_gguf).path
    stale = entry.parent / f".{entry.name}-k1ll3d"  # as tempfile.mkdtemp names the staging
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1 << 20))
    assert resolve_model(tiny_gguf).path == entry  # a start that converts nothing
    assert sorted(p.name for p in entry.parent.iterdir()) == [".lock", entry.name]
    stale.mkdir()
    shutil.rmtree(entry)
    assert resolve_model(tiny_gguf).path == entry  # a conversion
    assert sorted(p.name for p in entry.parent.iterdir()) == [".lock", entry.name]


def test_a_truncated_gguf_is_a_typed_error_naming_it_before_any_conversion(
    tiny_gguf: Path, tmp_path: Path, cache: Path
) -> None:
    """A GGUF file cut short (a partial download) is refused from its tensor table, which
    says where each tensor's data lies: the first one past the file's end is named, before
    anything reads or dequantizes a tensor (transformers' conversion would, and only then
    fail, after a minute for the default model), and nothing is cached."""
    truncated = tmp_path / "truncated.gguf"
    whole = tiny_gguf.read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelFormatError) as caught:
        resolve_model(truncated)
    message = str(caught.value)
    assert f"{truncated} is not a readable GGUF model" in message, message
    assert re.search(
        rf"the file is truncated: tensor '[\w.]+' ends at byte \d+ but the file has "
        rf"{len(whole) // 2} bytes",
        message,
    ), message
    assert [p.name for p in (cache / "models").iterdir()] == [".lock"]


def test_a_full_disk_is_one_typed_error_leaving_nothing(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        with pytest.raises(ModelCacheFullError) as caught:
            resolve_model(tiny_gguf, cache=disk)
        error = caught.value
        assert error.directory == str(disk / "models")
        assert error.needed > 5 << 20 and error.free <= 1 << 20
        assert f"in {disk / 'models'}: it needs {error.needed} bytes" in str(error)
        assert [p.name for p in (disk / "models").iterdir()] == [".lock"]
        # the Python API's first start: the same typed error
        monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(disk))
        with pytest.raises(ModelCacheFullError, match=re.escape(str(error))):
            LLM(str(tiny_gguf), transport="memory", num_blocks=16)
        assert [p.name for p in (disk / "models").iterdir()] == [".lock"]


def test_a_disk_that_fills_up_midway_is_the_same_error_leaving_nothing(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The up-front check passed (an estimate short of the truth, or another writer filling
    the disk meanwhile): the write itself runs out of space (ENOSPC, from safetensors or
    the marker) and ends the same way."""
    monkeypatch.setattr(models, "_needed_bytes", lambda gguf: 0)
    with small_tmpfs(tmp_path / "disk", "3m") as disk:
        with pytest.raises(ModelCacheFullError) as caught:
            resolve_model(tiny_gguf, cache=disk)
        error = caught.value
        assert error.directory == str(disk / "models")
        assert isinstance(error.__cause__, Exception) and "No space left" in str(error.__cause__)
        assert error.needed > error.free and error.free > (3 << 20) - (64 << 10)  # all free again
        assert [p.name for p in (disk / "models").iterdir()] == [".lock"]


def test_a_read_only_cache_loads_and_cannot_be_upgraded_is_one_typed_error(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache on a read-only filesystem (a container's image) loads, hashing what it cannot
    record as checked once per process; an old marker there, which needs a conversion, is a
    ModelError saying the directory cannot be written, not an OSError's traceback."""
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        entry = resolve_model(tiny_gguf, cache=disk).path
        (entry / "verified").unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        hashed: list[str] = []
        real_sha256 = models._sha256

        def counting(path: Path) -> str:
            hashed.append(path.name)
            return real_sha256(path)

        monkeypatch.setattr(models, "_sha256", counting)
        assert resolve_model(tiny_gguf, cache=disk).path == entry
        assert resolve_model(tiny_gguf, cache=disk).path == entry
        assert sorted(hashed) == sorted(marker(entry)["files"])  # type: ignore[arg-type]
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        (entry / "complete").write_text(json.dumps({"source": str(tiny_gguf)}))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(ModelError, match=re.escape(f"cannot write the model cache in {disk}")):
            resolve_model(tiny_gguf, cache=disk)
