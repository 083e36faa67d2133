"""The layers of docs/ARCHITECTURE: pipelines → assets → resources → models, arrows pointing down
only. Every import in the four packages, at module level or inside a function, is read with `ast`;
one that reaches a package above its own fails the test with its file and line. Inside models/,
resources/ and pipelines/ the rooms have an order of their own (ROOMS, written down in each package's
__init__.py); in models/ no module imports the project's own modules inside a function (but those in
DEFERRED, each with its reason), and no module outside models/tasks/ compares a task type's name."""

import ast
import re
from pathlib import Path

from habitus.models.tasks import TASKS

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


def planted(root: Path, files: dict[str, str]) -> Path:
    """A small tree of the packages holding `files` (path: source), for the checks' own tests."""
    for package in [*LAYERS, "bench"]:
        (root / package).mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_an_upward_import_is_named_with_its_file_and_line(tmp_path):
    planted(tmp_path, {"assets/cache.py": "import dagster\n\n\ndef f():\n    from habitus.pipelines.orchestration.partitions import x\n",
                       "pipelines/definitions.py": "from habitus.assets.cache import f\n"})
    assert upward_imports(tmp_path) == [
        "assets/cache.py:5: assets/ imports pipelines.orchestration.partitions (pipelines/ is above it)"]


def imported_names(tree: ast.AST):
    """What each import names: `from a.b import c` names a.b.c (a module, or a name inside a.b)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (own(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield from (own(f"{node.module}.{alias.name}") for alias in node.names)


REGISTRY = Path("models/tasks/__init__.py")  # its task modules are imported by name (importlib)


def registered_modules(tree: ast.AST):
    """The modules the task registry imports by name: the strings naming a habitus module in its
    module-level statements (TASKS and the `register(...)` lines)."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr)):
            for node in ast.walk(stmt):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"habitus(\.\w+)+", node.value):
                    yield own(node.value)


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Groups of modules of the four packages that import one another round a circle (strongly
    connected components of the import graph, imports inside functions and the task registry's
    modules named for importlib included)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for package in LAYERS for p in (root / package).rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        named = registered_modules(tree) if path.relative_to(root) == REGISTRY else ()
        for module in [*imported_names(tree), *named]:
            # "from pipelines import config" and "import habitus.pipelines.config.project" both land on a known module
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name:
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
    planted(tmp_path, {"pipelines/cli.py": "from habitus.pipelines.run.managed import main\n",
                       "pipelines/run/managed.py": "def main():\n    from pipelines import cli\n",
                       "pipelines/config/project.py": "import os\n"})
    assert import_circles(tmp_path) == [["pipelines.cli", "pipelines.run.managed"]]


def test_the_task_registry_counts_as_importing_its_task_modules(tmp_path):
    planted(tmp_path, {
        "models/tasks/__init__.py": 'import importlib\n\nTASKS = {}\n\n\ndef register(name, module, targets):\n'
                                    '    TASKS[name] = module\n\n\nregister("toy", "habitus.models.tasks.toy", ("function",))\n',
        "models/tasks/toy.py": "from habitus.models.tasks.helpers import f\n",
        "models/tasks/helpers.py": "from habitus.models.tasks import TASKS\n"})
    assert import_circles(tmp_path) == [["models.tasks", "models.tasks.helpers", "models.tasks.toy"]]


# ---------------------------------------------------------------------- the rooms of each package

# bottom to top: a module imports its own room and the rooms below it (each package's __init__.py says why).
# The modules at the top of pipelines/ (cli.py, api.py, definitions.py: the ways in) stand above its rooms.
ROOMS = {
    "models": ["storage", "cache", "data", "nn", "tasks", "evaluate", "heads", "train", "serve", "explain"],
    "resources": ["store", "warehouses", "training"],
    "pipelines": ["config", "demo", "orchestration", "init", "run"],
}
# the project's own modules imported inside a function in models/: (file, module) -> the reason it cannot be
# at the top, which a comment at the import repeats (none today: third-party imports such as lightgbm may wait)
DEFERRED: dict[tuple[str, str], str] = {}


def floor_of(parts: tuple[str, ...] | list[str]) -> tuple[str, int] | None:
    """(package, floor) of a module given as its dotted parts or its path's parts: the index of its room,
    or one above the last room for a module at the top of the package (None: not in a package with rooms)."""
    rooms = ROOMS.get(parts[0]) if parts else None
    if rooms is None or len(parts) < 2:
        return None
    room = parts[1].removesuffix(".py")
    return parts[0], rooms.index(room) if room in rooms else len(rooms)


def room_name(package: str, floor: int) -> str:
    rooms = ROOMS[package]
    return f"{package}/{rooms[floor]}/" if floor < len(rooms) else f"the top of {package}/"


