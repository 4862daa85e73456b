"""The package's layout: no module imports another that imports it back, and every arrow between
the package's parts runs down its layers."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the installed names of the top-level folders (pyproject.toml's package-dir)
FOLDERS = {"hsmla_med": "hsmla_med", "kernels": "hsmla_med.kernels", "pipelines": "hsmla_med.pipelines"}
# functions that import the module their first argument names: an import the statements do not show
IMPORT_CALLS = {"import_module", "__import__"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _from_import(base: str, names: list[str], modules) -> list[str]:
    """What ``from base import names`` imports: each name that is a submodule of ``base``, and
    ``base`` itself when a name is not one."""
    subs = [f"{base}.{name}" for name in names]
    return [n for n in subs if n in modules] + ([base] if any(n not in modules for n in subs) else [])


def _called_import(node: ast.Call, modules) -> list[str]:
    """The modules an ``importlib.import_module("name")``, ``import_module("name")`` or
    ``__import__("name", fromlist=[...])`` call imports, when the name is a literal absolute
    one; none for a name computed at run time (an f-string, a variable), which no reading of the
    code can follow."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in IMPORT_CALLS or not node.args:
        return []
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)) or name.value.startswith("."):
        return []
    fromlist = next((k.value for k in node.keywords if k.arg == "fromlist"), node.args[3] if len(node.args) > 3 else None)
    if called == "__import__" and isinstance(fromlist, (ast.List, ast.Tuple)):
        names = [e.value for e in fromlist.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return _from_import(name.value, names, modules)
    return [name.value]


def _loaded(target: str, importer: str) -> list[str]:
    """The modules importing ``target`` runs: it, and first the packages above it
    (``hsmla_med.nn`` for ``hsmla_med.nn.functional``: a circle through a package's
    ``__init__`` is a circle too), less the importer's own packages, which ran before it."""
    above = target.split(".")
    own = importer.split(".")
    return [target] + [".".join(above[:i]) for i in range(1, len(above)) if above[:i] != own[:i]]


def import_graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports at any depth of its code (function-level imports
    included: a circle through a late import is still a circle in the design), by ``import`` and
    ``from ... import`` statements and by calls that import a literal name (:func:`_called_import`:
    a circle through ``importlib`` is one too), each with the packages it loads (:func:`_loaded`).
    ``modules``: name -> file, the package's own (:func:`_modules`) unless given."""
    modules = _modules() if modules is None else modules
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
                names = _from_import(base, [a.name for a in node.names], modules)
            elif isinstance(node, ast.Call):
                names = _called_import(node, modules)
            else:
                continue
            targets |= {m for n in names for m in _loaded(n, name) if m in modules and m != name}
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


def part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage or top-level module
    (``hsmla_med.nn.functional`` -> ``hsmla_med.nn``); ``hsmla_med`` for the package itself."""
    return ".".join(module.split(".")[:2])


def part_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Part -> the parts it imports, each with the module arrows that make it up."""
    parts = {part(m): {} for m in graph}
    for module, targets in graph.items():
        for target in targets:
            if part(target) != part(module):
                parts[part(module)].setdefault(part(target), []).append(f"{module} -> {target}")
    return parts


DESIGN = ROOT / "docs" / "design.md"


def declared_layers(text: str) -> list[list[str]]:
    """The layers of docs/design.md §1.2's ``layers`` block, from the bottom: each line a layer
    (the block lists them top first), its parts separated by commas, a ``#`` starting a comment;
    ``hsmla_med`` is the package itself, any other name a part of it."""
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    rows = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [[p if p == "hsmla_med" else f"hsmla_med.{p}" for p in (n.strip() for n in row.split(","))] for row in rows if row][::-1]


def back_arrows(parts: dict[str, dict[str, list[str]]], layers: list[list[str]]) -> list[str]:
    """Every arrow from a part to a part of a higher layer, with the module arrows behind it."""
    level = {p: i for i, layer in enumerate(layers) for p in layer}
    return sorted(
        f"{source} -> {target} ({'; '.join(sorted(modules))})"
        for source, targets in parts.items()
        for target, modules in targets.items()
        if level[target] > level[source]
    )


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_by_call_are_read(tmp_path):
    """Literal names in ``importlib.import_module`` / ``import_module`` / ``__import__`` calls
    are imports; computed names are not."""
    modules = {"pkg": tmp_path / "__init__.py", **{f"pkg.{n}": tmp_path / f"{n}.py" for n in "abcde"}}
    for path in modules.values():
        path.write_text("")
    modules["pkg.a"].write_text(
        "import importlib\nfrom importlib import import_module\n"
        "def f(x):\n"
        "    importlib.import_module('pkg.b')\n"
        "    import_module('pkg.c')\n"
        "    __import__('pkg', fromlist=['d'])\n"
        "    importlib.import_module(f'pkg.{x}')\n"
        "    import_module(x)\n"
    )
    assert import_graph(modules)["pkg.a"] == {"pkg.b", "pkg.c", "pkg.d"}


def test_an_import_loads_the_packages_above_it():
    assert _loaded("a.b.c", "a.x") == ["a.b.c", "a.b"]
    assert _loaded("a.b.c", "a.b.d") == ["a.b.c"]


def test_back_arrow_finder_finds_a_planted_one():
    parts = part_graph({"p.low.x": {"p.high"}, "p.high": {"p.low.x"}, "p.low.y": set()})
    assert back_arrows(parts, [["p.low"], ["p.high"]]) == ["p.low -> p.high (p.low.x -> p.high)"]
    assert back_arrows(parts, [["p.low", "p.high"]]) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "hsmla_med.bench.main" in graph and "hsmla_med.data.synthetic.btcv" in graph
    found = cycles(graph)
    assert not found, "modules in a circle:\n" + "\n".join(" ".join(c) for c in found)


def test_parts_import_down_the_layers_only():
    """Every part of the package has its place in docs/design.md §1.2's ``layers`` block (the
    reasons for the order are there), no part imports one of a higher layer, and no parts import
    each other in a circle (which within one layer the order cannot see)."""
    layers = declared_layers(DESIGN.read_text(encoding="utf-8"))
    parts = part_graph(import_graph())
    declared = [p for layer in layers for p in layer]
    assert sorted(parts) == sorted(declared), ("docs/design.md's layers block misses a part of the package, or names one that is gone: "
                                               f"{sorted(set(parts) ^ set(declared))}")
    arrows = back_arrows(parts, layers)
    assert not arrows, "arrows up the layers:\n" + "\n".join(arrows)
    found = cycles({source: set(targets) for source, targets in parts.items()})
    assert not found, "parts in a circle:\n" + "\n".join(" ".join(c) for c in found)
