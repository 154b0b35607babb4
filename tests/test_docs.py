"""The docs are current: docs/parameters.md is what `make docs` generates from the spec the
trigger form is built from; docs/screenshots.json, what `make screenshots` pictured, is what the
code would show now; every link between the README and docs/ reaches its file and heading."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from finetune import docs
from finetune.params import dag_params
from finetune_contract.train_config import TrainConfig
from tools import screenshots


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


@pytest.fixture(scope="module")
def pictured_now() -> dict:
    """What the docs' screenshots would show of the code as it is (no browser, no Airflow)."""
    return screenshots.screenshots_record()


def test_the_screenshots_show_the_tasks_presets_sections_and_columns_the_code_has(pictured_now):
    """A preset, a stage, a form section, a field's note, a runs page column or a report figure
    added or changed without `make screenshots` fails here."""
    committed = json.loads(screenshots.RECORD.read_text())
    stale = screenshots.stale_pictures(committed, pictured_now)
    assert not stale, screenshots.stale_message(stale)
    assert set(committed) == set(screenshots.PICTURES)
    for name in screenshots.PICTURES:
        assert (docs.REPO_ROOT / "docs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_a_stale_record_names_the_pictures_and_make_screenshots(pictured_now, tmp_path,
                                                                 monkeypatch, capsys):
    before = copy.deepcopy(pictured_now)  # as committed before a preset and a stage were added
    before["trigger-form.png"]["presets"].pop()
    before["trigger-form.png"]["tasks"].remove("evaluate")
    before["report.png"]["charts"].pop()
    record = tmp_path / "screenshots.json"
    record.write_text(json.dumps(before))
    monkeypatch.setattr(screenshots, "RECORD", record)
    monkeypatch.setattr(screenshots, "screenshots_record", lambda: pictured_now)
    assert screenshots.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "trigger-form.png (tasks, presets); report.png (charts)" in err
    assert "run `make screenshots`" in err
    record.write_text(json.dumps(pictured_now))
    assert screenshots.main(["--check"]) == 0
