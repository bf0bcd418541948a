"""examples/custom_pipeline.py: the MaskStage inserted after detokenize changes exactly the
masked characters of the greedy answer (compared with the unmodified pipeline on the same
request) and forwards the other messages (a rejection still reaches the caller); the graph
edits (insert, place, replace) land where they should; the script runs with the stage in its
own process and the null model swapped in."""

from __future__ import annotations

import string
import subprocess
from pathlib import Path

import pytest
from custom_pipeline import MaskConfig, MaskStage, build_pipeline, generate

from pipeline import AsyncEngine, PromptTooLongError, SamplingParams
from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import ENGINE_HOST, llm_pipeline
from pipeline.runtime.spec import Endpoint
from stages.execute.null import NullExecuteStage
from tests.examples.running import RUN_TIMEOUT, example_command, example_env, run

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = "Write to me at jane@example.com"
#: a rule that certainly applies to the tiny model's answer: every ASCII letter
LETTERS = MaskConfig(string.ascii_letters, "*")


def test_mask_stage_rewrites_the_text_and_forwards_the_rest(tiny_model_dir: Path) -> None:
    options = EngineOptions.create(str(tiny_model_dir), transport="memory")
    table = str.maketrans(dict.fromkeys(string.ascii_letters, "*"))

    async def body() -> tuple[str, str]:
        plain = await generate(llm_pipeline(options), options, PROMPT, GREEDY)
        pipeline = build_pipeline(options, LETTERS)
        async with AsyncEngine(
            str(tiny_model_dir), pipeline=pipeline, transport="memory"
        ) as engine:
            pieces = []
            async for output in engine.generate(PROMPT, GREEDY):
                pieces.append(output.delta)
            with pytest.raises(PromptTooLongError):  # RequestRejected passes through the mask
                async for _ in engine.generate(list(range(1000, 2100)), GREEDY):
                    pass
        return plain, "".join(pieces)

    plain, masked = run(body())
    assert any(character in string.ascii_letters for character in plain), plain
    assert masked == plain.translate(table)
    assert masked != plain


def test_build_pipeline_inserts_places_and_replaces(tiny_model_dir: Path) -> None:
    options = EngineOptions.create(str(tiny_model_dir))
    pipeline = build_pipeline(options, mask_host="masker", null_model=True)
    assert pipeline["mask"].factory is MaskStage
    assert pipeline["mask"].config == MaskConfig()
    assert pipeline["mask"].host == "masker"
    assert pipeline["execute"].factory is NullExecuteStage
    assert pipeline["execute"].host == ENGINE_HOST
    links = {(link.source, link.target) for link in pipeline.links}
    assert (Endpoint("detokenize", "out"), Endpoint("mask", "in")) in links
    assert (Endpoint("mask", "out"), Endpoint("stop_check", "in")) in links
    assert not any(s.stage == "detokenize" and t.stage == "stop_check" for s, t in links)
    default = build_pipeline(options)
    assert default["mask"].host == default["detokenize"].host


def test_mask_config_is_validated() -> None:
    with pytest.raises(ValueError, match="characters"):
        MaskConfig("")
    with pytest.raises(ValueError, match="mask"):
        MaskConfig("0", 1)  # type: ignore[arg-type]


@pytest.mark.slow
def test_script_runs_the_stage_in_its_own_process(tiny_model_dir: Path) -> None:
    command = example_command(
        "custom_pipeline", "Hello", "--model", str(tiny_model_dir), "--max-tokens", "16",
        "--mask-host", "masker", "--null-model", "--characters", string.ascii_letters,
        "--mask", "*",
    )  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=example_env(), timeout=RUN_TIMEOUT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage mask [MaskStage] on masker" in result.stderr
    assert "stage execute [NullExecuteStage] on engine" in result.stderr
    answer = result.stdout.rstrip("\n")
    assert "*" in answer
    assert not any(character in string.ascii_letters for character in answer), answer
