"""The package's layout: no module imports another that imports it back (issue 26, item 7)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the installed names of the top-level folders (pyproject.toml's package-dir)
FOLDERS = {"hsmla_med": "hsmla_med", "kernels": "hsmla_med.kernels", "pipelines": "hsmla_med.pipelines"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at any depth of its code (function-level imports
    included: a circle through a late import is still a circle in the design)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # ``from package import submodule`` imports the submodule; the package only when
                # a name is not a submodule of it
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [n for n in subs if n in modules] + ([base] if any(n not in modules for n in subs) else [])
            else:
                continue
            targets |= {n for n in names if n in modules and n != name}
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), as sorted lists;
    a package importing its own submodule for re-export is not a circle when the submodule does
    not import the package back."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "hsmla_med.bench.main" in graph and "hsmla_med.data.synthetic.btcv" in graph
    assert cycles(graph) == []
