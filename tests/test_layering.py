"""The layering of docs/architecture.md, checked on the source.

- Pure logic (scheduler bookkeeping, block allocator, step bookkeeping, stop checker,
  detokenizer state, token bucket, policies, messages) imports no asyncio, zmq, grpc or
  torch, so it stays testable and reusable on its own.
- Imports go one way: ``plugins ← transports ← pipeline.runtime ← stages ← pipeline.engine ←
  pipeline.server ← pipeline.bench ← pipeline.cli`` (the package ``pipeline`` itself is the
  façade over all of them, so no package module imports it).
- The experiments and records of ``benchmarks/`` (outside the installed packages) sit above
  them all: they may import any package, and nothing installed imports them (nor is
  ``benchmarks`` installed).
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
#: not installed; imports the packages, never imported by them
BENCHMARKS = "benchmarks"
CHECKED = (*PACKAGES, BENCHMARKS)

PURE_MODULES = (
    "stages.scheduler",
    "stages.steps_in_flight",
    "stages.engine_core",
    "stages.policies",
    "stages.execute.allocator",
    "stages.execute.bookkeeping",
    "stages.execute.draft_tracker",
    "stages.stop_checker",
    "stages.detokenizer",
    "stages.token_bucket",
    "stages.params",
    "stages.pooling",
    "stages.messages",
    "stages.early_aborts",
    "stages.execute.model_length",
    "stages.checks",
    "stages.validation",
    "stages.recovery",
    "stages.execute.contention",
    "stages.kv_transfer",
    "stages.execute.kv_links",
    "stages.execute.quant.gguf_table",
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
    (BENCHMARKS, 9),  # the experiments and records, not installed
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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    importer = module_name(path, root)
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
    return module.split(".")[0] in CHECKED


def _layer(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer of LAYERS")


KNOWN_MODULES = {module_name(path) for path in source_files(*CHECKED)}


def targets(item: Import) -> list[str]:
    """The modules of ours an import runs: ``from pkg import sub`` names the submodule."""
    if not _ours(item.module):
        return []
    submodules = [f"{item.module}.{name}" for name in item.names]
    modules = [name for name in submodules if name in KNOWN_MODULES]
    if len(modules) < len(item.names) or not item.names:
        modules.append(item.module)
    return modules


ALL_IMPORTS = [item for path in source_files(*CHECKED) for item in imports_of(path)]


def layer_violations(imports: list[Import]) -> list[str]:
    """Every import of a module above its importer's layer."""
    return [
        f"{item.importer}:{item.line} imports {target} (layer {_layer(target)} > "
        f"{_layer(item.importer)})"
        for item in imports
        for target in targets(item)
        if _layer(target) > _layer(item.importer)
    ]


def benchmarks_imported(imports: list[Import]) -> list[str]:
    """Every import of ``benchmarks`` by an installed package's module (type-only ones too:
    ``benchmarks`` is not there to resolve them where the packages are installed)."""
    return [
        f"{item.importer}:{item.line} imports {item.module}"
        for item in imports
        if item.importer.split(".")[0] in PACKAGES
        and (item.module == BENCHMARKS or item.module.startswith(BENCHMARKS + "."))
    ]


def test_imports_follow_the_layers() -> None:
    wrong = layer_violations(ALL_IMPORTS)
    assert not wrong, "\n".join(wrong)


def test_no_installed_package_imports_benchmarks() -> None:
    assert any(item.importer.startswith(BENCHMARKS + ".") for item in ALL_IMPORTS)  # it is seen
    wrong = benchmarks_imported(ALL_IMPORTS)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("importer", "source"),
    [
        ("pipeline/bench/offline.py", "from benchmarks.grammars import order_document\n"),
        ("stages/params.py", "def f() -> None:\n    import benchmarks.ablation\n"),
        ("plugins/__init__.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from benchmarks import micro\n"),
        ("pipeline/engine/llm.py", "from pipeline.bench import offline\n"),
    ],
)  # fmt: skip
def test_an_injected_violation_is_found(tmp_path: Path, importer: str, source: str) -> None:
    """The checks above on a copy of a module with one bad import added: each is reported."""
    path = tmp_path / importer
    path.parent.mkdir(parents=True)
    path.write_text((ROOT / importer).read_text() + "\n" + source)
    injected = imports_of(path, tmp_path)
    assert not layer_violations(imports_of(ROOT / importer))  # the file as it is passes
    found = layer_violations(injected) + benchmarks_imported(injected)
    assert found, f"{importer} + {source!r} passed the layering checks"
    if "benchmarks" in source:  # both rules see it, a function's or a type-only import too
        assert benchmarks_imported(injected) and layer_violations(injected)


def test_benchmarks_are_not_installed() -> None:
    """The packages setuptools installs from pyproject.toml (its ``packages.find``, expanded
    as a build expands it) are the four, benchmarks/ left out."""
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(ROOT / "pyproject.toml")
    installed = config["tool"]["setuptools"]["packages"]
    assert {name.split(".")[0] for name in installed} == set(PACKAGES), installed


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
    for path in source_files(*CHECKED, "tests", "examples"):
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


def import_cycles(imports: list[Import]) -> list[str]:
    """Every cycle in the module graph of ``imports``."""
    graph: dict[str, set[str]] = {}
    for item in imports:
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
    return cycles


def test_no_import_cycles() -> None:
    cycles = import_cycles([item for item in ALL_IMPORTS if not item.type_checking])
    assert not cycles, "\n".join(cycles)


def test_no_benchmark_cycles_even_type_only() -> None:
    """The benchmarks share their pieces through modules below them (ceiling and the
    data-parallel comparison through ``pipeline.bench.null_load``), not through each other,
    even for a type: no cycle among them counting ``if TYPE_CHECKING:`` imports."""
    benchmarks = [
        item
        for item in ALL_IMPORTS
        if item.importer.startswith(("pipeline.bench", BENCHMARKS)) or item.importer == BENCHMARKS
    ]
    cycles = import_cycles(benchmarks)
    assert not cycles, "\n".join(cycles)
