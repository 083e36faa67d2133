"""The layers of docs/ARCHITECTURE: pipelines → assets → resources → models, arrows pointing down
only. Every import in the four packages, at module level or inside a function, is read with `ast`;
one that reaches a package above its own fails the test with its file and line."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["models", "resources", "assets", "pipelines"]  # bottom to top


def imported_modules(tree: ast.AST):
    """(line, dotted module name) of every import in a module; relative imports are left out (they
    stay inside their own package)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


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
    (tmp_path / "assets" / "cache.py").write_text("import dagster\n\n\ndef f():\n    from pipelines.partitions import x\n")
    (tmp_path / "pipelines" / "definitions.py").write_text("from assets.cache import f\n")
    assert upward_imports(tmp_path) == [
        "assets/cache.py:5: assets/ imports pipelines.partitions (pipelines/ is above it)"]
