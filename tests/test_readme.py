"""The README is the manual's front page: at most 200 lines, the two commands first, and every
relative link pointing at a file of the repository (the docs site checks its own links with
`mkdocs build --strict`; the README is outside it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_short_and_the_two_commands_first():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the manual (docs/) holds the rest"
    first_code = README.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first_code.splitlines()] == [["make", "demo"], ["make", "test"]]
    assert README.index("```bash") < README.index("\n## ")


def test_relative_links_point_at_files():
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert targets, "the README links the manual"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def _first_yaml(text: str) -> str:
    return text.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_documented_project_configs_load(tmp_path):
    """The README's config and the project-config guide's full example are valid configs of the schema."""
    from habitus.pipelines.config.project import load_project

    for name, text in (("README.md", README), ("docs/guide/config.md", (ROOT / "docs/guide/config.md").read_text())):
        config = re.sub(r"(?m)^workspace: \S+", f"workspace: {tmp_path / 'ws'}", _first_yaml(text))
        path = tmp_path / f"{Path(name).stem}.yaml"
        path.write_text(config)
        project = load_project(path)
        assert project.scenarios and project.sources, name
