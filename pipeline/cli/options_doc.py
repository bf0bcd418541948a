"""The option tables of docs/options.md, generated from the declared fields
(:func:`pipeline.engine.option_fields.options_table`); ``python -m pipeline.cli.options_doc``
rewrites them in place, and a test fails while the page differs from what this renders."""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["DOC", "REGENERATE", "TABLES", "render"]

#: the page that holds the tables
DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"
#: the command that rewrites them
REGENERATE = "PYTHONPATH=. python -m pipeline.cli.options_doc"
#: table name (as the page's markers name it) → the dataclass it shows
TABLES = {
    "EngineOptions": "pipeline.engine.options:EngineOptions",
    "ListenerLimits": "pipeline.server.limits:ListenerLimits",
}
_BLOCK = re.compile(
    r"(<!-- options-table: (?P<name>\w+) -->\n)(?P<body>.*?)(<!-- /options-table -->)", re.S
)


def render(text: str) -> str:
    """``text`` with each marked table replaced by the one its dataclass renders.

    Raises:
        KeyError: a marker names no table of :data:`TABLES`.
    """
    import importlib

    from pipeline.engine.option_fields import options_table

    def table(match: re.Match[str]) -> str:
        module, _, name = TABLES[match["name"]].partition(":")
        cls = getattr(importlib.import_module(module), name)
        return f"{match[1]}{options_table(cls)}{match[4]}"

    return _BLOCK.sub(table, text)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC
    path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"rewrote the option tables of {path}")
