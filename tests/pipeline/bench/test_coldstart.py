"""The cold-start benchmark: its two programs' command lines, timing a real process to its first
output byte, and ``actorline bench coldstart --quick`` on the tiny model (both programs run and
print a token; never a timing threshold)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.bench.coldstart import HF_SCRIPT, actorline_command, hf_command, time_to_output


def test_the_programs_are_the_issues(tmp_path: Path) -> None:
    command = actorline_command("smollm2-135m", "Hi")
    assert command[-6:] == ["generate", "Hi", "--max-tokens", "1", "--model", "smollm2-135m"]
    hf = hf_command(tmp_path, "Hi")
    assert hf == [sys.executable, "-c", HF_SCRIPT, str(tmp_path), "Hi"]
    assert "from_pretrained" in HF_SCRIPT and "max_new_tokens=1" in HF_SCRIPT


def test_a_process_is_timed_to_its_first_byte_and_exit() -> None:
    script = "import sys, time; time.sleep(0.2); print('x', flush=True); time.sleep(0.3)"
    first, exit_seconds, cpu = time_to_output([sys.executable, "-c", script])
    assert 0.2 <= first < exit_seconds and cpu >= 0  # ordering, not speed
    with pytest.raises(RuntimeError, match="failed"):
        time_to_output([sys.executable, "-c", "import sys; sys.exit(3)"])


@pytest.mark.slow
def test_coldstart_quick_via_the_cli(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.pipeline.bench.test_bench import bench_parser

    args = bench_parser().parse_args(
        ["bench", "coldstart", "--quick", "--json", "--model", str(tiny_model_dir)]
    )
    assert args.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [run["system"] for run in result["runs"]] == ["actorline generate", "plain HF"]
    for run in result["runs"]:
        assert 0 < run["first_output_seconds"] <= run["exit_seconds"] and run["cpu_seconds"] > 0
    assert result["ratio"] > 0 and result["target_ratio"] == 0.75
