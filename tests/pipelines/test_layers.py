"""The layers of docs/ARCHITECTURE: pipelines → assets → resources → models, arrows pointing down
only. Every import in the four packages, at module level or inside a function, is read with `ast`;
one that reaches a package above its own fails the test with its file and line. Inside models/ the
rooms have an order of their own (ROOMS, models/__init__.py), no module imports the project's
own modules inside a function (but those in DEFERRED, each with its reason), and no module outside
models/tasks/ compares a task type's name."""

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


# ---------------------------------------------------------------------- the rooms of models/

# bottom to top: a module imports its own room and the rooms below it (models/__init__.py says why)
ROOMS = ["storage", "cache", "data", "nn", "tasks", "evaluate", "heads", "train", "serve", "explain"]
# the project's own modules imported inside a function: (file, module) -> the reason it cannot be at the
# top, which a comment at the import repeats (none today: third-party imports such as lightgbm may wait)
DEFERRED: dict[tuple[str, str], str] = {}


def room_of(module: str) -> str | None:
    """The room of a module of models/ ("models.heads.stacking" -> "heads"); None outside models/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "models" and len(parts) > 1 and parts[1] in ROOMS else None


def function_imports(tree: ast.AST):
    """(line, module) of every import inside a function (module: the one the import statement names)."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line, module in imported_modules(fn):
                yield line, module


def room_violations(root: Path = ROOT, deferred: dict = DEFERRED) -> list[str]:
    """Imports inside models/ that point up the rooms, and the project's modules imported inside a
    function where DEFERRED does not name the reason."""
    found = []
    for path in sorted((root / "models").rglob("*.py")):
        rel = path.relative_to(root)
        room = rel.parts[1] if len(rel.parts) > 2 else None
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in imported_modules(tree):
            target = room_of(module)
            if room in ROOMS and target is not None and ROOMS.index(target) > ROOMS.index(room):
                found.append(f"{rel}:{line}: models/{room}/ imports {module} ({target}/ is above it)")
        for line, module in function_imports(tree):
            if module.split(".")[0] in LAYERS and (str(rel), module) not in deferred:
                found.append(f"{rel}:{line}: {module} imported inside a function")
    return found


def test_models_rooms_point_down_and_import_at_the_top():
    found = room_violations()
    assert not found, ("imports inside models/ that point up its rooms (" + " < ".join(ROOMS) + ") or sit "
                       "inside a function; move the code to the room it belongs in, or the import to the "
                       "top:\n  " + "\n  ".join(found))


def test_the_rooms_are_the_folders_of_models():
    folders = sorted(p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(ROOMS)
    order = (ROOT / "models" / "__init__.py").read_text()
    assert " < ".join(ROOMS) in order  # the order written down where a reader of models/ looks first


def test_an_upward_room_import_and_a_deferred_import_are_named(tmp_path):
    planted(tmp_path, {"models/tasks/binary.py": "import numpy\n\nfrom habitus.models.heads.stacking import blend\n",
                       "models/heads/stacking.py": "def fit():\n    import lightgbm\n    from habitus.models.tasks import task\n"})
    assert room_violations(tmp_path) == [
        "models/heads/stacking.py:3: models.tasks imported inside a function",
        "models/tasks/binary.py:3: models/tasks/ imports models.heads.stacking (heads/ is above it)"]
    allowed = {("models/heads/stacking.py", "models.tasks"): "(the reason)"}
    assert room_violations(tmp_path, allowed) == [
        "models/tasks/binary.py:3: models/tasks/ imports models.heads.stacking (heads/ is above it)"]


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
