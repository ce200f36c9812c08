"""The import graph of the project's packages: no circles, no upward imports.

Layers (see docs/architecture.md): ``rlcli`` -> ``parallel`` -> megatron-core / torch and
``rlcli`` -> ``algorithms`` -> torch; ``benchmarks`` sits on top and nothing imports it. The graph
is built from the source with ``ast`` (module-level and function-level imports alike), so a lazy
import inside a function counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlcli", "parallel", "algorithms", "benchmarks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _imported_names(module: str, path: Path) -> set[str]:
    """Every absolute name an import statement in `path` names (relative ones resolved):
    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a.b``, which `_graph` resolves to
    the module ``a.b`` when there is one and to ``a`` when ``b`` is a name inside it."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> project modules it imports (a name resolves to its longest known prefix)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for name in _imported_names(module, path):
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                target = ".".join(parts[:end])
                if target in modules:
                    if target != module:
                        edges.add(target)
                    break
        graph[module] = edges
    return graph


def _external_roots(module: str) -> set[str]:
    path = _modules()[module]
    return {name.split(".")[0] for name in _imported_names(module, path) if name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def test_graph_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    source = "import os\ndef f():\n    from parallel.mesh import Mesh\n    from . import sibling\n"
    path = tmp_path / "mod.py"
    path.write_text(source)
    names = _imported_names("pkg.mod", path)
    assert names == {"os", "parallel.mesh.Mesh", "pkg.sibling"}


def test_cycle_finder_on_a_known_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles between modules: {cycles}"


@pytest.mark.parametrize(
    ("lower", "higher"),
    [("parallel", "rlcli"), ("algorithms", "rlcli"), ("algorithms", "parallel")],
)
def test_no_upward_imports(lower: str, higher: str) -> None:
    bad = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        if _top(module) == lower
        for target in targets
        if _top(target) == higher
    )
    assert not bad, f"{lower} must not import {higher}: {bad}"


def test_product_does_not_import_benchmarks() -> None:
    bad = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        if _top(module) != "benchmarks"
        for target in targets
        if _top(target) == "benchmarks"
    )
    assert not bad, f"rlcli / parallel / algorithms must not import benchmarks: {bad}"


def test_algorithms_import_only_torch_and_the_standard_library() -> None:
    allowed = {"torch", "algorithms", "__future__", *sys.stdlib_module_names}
    bad = sorted(
        f"{module} -> {root}"
        for module in _modules()
        if _top(module) == "algorithms"
        for root in _external_roots(module)
        if root not in allowed
    )
    assert not bad, f"algorithms/ may import only torch and the standard library: {bad}"


# rlcli's wings, lowest first (docs/architecture.md): a module may import from its own wing and the
# wings before it, never from one after it. "" is the package's root modules (errors, console,
# plugins, ...), which everything stands on; `rlcli.cli`, the entry point, stands above everything.
WINGS = (
    "",
    "config",
    "data",
    "run",
    "environments",
    "tools",
    "rewards",
    "rollout",
    "model",
    "reward_models",
    "validation",
    "train",
    "commands",
)
ENTRY_POINT = "rlcli.cli"


def _wing(module: str) -> int:
    """The rank of the wing `module` lives in (len(WINGS) for the entry point)."""
    if module == ENTRY_POINT:
        return len(WINGS)
    parts = module.split(".")
    is_package = (ROOT / Path(*parts) / "__init__.py").exists()
    wing = parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else ""
    assert wing in WINGS, f"{module} lives in {wing!r}, which is not in WINGS: add it in its place"
    return WINGS.index(wing)


def test_every_rlcli_module_lives_in_a_declared_wing() -> None:
    for module in _modules():
        if _top(module) == "rlcli" and module != "rlcli":
            _wing(module)


def _upward_wing_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _top(module) == "rlcli" and module != "rlcli"
        for target in targets
        if _top(target) == "rlcli" and target != "rlcli" and _wing(target) > _wing(module)
    )


def test_no_imports_up_between_rlcli_wings() -> None:
    bad = _upward_wing_imports(_graph())
    assert not bad, f"imports from a lower wing of rlcli up into a higher one: {bad}"


def test_the_wing_check_sees_an_upward_import() -> None:
    graph = {
        "rlcli.rollout.batch": {"rlcli.train.trainer", "rlcli.errors"},
        "rlcli.train.trainer": {"rlcli.rollout.batch", "rlcli.config.schema"},
        "rlcli.errors": {"rlcli.cli"},
    }
    assert _upward_wing_imports(graph) == [
        "rlcli.errors -> rlcli.cli",
        "rlcli.rollout.batch -> rlcli.train.trainer",
    ]
    assert _wing("rlcli.config.schema") == WINGS.index("config")
