"""The package's shape, checked statically: no import cycle (function-level imports count) and no
module over the size limit. Reads source only, so it also guards code no test executes."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ft_plugins"
MAX_LINES = 450


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports anywhere in its body (top level, functions, TYPE_CHECKING
    blocks excluded: they never run). ``from pkg import name`` counts as ``pkg.name`` when that is a
    module, else as ``pkg``; a package's lazy re-exports (``_LAZY = {name: "submodule"}``) count too."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If) and _type_checking(block.test)
               for child in block.body for node in ast.walk(child)}
    edges: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(module, path).split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                edges.update(f"{module}.{value.value}" for value in node.value.values
                             if isinstance(value, ast.Constant))
    return {edge for edge in edges if edge in known and edge != module}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_no_module_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: size for name, size in sizes.items() if size > MAX_LINES} == {}


def test_the_cycle_check_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    """Negative control: a cycle closed only by an import inside a function, and one through a relative
    import of a package's lazy re-export, are both found."""
    package = tmp_path / "ft_plugins"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from ft_plugins import b\n")
    (package / "b.py").write_text("def f():\n    from ft_plugins.a import thing\n")
    (package / "inner" / "__init__.py").write_text("_LAZY = {'x': 'leaf'}\n")
    (package / "inner" / "leaf.py").write_text("def g():\n    from . import y\n")
    assert cycles(import_graph(package)) == [["ft_plugins.a", "ft_plugins.b"], ["ft_plugins.inner", "ft_plugins.inner.leaf"]]
