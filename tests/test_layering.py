"""The layering of docs/architecture.md, checked on the source.

- Pure logic (scheduler bookkeeping, block allocator, step bookkeeping, stop checker,
  detokenizer state, token bucket, policies, messages) imports no asyncio, zmq, grpc or
  torch, so it stays testable and reusable on its own.
- Imports go one way: ``plugins ← transports ← pipeline.runtime ← stages ← pipeline.engine ←
  pipeline.server ← pipeline.bench ← pipeline.cli`` (the package ``pipeline`` itself is the
  façade over all of them, so no package module imports it).
- No module imports a private name (``_x``) from another module, and a private module
  (``_x.py``) is imported only from inside its own package (and by its own test module).
- No import cycles between modules, counting imports inside functions too (only
  ``if TYPE_CHECKING:`` imports are left out: they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plugins", "transports", "pipeline", "stages")

PURE_MODULES = (
    "stages.scheduler",
    "stages.policies",
    "stages.execute.allocator",
    "stages.execute.bookkeeping",
    "stages.stop_checker",
    "stages.detokenizer",
    "stages.token_bucket",
    "stages.params",
    "stages.messages",
    "stages.early_aborts",
    "stages.execute.model_length",
    "stages.checks",
    "stages.validation",
    "stages.recovery",
)
FORBIDDEN = ("asyncio", "anyio", "zmq", "grpc", "torch")

#: module prefix -> layer; a module may import only modules of its own layer or below
LAYERS = (
    ("plugins", 0),
    ("transports", 1),
    ("pipeline.runtime", 2),
    ("stages", 3),
    ("pipeline.demo", 3),  # the Collatz demo: a pipeline on the runtime alone, like stages
    ("pipeline.engine", 4),
    ("pipeline.server", 5),
    ("pipeline.bench", 6),
    ("pipeline.cli", 7),
    ("pipeline", 8),  # the façade package itself
)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_no_runtime(module: str) -> None:
    # A fresh interpreter: this test process has all of them loaded already.
    probe = f"import sys, {module}; print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} imports {result.stdout.strip()}"


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    module: str  # the module imported from (``from X import y``: X)
    names: tuple[str, ...]  # the names imported from it (empty for ``import X``)
    line: int
    type_checking: bool  # inside ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*tops: str) -> Iterator[Path]:
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> list[Import]:
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for item in child.body:
                    visit_one(item, True)
                for item in child.orelse:
                    visit_one(item, type_checking)
            else:
                visit_one(child, type_checking)

    def visit_one(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, (), node.lineno, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = tuple(alias.name for alias in node.names)
            found.append(Import(importer, base, names, node.lineno, type_checking))
        visit(node, type_checking)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _layer(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer of LAYERS")


KNOWN_MODULES = {module_name(path) for path in source_files(*PACKAGES)}


def targets(item: Import) -> list[str]:
    """The modules of ours an import runs: ``from pkg import sub`` names the submodule."""
    if not _ours(item.module):
        return []
    submodules = [f"{item.module}.{name}" for name in item.names]
    modules = [name for name in submodules if name in KNOWN_MODULES]
    if len(modules) < len(item.names) or not item.names:
        modules.append(item.module)
    return modules


ALL_IMPORTS = [item for path in source_files(*PACKAGES) for item in imports_of(path)]


def test_imports_follow_the_layers() -> None:
    wrong = [
        f"{item.importer}:{item.line} imports {target} (layer {_layer(target)} > "
        f"{_layer(item.importer)})"
        for item in ALL_IMPORTS
        for target in targets(item)
        if _layer(target) > _layer(item.importer)
    ]
    assert not wrong, "\n".join(wrong)


def test_layers_are_the_documented_ones() -> None:
    # The two rules the architecture doc names, stated directly.
    runtime = [
        item
        for item in ALL_IMPORTS
        if item.importer.startswith("pipeline.runtime")
        and any(t.startswith(("stages", "pipeline.engine")) for t in targets(item))
    ]
    stages = [
        item
        for item in ALL_IMPORTS
        if item.importer.startswith("stages")
        and any(
            t.split(".")[0] == "pipeline" and not t.startswith("pipeline.runtime")
            for t in targets(item)
        )
    ]
    assert not runtime, runtime
    assert not stages, stages


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_no_private_name_crosses_modules() -> None:
    wrong = []
    for path in source_files(*PACKAGES, "tests", "examples"):
        for item in imports_of(path):
            if not _ours(item.module):
                continue
            names = [name for name in item.names if _private(name)]
            if names:
                wrong.append(f"{item.importer}:{item.line} imports {names} from {item.module}")
            parts = item.module.split(".")
            for index, part in enumerate(parts):
                if not _private(part):
                    continue
                package = ".".join(parts[:index])
                own_test = item.importer == f"tests.{package}.test_{part.lstrip('_')}"
                if not (item.importer.startswith(package + ".") or own_test):
                    wrong.append(f"{item.importer}:{item.line} imports the private {item.module}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for item in ALL_IMPORTS:
        if item.type_checking:
            continue
        for target in targets(item):
            if target != item.importer:
                graph.setdefault(item.importer, set()).add(target)
    # NOTE: a package's __init__ importing its own submodules (to re-export them) is not a
    # cycle with a submodule that imports a sibling; only edges between modules count, so
    # edges from a package to its own submodules are the re-exports and left out.
    for module, edges in graph.items():
        graph[module] = {t for t in edges if not t.startswith(module + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                walk(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not cycles, "\n".join(cycles)
