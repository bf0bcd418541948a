"""``benchmarks.bf16_gemm``, ``benchmarks.bf16_widen`` and ``benchmarks.bf16_batch`` run end to
end and print well-formed, positive figures (never a timing threshold)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import bf16_batch, bf16_gemm, bf16_widen
from stages.execute.bf16 import bf16_gemm_kernel

ROOT = Path(__file__).resolve().parents[2]
_MS = re.compile(r"(amx|vdpbf16ps|unpack\+torch)\s+([0-9.]+) ms")


def test_bf16_gemm_times_each_path_at_each_shape(capsys: pytest.CaptureFixture[str]) -> None:
    kernel = bf16_gemm_kernel()
    if kernel is None or not kernel.native:
        pytest.skip("the bf16 kernel does not build on VDPBF16PS here")
    assert bf16_gemm.main(["--rows", "8", "--rounds", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "rows" in line]
    assert len(lines) == 1 + len(bf16_gemm.SHAPES)
    for line in lines[1:]:
        timed = {name: float(ms) for name, ms in _MS.findall(line)}
        expected = {"vdpbf16ps", "unpack+torch"} | ({"amx"} if kernel.amx else set())
        assert set(timed) == expected and all(ms > 0 for ms in timed.values()), line


def test_bf16_widen_times_the_portable_path_against_fp32(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both sides of the panel widening (kernels/bf16_gemm.c: WIDE_ROWS), a baseline build."""
    source = ROOT / "stages" / "execute" / "kernels" / "bf16_gemm.c"
    argv = ["--rows", "1,24", "--layers", "1", "--no-head", "--rounds", "1"]
    assert bf16_widen.main([*argv, "--baseline", str(source)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert len(lines) == 2
    for line in lines:
        timed = re.findall(r"(fp32|bf16|bf16 baseline) ([0-9.]+) ms \(([0-9.]+)x fp32\)", line)
        assert [name for name, _, _ in timed] == ["fp32", "bf16", "bf16 baseline"], line
        assert all(float(ms) > 0 and float(ratio) > 0 for _, ms, ratio in timed), line


@pytest.mark.slow  # a fresh process loading the model: ~15 s on the loaded 2-core machine
def test_bf16_batch_runs_a_tree_in_a_fresh_process(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--tree", str(ROOT), "--rounds", "1", "--batch", "2", "--prompt", "5"]
    assert bf16_batch.main([*argv, "--decode", "2", "--model", str(tiny_model_dir)]) == 0
    best = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best")]
    assert len(best) == 1
    figures = [float(value) for value in re.findall(r"([0-9.]+) (?:tok/s|per CPU s)", best[0])]
    assert len(figures) == 4 and all(value > 0 for value in figures), best[0]
