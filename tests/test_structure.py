"""Structure: no import cycle inside the package, and no source file over 400 lines.

Every import (at the top or inside a function, but not under TYPE_CHECKING) is an edge from the importing
module to the module it names; the graph has no cycle. A function-level import that closes a loop is still a
loop in the design."""

import ast
import pathlib

import fivefold

PACKAGE = pathlib.Path(fivefold.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = ("fivefold",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """type_checking=True also counts the imports under `if TYPE_CHECKING:`."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        skipped = set() if type_checking else type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                   else []))
                # `from pkg import sub` imports the submodule pkg.sub when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_is_read():
    graph = import_graph()
    assert "fivefold.cost.step" in graph["fivefold.planner.search"]
    assert "fivefold.runtime.config" in graph["fivefold.runtime.train"]
    assert len(graph) > 80


def test_no_import_cycle_inside_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_simulator_has_no_cycle_even_through_type_only_imports():
    """engine, replay and summary take their types from sim/step_input.py, below all three (issue 30, point 7)."""
    graph = import_graph(type_checking=True)
    sim = {name: {t for t in targets if t.startswith("fivefold.sim.")}
           for name, targets in graph.items() if name.startswith("fivefold.sim.")}
    assert "fivefold.sim.step_input" in sim["fivefold.sim.replay"]
    cycle = find_cycle(sim)
    assert cycle is None, " -> ".join(cycle)


def test_no_source_file_over_400_lines():
    """Each file stays small enough to read in one sitting (the project's standard)."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
