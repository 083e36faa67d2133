"""Links to the manual point at pages that exist: a code comment, a test, a config or a page that names
`docs/<page>.md`, and every relative Markdown link of the README and the docs pages (mkdocs build --strict
checks the site's own links as well, but only where mkdocs runs)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".habitus", ".git", "habitus.egg-info", "node_modules", "__pycache__", "site"}
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".css"}
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w/.-]*?\.md\b")
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP or part.startswith(".venv") for part in rel.parts) or not path.is_file():
            continue
        if path == Path(__file__).resolve():  # this file's own examples of broken links
            continue
        if path.suffix in TEXT or path.name in ("Makefile", "Dockerfile"):
            yield rel, path.read_text(errors="replace")


def broken_links() -> list[str]:
    """'file:line: target' for every link to a Markdown page of the repository that does not exist."""
    found = []
    for rel, text in _files():
        for number, line in enumerate(text.splitlines(), 1):
            targets = [ROOT / m for m in DOCS_PATH.findall(line)]
            if rel.suffix == ".md":
                targets += [(ROOT / rel).parent / m for m in MD_LINK.findall(line) if "://" not in m]
            found += [f"{rel}:{number}: {t.resolve().relative_to(ROOT) if t.resolve().is_relative_to(ROOT) else t}"
                      for t in targets if not t.exists()]
    return found


def test_every_link_to_a_docs_page_points_at_a_page_that_exists():
    broken = broken_links()
    assert not broken, "links to pages that do not exist:\n" + "\n".join(broken)


def test_a_link_to_a_missing_page_is_found(tmp_path, monkeypatch):
    """The scan itself: a comment naming a page that is not there, and a relative link in a page."""
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "docs" / "guide" / "a.md").write_text("[there](b.md) and [gone](../nowhere.md#x)\n")
    (tmp_path / "docs" / "guide" / "b.md").write_text("see docs/guide/a.md\n")
    (tmp_path / "code.py").write_text("# measured in docs/speed.md; see docs/guide/b.md\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(broken_links()) == ["code.py:1: docs/speed.md", "docs/guide/a.md:1: docs/nowhere.md"]
