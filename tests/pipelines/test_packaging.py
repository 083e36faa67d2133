"""The install: the four folders of the repository are importable as habitus.* and nothing else, so a
project's own `models` or `pipelines` package (a Django app, a notebook's helpers) is never shadowed."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "assets", "resources", "pipelines")
MAX_LINES = 450


def test_every_package_folder_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {"habitus." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert folders - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"
    assert {setuptools["package-dir"][f"habitus.{top}"] for top in PACKAGES} == set(PACKAGES)


def test_only_habitus_is_importable_outside_the_repository(tmp_path):
    def imports(name: str) -> bool:
        return subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path,
                              capture_output=True).returncode == 0

    assert imports("habitus.models.train.finetune") and imports("habitus.pipelines.definitions")
    assert not any(imports(top) for top in PACKAGES)
    lazy = subprocess.run([sys.executable, "-c", "import sys, habitus; print('torch' in sys.modules, "
                           "'dagster' in sys.modules); print(habitus.Project.__module__)"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert lazy.returncode == 0, lazy.stderr
    # `import habitus` stays light; the API loads on first use
    assert lazy.stdout.split() == ["False", "False", "habitus.pipelines.api"], lazy.stderr


def test_no_module_is_over_the_size_a_reader_takes_in():
    """A module of the four packages over MAX_LINES lines holds more than one role: split it by role."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines (split by role): {long}"
