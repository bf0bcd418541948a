"""The pipeline diagrams in the docs are ``Pipeline.describe()`` of the pipelines they show.

Each diagram in README.md and docs/ sits under a ``<!-- describe: NAME -->`` marker, in a
code fence; this test builds the pipeline ``NAME`` (:data:`PIPELINES`) and compares its
``describe()`` with the docs' copy. Refresh every copy with::

    PYTHONPATH=. python -m tests.test_diagrams --write
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.engine.options import EngineOptions
from pipeline.engine.presets import llm_pipeline

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/architecture.md", "docs/parallelism.md", "docs/speculative.md")
REFRESH = "PYTHONPATH=. python -m tests.test_diagrams --write"

#: the name a marker gives -> the pipeline it shows
PIPELINES: dict[str, Callable[[], str]] = {
    "default": lambda: llm_pipeline(EngineOptions()).describe(),
    "data-parallel-2": lambda: llm_pipeline(EngineOptions(data_parallel_size=2)).describe(),
    "tensor-parallel-2": lambda: llm_pipeline(EngineOptions(tensor_parallel_size=2)).describe(),
    "pipeline-parallel-2": lambda: llm_pipeline(EngineOptions(pipeline_parallel_size=2)).describe(),
    "prefill-decode-1-1": lambda: llm_pipeline(EngineOptions(prefill_decode=(1, 1))).describe(),
    "draft-host": lambda: llm_pipeline(
        EngineOptions(
            speculative_config={
                "model": "smollm2-135m",
                "quantization": "gguf",
                "num_speculative_tokens": 4,
                "placement": "host",
            }
        )
    ).describe(),
}

MARKED = re.compile(r"(<!-- describe: ([\w-]+) -->\n```text\n)(.*?)(```)", re.DOTALL)


def diagrams(text: str) -> list[tuple[str, str]]:
    """The (name, shown text) of each marked diagram of a document."""
    return [(match.group(2), match.group(3)) for match in MARKED.finditer(text)]


def refreshed(text: str) -> str:
    """``text`` with every marked diagram replaced by its pipeline's ``describe()``."""
    return MARKED.sub(lambda m: m.group(1) + PIPELINES[m.group(2)]() + "\n" + m.group(4), text)


def test_each_pipeline_is_shown_somewhere() -> None:
    shown = {name for doc in DOCS for name, _ in diagrams((ROOT / doc).read_text())}
    assert shown == set(PIPELINES)


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_show_what_describe_says(doc: str) -> None:
    for name, text in diagrams((ROOT / doc).read_text()):
        assert name in PIPELINES, f"{doc}: no pipeline named {name!r} in tests/test_diagrams.py"
        expected = PIPELINES[name]() + "\n"
        assert text == expected, f"{doc}'s {name!r} diagram is stale; refresh with: {REFRESH}"


if __name__ == "__main__" and "--write" in sys.argv:
    for doc in DOCS:
        path = ROOT / doc
        path.write_text(refreshed(path.read_text()))
        print(f"refreshed {doc}")
