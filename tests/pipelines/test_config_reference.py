"""docs/reference/config.md is what the schema generates: a default, a key or a description changed in
pipelines/config/project.py without `python -m habitus.pipelines.config.reference --write` fails here."""

import re

from pydantic import Field

from habitus.pipelines.config import project, reference
from habitus.pipelines.config.base import Strict


def test_the_committed_reference_is_what_the_schema_generates():
    committed = reference.REFERENCE.read_text()
    assert committed == reference.generate(), (
        "docs/reference/config.md differs from the schema: run python -m habitus.pipelines.config.reference --write")


def test_every_key_of_every_section_is_listed_with_a_description():
    text = reference.generate()
    for key, model, _ in reference._sections(project.ProjectConfig, "project"):
        section = text.split(f"{{ #{reference._anchor(key)} }}", 1)[1].split("\n## ", 1)[0]
        for name, info in model.model_fields.items():
            row = re.search(rf'^\| <code class="key">{name}</code> \|.*$', section, re.M)
            assert row, f"{key}.{name} is not in its section"
            assert info.description, f"{key}.{name} has no description (Field(description=...))"


def test_a_changed_default_changes_the_reference(monkeypatch):
    class Quality(project.QualitySettings):
        max_dropped_share: float = Field(0.02, ge=0, le=1, description="events dropped by the quarantine")

    class Changed(project.ProjectConfig):
        quality: Quality = Field(Quality(), description="bad input tolerated before checks fail")

    assert '| <code class="key">max_dropped_share</code> | number | `0.01` |' in reference.generate()
    monkeypatch.setattr(reference, "ProjectConfig", Changed)
    after = reference.generate()
    assert '| <code class="key">max_dropped_share</code> | number | `0.02` |' in after
    assert after != reference.REFERENCE.read_text()  # what the first test would catch


def test_types_defaults_and_allowed_values_are_read_from_the_fields():
    class Section(Strict):
        """A section."""
        window: project.Duration = Field(28, description="a window")
        mode: str = Field("a", pattern=r"^(a|b)$", description="a mode")
        kind: project.Literal["x", "y"] = Field("x", description="a kind")
        count: int | None = Field(None, ge=1, le=9, description="a count")
        names: list[str] = Field(default_factory=list, description="names")

    rows = {m.group(1): m.group(2) for m in re.finditer(r'^\| <code class="key">(\w+)</code> (\|.*)$', _table(Section),
                                                        re.M)}
    assert rows["window"] == "| duration | `28d` |  | a window |"
    assert rows["mode"] == "| string | `a` | matches `^(a|b)$` | a mode |"
    assert rows["kind"] == "| string | `x` | `x`, `y` | a kind |"
    assert rows["count"] == "| integer or null | none | &gt;= 1; &lt;= 9 | a count |"
    assert rows["names"] == "| list of string | empty |  | names |"


def test_a_key_stays_on_one_line_in_the_manual():
    """Keys are code the manual's stylesheet keeps whole (the theme breaks code anywhere in a narrow column)."""
    from pathlib import Path

    assert '| <code class="key">inference_processes</code> |' in reference.generate()
    css = (Path(reference.__file__).resolve().parents[2] / "docs" / "stylesheets" / "extra.css").read_text()
    rule = css.split(".md-typeset code.key", 1)[1].split("}", 1)[0]
    assert "white-space: nowrap" in rule and "word-break: normal" in rule


def _table(model) -> str:
    class Root(Strict):
        section: model = Field(description="the section")

    original = reference.ProjectConfig
    try:
        reference.ProjectConfig = Root
        return reference.generate()
    finally:
        reference.ProjectConfig = original


def test_the_module_prints_the_reference(capsys):
    assert reference.main([]) == 0
    assert capsys.readouterr().out == reference.generate()
