"""docs/serving.md lists every endpoint the HTTP app serves and every field each request body
takes (the issue's "lists every field and endpoint with what it does"): its marked tables
(``<!-- endpoints -->``, ``<!-- fields: NAME -->``) are compared with the app's routes and
with the request models of :mod:`pipeline.server.http.schema` (and the Responses model), so
a field added to a model without a line in the doc, or a line left for a field that is gone,
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from pipeline.engine.async_engine import AsyncEngine
from pipeline.server.http.app import create_app
from pipeline.server.http.responses import ResponsesRequest
from pipeline.server.http.schema import (
    ACCEPTED_AT,
    CHAT_ACCEPTED_AT,
    COMPLETION_ACCEPTED_AT,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationBody,
    TokenizeRequest,
)
from pipeline.server.http.state import HttpService

DOC = Path(__file__).resolve().parents[4] / "docs" / "serving.md"


def fields(model: type[BaseModel], without: type[BaseModel] | None = None) -> set[str]:
    names = set(model.model_fields)
    return names - set(without.model_fields) if without is not None else names


EXPECTED = {
    "generation": fields(GenerationBody),
    "completions": fields(CompletionRequest, GenerationBody),
    "chat": fields(ChatCompletionRequest, GenerationBody),
    "tokenize": fields(TokenizeRequest),
    "detokenize": fields(DetokenizeRequest),
    "responses": fields(ResponsesRequest),
    "accepted": {*ACCEPTED_AT, *COMPLETION_ACCEPTED_AT, *CHAT_ACCEPTED_AT},
}


def table_after(marker: str) -> list[str]:
    """The first cells of the table that follows ``marker`` in the doc."""
    lines = DOC.read_text().splitlines()
    start = lines.index(marker)
    cells = []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip())
    assert len(cells) > 2, f"no table after {marker}"
    return cells[2:]  # past the header and its rule


def documented(marker: str) -> set[str]:
    """The top-level names in backticks in the first column (``text.format`` is ``text``)."""
    names = set()
    for cell in table_after(marker):
        for name in re.findall(r"`([^`]+)`", cell):
            names.add(re.split(r"[.\[]", name)[0])
    return names


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_field_has_a_line(name: str) -> None:
    found = documented(f"<!-- fields: {name} -->")
    assert found == EXPECTED[name], (
        f"docs/serving.md, fields: {name}: missing {sorted(EXPECTED[name] - found)}, "
        f"not fields {sorted(found - EXPECTED[name])}"
    )


def test_every_endpoint_has_a_line(tiny_model_dir: Path) -> None:
    engine = AsyncEngine(model=str(tiny_model_dir))  # never started: only its routes are read
    app = create_app(HttpService(engine, "tiny"), registry=CollectorRegistry())
    served = {
        f"{method} {route.path}"
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    }
    found = set()
    for cell in table_after("<!-- endpoints -->"):
        found.update(re.findall(r"`((?:GET|POST|PUT|DELETE) [^`]+)`", cell))
    assert found == served, f"missing {sorted(served - found)}, not served {sorted(found - served)}"
