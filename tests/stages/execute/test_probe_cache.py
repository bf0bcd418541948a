"""Remembered load-time checks: the key follows what the checks depend on, a record is whole or
absent, and a runner whose checks passed once skips them on the next load of the same model
(and runs them again when anything in the key changes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.execute.probe_cache import checks_passed, probe_key, record_passed
from tests.conftest import share_kernels


def _key(model_dir: Path, **config: object) -> str:
    return probe_key(model_dir, {"torch": "2.13.0"}, [Path("/k/gemm-abc.so")], config)


def test_the_key_follows_files_versions_libraries_and_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = _key(model, dtype="float32")
    assert _key(model, dtype="float32") == base
    assert _key(model, dtype="bfloat16") != base
    assert (
        probe_key(model, {"torch": "2.14.0"}, [Path("/k/gemm-abc.so")], {"dtype": "float32"})
        != base
    )
    assert (
        probe_key(model, {"torch": "2.13.0"}, [Path("/k/gemm-def.so")], {"dtype": "float32"})
        != base
    )
    (model / "model.safetensors").write_bytes(b"weights")  # a new file
    assert _key(model, dtype="float32") != base
    changed = _key(model, dtype="float32")
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert _key(model, dtype="float32") != changed  # rewritten in place


def test_a_record_is_whole_and_an_unwritable_cache_is_ignored(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert not checks_passed(cache, "k1")
    record_passed(cache, "k1", tmp_path)
    assert checks_passed(cache, "k1") and not checks_passed(cache, "k2")
    assert [path.name for path in (cache / "probes").iterdir()] == ["k1"]  # no temporary left
    blocked = tmp_path / "file"
    blocked.write_text("")
    record_passed(blocked, "k1", tmp_path)  # its "probes" cannot be made: nothing raised
    assert not checks_passed(blocked, "k1")


def test_a_second_load_skips_the_checks(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.execute import runner as runner_module
    from stages.execute.config import ExecuteConfig
    from stages.execute.runner import ModelRunner

    monkeypatch.setenv("ACTORLINE_CACHE_DIR", str(share_kernels(tmp_path / "cache")))
    probes: list[int] = []
    original = runner_module.check_paged_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        probes.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner_module, "check_paged_attention", counting)
    config = ExecuteConfig(model=str(tiny_model_dir), num_blocks=16)
    ModelRunner(config).load()
    assert len(probes) == 1 and len(list((tmp_path / "cache" / "probes").iterdir())) == 1
    checks: list[bool] = []
    real = runner_module.use_cpu_linears

    def recording(model, **kwargs):  # type: ignore[no-untyped-def]
        checks.append(kwargs["verify"])
        return real(model, **kwargs)

    monkeypatch.setattr(runner_module, "use_cpu_linears", recording)
    ModelRunner(config).load()
    assert len(probes) == 1 and checks == [False]  # remembered: nothing checked again
    ModelRunner(ExecuteConfig(model=str(tiny_model_dir), num_blocks=16, fused_ops=False)).load()
    assert len(probes) == 2 and checks == [False, True]  # another configuration: checked