def function_imports(tree: ast.AST):
    """(line, module) of every import inside a function (module: the one the import statement names)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line, module in imported_modules(fn):
                yield line, module


def room_violations(root: Path = ROOT, deferred: dict = DEFERRED) -> list[str]:
    """Imports that point up the rooms of their package, and in models/ the project's modules imported
    inside a function where DEFERRED does not name the reason."""
    found = []
    for package in ROOMS:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            _, floor = floor_of(rel.parts) if len(rel.parts) > 2 else (package, len(ROOMS[package]))
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in imported_modules(tree):
                target = floor_of(module.split("."))
                if target is not None and target[0] == package and target[1] > floor:
                    found.append(f"{rel}:{line}: {room_name(package, floor)} imports {module} "
                                 f"({room_name(package, target[1])} is above it)")
            if package != "models":
                continue
            for line, module in function_imports(tree):
                if module.split(".")[0] in LAYERS and (str(rel), module) not in deferred:
                    found.append(f"{rel}:{line}: {module} imported inside a function")
    return found


def test_rooms_point_down_and_models_import_at_the_top():
    found = room_violations()
    orders = "; ".join(f"{p}/: " + " < ".join(r) for p, r in ROOMS.items())
    assert not found, ("imports that point up their package's rooms (" + orders + ") or, in models/, sit "
                       "inside a function; move the code to the room it belongs in, or the import to the "
                       "top:\n  " + "\n  ".join(found))


def test_the_rooms_are_the_folders_of_each_package():
    for package, rooms in ROOMS.items():
        folders = sorted(p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").exists())
        assert folders == sorted(rooms), package
        order = (ROOT / package / "__init__.py").read_text()
        assert " < ".join(rooms) in order, package  # written down where a reader of the package looks first


def test_an_upward_room_import_and_a_deferred_import_are_named(tmp_path):
    planted(tmp_path, {"models/tasks/binary.py": "import numpy\n\nfrom habitus.models.heads.stacking import blend\n",
                       "models/heads/stacking.py": "def fit():\n    import lightgbm\n    from habitus.models.tasks import task\n"})
    assert room_violations(tmp_path) == [
        "models/heads/stacking.py:3: models.tasks imported inside a function",
        "models/tasks/binary.py:3: models/tasks/ imports models.heads.stacking (models/heads/ is above it)"]
    allowed = {("models/heads/stacking.py", "models.tasks"): "(the reason)"}
    assert room_violations(tmp_path, allowed) == [
        "models/tasks/binary.py:3: models/tasks/ imports models.heads.stacking (models/heads/ is above it)"]


def test_the_rooms_of_pipelines_and_resources_are_enforced(tmp_path):
    planted(tmp_path, {
        # the ways in stand on top: they may import every room
        "pipelines/cli.py": "from habitus.pipelines.run.runner import materialize_all\n",
        "pipelines/api.py": "from habitus.pipelines.config.project import load_project\n",
        # a room importing a way in, or a room above it (inside a function too)
        "pipelines/run/runner.py": "from habitus.pipelines.orchestration.build import build_assets\n\n\n"
                                   "def f():\n    from habitus.pipelines.cli import main\n",
        "pipelines/config/project.py": "from habitus.pipelines.run import report\n",
        "pipelines/orchestration/jobs.py": "import dagster\n\nfrom habitus.pipelines.config.project import x\n",
        "resources/store/workspace.py": "from habitus.resources.warehouses.duckdb import DuckDBWarehouse\n",
        "resources/training/executor.py": "from habitus.resources.store.space import ensure_space\n"})
    assert room_violations(tmp_path) == [
        "resources/store/workspace.py:1: resources/store/ imports resources.warehouses.duckdb "
        "(resources/warehouses/ is above it)",
        "pipelines/config/project.py:1: pipelines/config/ imports pipelines.run (pipelines/run/ is above it)",
        "pipelines/run/runner.py:5: pipelines/run/ imports pipelines.cli (the top of pipelines/ is above it)"]


# ---------------------------------------------------------------------- task types own their decisions

TASK_NAMES = frozenset(TASKS)
SCANNED = ["models", "assets", "pipelines", "bench"]


def _names_a_task(node: ast.AST, names) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_task(e, names) for e in node.elts)
    return False


def task_name_comparisons(root: Path = ROOT, names=TASK_NAMES) -> list[str]:
    """Comparisons with a task type's name (`== "multilabel"`, `in ("binary", ...)`) outside
    models/tasks/: each such decision belongs to the task type (an attribute or method of Task)."""
    found = []
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("models", "tasks"):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            found += [f"{rel}:{node.lineno}: {ast.unparse(node)}" for node in sorted(
                (n for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 and any(_names_a_task(c, names) for c in [n.left, *n.comparators])), key=lambda n: n.lineno)]
    return found


def test_no_module_outside_the_tasks_compares_a_task_name():
    found = task_name_comparisons()
    assert not found, ("task names compared outside models/tasks/: make the decision an attribute or "
                       "method of the task type (models/tasks/base.py)\n  " + "\n  ".join(found))


def test_a_task_name_comparison_is_named(tmp_path):
    planted(tmp_path, {"models/tasks/toy.py": 'ok = name == "toy"\n',
                       "bench/run.py": 'a = task.task == "toy"\nb = t.name in ("binary", "toy")\nc = {"toy": 1}\n'
                                       'd = kind == "sum"\n'})
    assert task_name_comparisons(tmp_path, {"toy", "binary"}) == [
        "bench/run.py:1: task.task == 'toy'", "bench/run.py:2: t.name in ('binary', 'toy')"]
