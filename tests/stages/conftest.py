"""Fixtures of the stage tests: the default model's tokenizer and a grammar backend on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    """SmolLM2's HF tokenizer (vocabulary 49152, EOS 2), as the engine loads it."""
    from stages.tokenize import load_tokenizer

    return load_tokenizer(str(default_model_dir))


@pytest.fixture(scope="session")
def llguidance_backend(tokenizer: Any) -> Any:
    """The built-in grammar backend on SmolLM2's tokenizer (about a second to build)."""
    from stages.structured.llguidance import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, 49152, [2])
