"""The import rules of the source tree (docs/architecture.md), checked over ``ast`` (no process, no import).

* the operator and the CLI import of the worker only :mod:`moeguard_core`, never ``moeguard_runtime``
  (one exception: ``moeguard worker serve`` runs the worker in-process, :data:`WORKER_ENTRY`);
* ``moeguard_core`` imports no torch, kopf, fastapi/uvicorn, and nothing of moeguard_runtime/operator/cli;
* the worker's subpackages keep their layers (:data:`WORKER_LAYERS`): ``memory/`` and ``model/`` never
  import ``api/`` or ``engine/``, and ``memory/`` is a leaf; the operator's too (:data:`OPERATOR_LAYERS`):
  ``spec/`` imports nothing else of the operator, ``diagnosis/`` never ``children/``;
* ``hack/`` never imports ``bench/``; ``harness/`` imports neither ``hack/`` nor ``bench/``;
* nothing reachable from ``moeguard_operator`` imports torch;
* package ``__init__`` files import nothing of moeguard at run time (no re-exports, no cycles from inits).

Each rule is a function over an import graph (module -> {imported module: line}), so that a synthetic,
violating graph shows what it reports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = {ROOT / "operator": ("moeguard_operator", "moeguard_cli"), ROOT / "runtime": ("moeguard_runtime",),
                ROOT / "core": ("moeguard_core",), ROOT: ("hack", "bench", "harness")}

Graph = Mapping[str, Mapping[str, int]]
"""module -> {module it imports at run time (outside ``if TYPE_CHECKING:``): the line of the import}."""

WORKER_ENTRY = {("moeguard_cli.__main__", "moeguard_runtime.__main__")}
"""``moeguard worker serve`` runs the worker in this process: the one import of the worker outside
moeguard_core (inside the command's function, so the CLI's other commands never load torch)."""

CORE_FORBIDDEN = ("torch", "safetensors", "kopf", "fastapi", "uvicorn", "sse_starlette",
                  "moeguard_runtime", "moeguard_operator", "moeguard_cli")

WORKER_LAYERS = {
    "memory": ("api", "engine", "model", "parallel", "telemetry", "disagg"),
    "model": ("api", "engine", "telemetry", "disagg"),
    "telemetry": ("api",),
    "parallel": ("api", "disagg"),
    "disagg": ("api",),
    "engine": ("disagg",),
}
"""moeguard_runtime.<subpackage> -> the subpackages it never imports (the package docstrings say so)."""

OPERATOR_LAYERS = {
    "spec": ("children", "loop", "diagnosis", "handlers", "config", "__main__"),
    "diagnosis": ("children",),
}
"""moeguard_operator.<subpackage> -> what of the operator it never imports."""


# --- the graph ------------------------------------------------------------------------------------
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> dict[str, int]:
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        found.setdefault(name, line)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                add(sub if sub in known else base, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def source_graph() -> dict[str, dict[str, int]]:
    files: dict[str, Path] = {}
    for root, packages in SOURCE_ROOTS.items():
        for package in packages:
            for py in sorted((root / package).rglob("*.py")):
                files[_module_name(py, root)] = py
    known = set(files)
    return {m: _imports(ast.parse(p.read_text()), m, p.name == "__init__.py", known) for m, p in files.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _with_parents(name: str) -> Iterable[str]:
    parts = name.split(".")
    return (".".join(parts[:k]) for k in range(1, len(parts) + 1))


# --- the rules: each returns its violations, one sentence each ------------------------------------
def operator_imports_only_core(graph: Graph) -> list[str]:
    return [f"{m} imports {i} (line {n}): the operator and the CLI import of the worker only moeguard_core"
            for m, imps in sorted(graph.items()) if _in(m, "moeguard_operator") or _in(m, "moeguard_cli")
            for i, n in sorted(imps.items()) if _in(i, "moeguard_runtime") and (m, i) not in WORKER_ENTRY]


def core_is_light(graph: Graph) -> list[str]:
    return [f"{m} imports {i} (line {n}): moeguard_core imports none of {', '.join(CORE_FORBIDDEN)}"
            for m, imps in sorted(graph.items()) if _in(m, "moeguard_core")
            for i, n in sorted(imps.items()) if any(_in(i, f) for f in CORE_FORBIDDEN)]


def layers(graph: Graph, package: str, rules: Mapping[str, tuple[str, ...]]) -> list[str]:
    out = []
    for m, imps in sorted(graph.items()):
        for sub, never in rules.items():
            if not _in(m, f"{package}.{sub}"):
                continue
            out += [f"{m} imports {i} (line {n}): {package}.{sub} never imports {package}.{bad}"
                    for i, n in sorted(imps.items()) for bad in never if _in(i, f"{package}.{bad}")]
    return out


def worker_layers(graph: Graph) -> list[str]:
    return layers(graph, "moeguard_runtime", WORKER_LAYERS)


def operator_layers(graph: Graph) -> list[str]:
    return layers(graph, "moeguard_operator", OPERATOR_LAYERS)


def tools_never_import_bench(graph: Graph) -> list[str]:
    return [f"{m} imports {i} (line {n}): hack/ never imports bench/; harness/ imports neither hack/ nor bench/"
            for m, imps in sorted(graph.items())
            for i, n in sorted(imps.items())
            if (_in(m, "hack") and _in(i, "bench")) or (_in(m, "harness") and (_in(i, "bench") or _in(i, "hack")))]


def inits_import_nothing(graph: Graph, packages: Iterable[str]) -> list[str]:
    return [f"{m} imports {i} (line {n}): a package __init__ imports nothing of moeguard at run time"
            for m in sorted(packages) for i, n in sorted(graph.get(m, {}).items()) if i.startswith("moeguard")]


def reaches(graph: Graph, start: str, target: str) -> list[str] | None:
    """The import chain from ``start`` to a module in ``target`` (parent packages' inits included), or None."""
    seen = {start}
    todo: list[list[str]] = [[start]]
    while todo:
        chain = todo.pop(0)
        for imported in sorted(graph.get(chain[-1], {})):
            for name in _with_parents(imported):
                if _in(name, target):
                    return [*chain, name]
                if name in graph and name not in seen:
                    seen.add(name)
                    todo.append([*chain, name])
    return None


def operator_reaches_no_torch(graph: Graph) -> list[str]:
    out = []
    for m in sorted(graph):
        if _in(m, "moeguard_operator"):
            chain = reaches(graph, m, "torch")
            if chain:
                out.append(f"{m} reaches torch: {' -> '.join(chain)}")
    return out


# --- the tree keeps them ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return source_graph()


def test_the_graph_sees_the_packages(graph: dict[str, dict[str, int]]) -> None:
    for module in ("moeguard_operator.__main__", "moeguard_operator.loop.observation", "moeguard_core.contract",
                   "moeguard_runtime.memory.procmem", "moeguard_runtime.model.hf_config", "harness.stack"):
        assert module in graph
    assert "moeguard_core.contract" in graph["moeguard_operator.spec.models"]


def test_the_operator_and_the_cli_import_of_the_worker_only_core(graph: dict[str, dict[str, int]]) -> None:
    assert operator_imports_only_core(graph) == []


def test_core_imports_no_torch_kopf_server_or_worker(graph: dict[str, dict[str, int]]) -> None:
    assert core_is_light(graph) == []


def test_the_worker_subpackages_keep_their_layers(graph: dict[str, dict[str, int]]) -> None:
    assert worker_layers(graph) == []


def test_the_operator_subpackages_keep_their_layers(graph: dict[str, dict[str, int]]) -> None:
    assert operator_layers(graph) == []


def test_hack_never_imports_bench_and_harness_neither_hack_nor_bench(graph: dict[str, dict[str, int]]) -> None:
    assert tools_never_import_bench(graph) == []


def test_package_inits_import_nothing(graph: dict[str, dict[str, int]]) -> None:
    inits = [m for m in graph if m.startswith("moeguard") and (
        (ROOT / "runtime" / m.replace(".", "/") / "__init__.py").is_file()
        or (ROOT / "operator" / m.replace(".", "/") / "__init__.py").is_file()
        or (ROOT / "core" / m.replace(".", "/") / "__init__.py").is_file())]
    assert "moeguard_runtime.model.families" in inits and "moeguard_operator.loop" in inits
    assert inits_import_nothing(graph, inits) == []


def test_nothing_reachable_from_the_operator_imports_torch(graph: dict[str, dict[str, int]]) -> None:
    assert operator_reaches_no_torch(graph) == []
    assert reaches(graph, "moeguard_runtime.__main__", "torch")  # the rule sees torch where it is


# --- each rule reports a broken tree, naming the module and the import -------------------------------
BROKEN: dict[str, dict[str, int]] = {
    "moeguard_operator.loop.tick": {"moeguard_runtime.engine.scheduler": 12, "moeguard_core.contract": 3},
    "moeguard_cli.plan": {"moeguard_runtime.model.moe": 7},
    "moeguard_cli.__main__": {"moeguard_runtime.__main__": 56},
    "moeguard_core.memory_admission": {"torch": 4},
    "moeguard_core.contract": {"kopf": 9, "pydantic": 2},
    "moeguard_runtime.memory.leak": {"moeguard_runtime.engine.scheduler": 20},
    "moeguard_runtime.model.moe": {"moeguard_runtime.api.server": 30, "moeguard_runtime.memory.procmem": 5},
    "hack.demo": {"bench.loadgen.client": 27, "harness.loadgen.client": 28},
    "harness.control_plane": {"hack.pod_workers": 30, "harness.stack": 27},
    "moeguard_operator.spec": {"moeguard_operator.spec.models": 1},
    "moeguard_operator.spec.models": {"moeguard_core.contract": 24},
    "moeguard_operator.spec.spec_checks": {"moeguard_operator.loop.policy": 15, "moeguard_operator.constants": 3},
    "moeguard_operator.children.builders": {"moeguard_core.family_shape": 8},
    "moeguard_core.family_shape": {"numpy": 3, "moeguard_core.torch_free": 4},
    "moeguard_core.torch_free": {"torch.nn": 5},
}


def test_a_broken_tree_is_reported() -> None:
    assert operator_imports_only_core(BROKEN) == [
        "moeguard_cli.plan imports moeguard_runtime.model.moe (line 7): the operator and the CLI import of the "
        "worker only moeguard_core",
        "moeguard_operator.loop.tick imports moeguard_runtime.engine.scheduler (line 12): the operator and the "
        "CLI import of the worker only moeguard_core"]
    core = core_is_light(BROKEN)
    assert len(core) == 3
    assert core[0].startswith("moeguard_core.contract imports kopf (line 9)")
    assert core[1].startswith("moeguard_core.memory_admission imports torch (line 4)")
    assert core[2].startswith("moeguard_core.torch_free imports torch.nn (line 5)")
    assert worker_layers(BROKEN) == [
        "moeguard_runtime.memory.leak imports moeguard_runtime.engine.scheduler (line 20): "
        "moeguard_runtime.memory never imports moeguard_runtime.engine",
        "moeguard_runtime.model.moe imports moeguard_runtime.api.server (line 30): "
        "moeguard_runtime.model never imports moeguard_runtime.api"]
    assert operator_layers(BROKEN) == [
        "moeguard_operator.spec.spec_checks imports moeguard_operator.loop.policy (line 15): "
        "moeguard_operator.spec never imports moeguard_operator.loop"]
    assert tools_never_import_bench(BROKEN) == [
        "hack.demo imports bench.loadgen.client (line 27): hack/ never imports bench/; harness/ imports neither "
        "hack/ nor bench/",
        "harness.control_plane imports hack.pod_workers (line 30): hack/ never imports bench/; harness/ imports "
        "neither hack/ nor bench/"]
    assert inits_import_nothing(BROKEN, ["moeguard_operator.spec"]) == [
        "moeguard_operator.spec imports moeguard_operator.spec.models (line 1): a package __init__ imports "
        "nothing of moeguard at run time"]
    reached = operator_reaches_no_torch(BROKEN)
    assert ("moeguard_operator.children.builders reaches torch: moeguard_operator.children.builders -> "
            "moeguard_core.family_shape -> moeguard_core.torch_free -> torch") in reached
    assert not any(r.startswith("moeguard_operator.spec.models ") for r in reached)


def test_the_graph_reads_every_form_of_import() -> None:
    tree = ast.parse("\n".join([
        "from __future__ import annotations",
        "import torch.nn as nn",
        "from typing import TYPE_CHECKING",
        "from moeguard_runtime.model import moe, nothing_of_that_name",
        "from . import sibling",
        "if TYPE_CHECKING:",
        "    from moeguard_runtime.api.server import Worker",
        "def later():",
        "    from moeguard_runtime.engine.scheduler import Rejected",
    ]))
    known = {"moeguard_runtime.model.moe", "moeguard_runtime.memory.sibling"}
    found = _imports(tree, "moeguard_runtime.memory.leak", False, known)
    assert found == {"__future__": 1, "torch.nn": 2, "typing": 3, "moeguard_runtime.model.moe": 4,
                     "moeguard_runtime.model": 4, "moeguard_runtime.memory.sibling": 5,
                     "moeguard_runtime.engine.scheduler": 9}
