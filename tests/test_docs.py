"""docs/parameters.md is what `make docs` generates from the spec the trigger form is built from."""

from __future__ import annotations

import dataclasses

from finetune import docs
from finetune.params import dag_params
from finetune_contract.train_config import TrainConfig


def test_the_committed_parameter_reference_is_what_make_docs_generates():
    committed = docs.PAGE.read_text() if docs.PAGE.exists() else ""
    assert committed == docs.render(), (
        "docs/parameters.md is not what the parameter spec generates: run `make docs` and commit "
        "docs/parameters.md")


def test_the_reference_shows_each_trigger_form_field_as_the_form_does():
    """Read from the form's own Params (what the trigger form renders), not the spec: a field the
    form has and the page lacks, or a title, description, choice or bound that differs, fails."""
    page = docs.render()
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    for name, param in dag_params().items():
        schema = param.schema
        assert name in rows, f"{name}: in the trigger form, not in docs/parameters.md"
        row = rows[name]
        assert f"({docs._cell(schema['title'])})" in row, name
        description = param.description  # Param keeps it out of its schema
        if description is not None:
            assert docs._cell(description) in row, name
        else:
            assert schema["description_md"].strip() in page, name
        for choice in schema.get("enum", ()):
            assert f"`{choice}`" in row, (name, choice)
        for key in ("minimum", "maximum", "exclusiveMinimum"):
            if key in schema:
                assert docs._number(schema[key]) in row, (name, key)


def test_every_trainer_field_is_in_the_reference():
    rows = {line.split("`")[1] for line in docs.render().splitlines() if line.startswith("| `")}
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in rows]
    assert not missing, f"TrainConfig fields missing from docs/parameters.md: {missing}"


def test_check_mode_fails_naming_make_docs_when_the_page_differs(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "parameters.md"
    stale.write_text("# Parameter reference\n\nhand-edited\n")
    monkeypatch.setattr(docs, "PAGE", stale)
    monkeypatch.setattr(docs, "REPO_ROOT", tmp_path)
    assert docs.main(["--check"]) == 1
    assert "run `make docs`" in capsys.readouterr().err
    assert docs.main([]) == 0
    assert docs.main(["--check"]) == 0


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    return {docs._anchor(line.lstrip("#").strip()) for line in markdown.splitlines()
            if line.startswith("#")}


def test_every_link_between_the_readme_and_docs_reaches_a_file_and_heading():
    import re

    pages = [docs.REPO_ROOT / "README.md", *sorted((docs.REPO_ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
