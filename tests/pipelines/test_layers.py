"""The layers of docs/ARCHITECTURE: pipelines → assets → resources → models, arrows pointing down
only. Every import in the four packages, at module level or inside a function, is read with `ast`;
one that reaches a package above its own fails the test with its file and line."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["models", "resources", "assets", "pipelines"]  # bottom to top


def own(module: str) -> str:
    """The project's modules are installed as habitus.<package>...: the name inside the repository."""
    return module.removeprefix("habitus.")


def imported_modules(tree: ast.AST):
    """(line, dotted module name) of every import in a module; relative imports are left out (they
    stay inside their own package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, own(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, own(node.module)


def upward_imports(root: Path = ROOT) -> list[str]:
    found = []
    for rank, package in enumerate(LAYERS):
        above = LAYERS[rank + 1:]
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in imported_modules(tree):
                top = module.split(".")[0]
                if top in above:
                    found.append(f"{path.relative_to(root)}:{line}: {package}/ imports {module} ({top}/ is above it)")
    return found


def test_no_import_points_up():
    found = upward_imports()
    assert not found, ("imports that point up the layers (pipelines → assets → resources → models); pass the "
                       "value in as an argument or move it down:\n  " + "\n  ".join(found))


def test_an_upward_import_is_named_with_its_file_and_line(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "assets" / "cache.py").write_text("import dagster\n\n\ndef f():\n    from habitus.pipelines.partitions import x\n")
    (tmp_path / "pipelines" / "definitions.py").write_text("from habitus.assets.cache import f\n")
    assert upward_imports(tmp_path) == [
        "assets/cache.py:5: assets/ imports pipelines.partitions (pipelines/ is above it)"]


def imported_names(tree: ast.AST):
    """What each import names: `from a.b import c` names a.b.c (a module, or a name inside a.b)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (own(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield from (own(f"{node.module}.{alias.name}") for alias in node.names)


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Groups of modules of the four packages that import one another round a circle (strongly
    connected components of the import graph, imports inside functions included)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for package in LAYERS for p in (root / package).rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for module in imported_names(ast.parse(path.read_text(), filename=str(path))):
            # "from pipelines import config" and "import habitus.pipelines.config" both land on a known module
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):
                graph[name].add(module)
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node), on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles():
    circles = import_circles()
    assert not circles, ("modules that import one another round a circle; move what they share into a "
                         "module of its own:\n  " + "\n  ".join(" <-> ".join(c) for c in circles))


def test_an_import_circle_is_found(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "pipelines" / "cli.py").write_text("from habitus.pipelines.managed import main\n")
    (tmp_path / "pipelines" / "managed.py").write_text("def main():\n    from pipelines import cli\n")
    (tmp_path / "pipelines" / "config.py").write_text("import os\n")
    assert import_circles(tmp_path) == [["pipelines.cli", "pipelines.managed"]]
