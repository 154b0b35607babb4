"""A mixture on the Airflow side: its sources parsed and checked, every problem named by the
source's index and key (mixture[1].response_field); validate refusing before any cost a source
that cannot be read, a field a source lacks, a chat template missing for conversations, weights
that are not positive and SFT mixed with preference pairs; the prepare_data stage's checks per
source; the report, the runs page and MLflow showing the sources and their eval loss each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config import ConfigError
from finetune.prepare_stage import RUN_RECORD, prepare_run_data
from finetune.validate import validate_params
from finetune_contract.mixture import (
    SOURCE_FIELDS,
    Source,
    mixture_counts,
    parse_mixture,
)
from finetune_contract.parameters import BY_NAME
from tests.support.chat_tokenizers import without_chat_template
from tests.support.training import demo_rows, write_jsonl

DEMO = "trainer/demo/instructions.jsonl"
CONVERSATIONS = "trainer/demo/conversations.jsonl"
PREFERENCES = "trainer/demo/preferences.jsonl"


def refused(mixture: list | str, **conf) -> list[tuple[str, str]]:
    text = mixture if isinstance(mixture, str) else json.dumps(mixture)
    with pytest.raises(ConfigError) as err:
        validate_params({"procs_per_node": 1, "mixture": text, **conf}, run_id="manual__mix")
    return err.value.errors


def named(errors: list[tuple[str, str]], field: str, words: str) -> bool:
    return any(f == field and words in m for f, m in errors)


# -- the sources, parsed -------------------------------------------------------------------

def test_sources_take_their_names_fields_and_shares():
    sources, problems = parse_mixture(json.dumps([
        {"dataset": "data/ours.jsonl", "weight": 3, "response_field": "answer"},
        {"dataset": "org/chat", "rows": 1000},
        {"dataset": "s3://bucket/more/ours.jsonl", "name": "theirs"},
        {"dataset": "other/ours.parquet"}]))
    assert problems == []
    assert [(s.name, s.weight, s.rows) for s in sources] == [
        ("ours", 3.0, None), ("chat", None, 1000), ("theirs", 1.0, None), ("ours-3", 1.0, None)]
    assert sources[0].fields == {"dataset": "data/ours.jsonl", "response_field": "answer"}
    assert parse_mixture("") == ([], []) and parse_mixture("  ") == ([], [])


@pytest.mark.parametrize(("text", "field", "words"), [
    ("[{", "mixture", "is not JSON"),
    ('{"dataset": "a.jsonl"}', "mixture", "is a JSON dict"),
    ("[]", "mixture", "is an empty list"),
    ('["a.jsonl"]', "mixture[0]", "is a JSON str, not an object"),
    ('[{"weight": 1}]', "mixture[0].dataset", "is missing"),
    ('[{"dataset": "a.jsonl", "weight": 0}]', "mixture[0].weight", "positive number, got 0"),
    ('[{"dataset": "a.jsonl"}, {"dataset": "b.jsonl", "weight": -2}]', "mixture[1].weight",
     "positive number, got -2"),
    ('[{"dataset": "a.jsonl", "weight": true}]', "mixture[0].weight", "positive number"),
    ('[{"dataset": "a.jsonl", "rows": 0}]', "mixture[0].rows", "positive integer"),
    ('[{"dataset": "a.jsonl", "rows": 10, "weight": 1}]', "mixture[0].rows", "not both"),
    ('[{"dataset": "a.jsonl", "respons_field": "r"}]', "mixture[0].respons_field",
     "is not a key of a source"),
    ('[{"dataset": "a.jsonl", "dataset_format": "xml"}]', "mixture[0].dataset_format",
     "unknown value 'xml'"),
    ('[{"dataset": "a.jsonl", "prompt_field": 3}]', "mixture[0].prompt_field",
     "must be a string"),
    ('[{"dataset": ""}]', "mixture[0].dataset", "must not be empty"),
    ('[{"dataset": "a.jsonl", "name": "x"}, {"dataset": "b.jsonl", "name": "x"}]',
     "mixture[1].name", "also mixture[0]'s name"),
    ('[{"dataset": "a.jsonl", "name": "a b"}]', "mixture[0].name", "is not a name"),
])
def test_a_bad_source_is_named_by_its_index_and_key(text, field, words):
    _, problems = parse_mixture(text)
    assert named(problems, field, words), problems


def test_each_source_field_is_checked_by_its_own_parameters_rule():
    """One rule, one place: a source's field is refused exactly when the parameter is."""
    for key in SOURCE_FIELDS:
        parameter = BY_NAME[key]
        value = "a\tb" if parameter.choices is None else "nope"
        _, problems = parse_mixture(json.dumps([{"dataset": "a.jsonl", key: value}]))
        assert (f"mixture[0].{key}", parameter.problem(value)) in problems, key


def weighted(*weights: float) -> list[Source]:
    return [Source(i, f"s{i}", {"dataset": f"s{i}"}, weight, None)
            for i, weight in enumerate(weights)]


def test_weights_share_the_examples_until_the_first_source_runs_out():
    assert mixture_counts([1000, 1000], weighted(1, 1)) == [1000, 1000]
    assert mixture_counts([1000, 100], weighted(3, 1)) == [300, 100]
    assert mixture_counts([100, 1000, 10_000], weighted(1, 2, 7)) == [100, 200, 700]
    fixed = [*weighted(1, 1), Source(2, "s2", {"dataset": "s2"}, None, 5000)]
    assert mixture_counts([400, 900, 10], fixed) == [400, 400, 5000]


# -- validate, before any cost --------------------------------------------------------------

def test_a_mixture_of_the_demo_sets_is_accepted():
    cfg = validate_params({"procs_per_node": 1, "mixture": json.dumps([
        {"dataset": DEMO, "weight": 2}, {"dataset": CONVERSATIONS, "weight": 1}])},
        run_id="manual__mix")
    assert json.loads(cfg.mixture)[1]["dataset"] == CONVERSATIONS


def test_a_source_that_cannot_be_read_is_refused_naming_it(tmp_path):
    errors = refused([{"dataset": DEMO}, {"dataset": str(tmp_path / "missing.jsonl")}])
    assert named(errors, "mixture[1].dataset", "does not exist"), errors
    (tmp_path / "empty").mkdir()
    errors = refused([{"dataset": str(tmp_path / "empty")}, {"dataset": DEMO}])
    assert named(errors, "mixture[0].dataset", "holds no data files"), errors


def test_a_field_a_source_lacks_is_refused_naming_the_source_and_field(tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 40)
    errors = refused([{"dataset": DEMO},
                      {"dataset": str(data), "prompt_field": "question", "response_field": "ans"}])
    assert named(errors, "mixture[1].response_field", "'ans' is not a column of"), errors
    assert not any(field.startswith("mixture[0]") for field, _ in errors)


def test_conversations_without_a_chat_template_are_refused_naming_the_source(tmp_path):
    plain = without_chat_template(tmp_path / "plain")
    errors = refused([{"dataset": DEMO}, {"dataset": CONVERSATIONS}], tokenizer=str(plain))
    assert named(errors, "mixture[1].messages_field", "has none"), errors


def test_sft_and_preference_sources_are_not_mixed():
    errors = refused([{"dataset": DEMO}, {"dataset": PREFERENCES}])
    assert named(errors, "mixture[1].dataset", "holds preference pairs"), errors
    errors = refused([{"dataset": PREFERENCES}, {"dataset": CONVERSATIONS}], method="dpo")
    assert named(errors, "mixture[1].dataset", "holds SFT rows"), errors
    errors = refused([{"dataset": DEMO, "chosen_field": "better"}])
    assert named(errors, "mixture[0].chosen_field", "applies to method dpo only"), errors


def test_weights_that_are_not_positive_and_a_dataset_beside_a_mixture_are_refused():
    errors = refused([{"dataset": DEMO, "weight": 0}, {"dataset": CONVERSATIONS, "weight": -1}],
                     dataset="other.jsonl")
    assert named(errors, "mixture[0].weight", "got 0") and \
        named(errors, "mixture[1].weight", "got -1"), errors
    assert named(errors, "dataset", "beside a mixture"), errors


def test_a_source_too_small_for_its_held_out_split_is_refused(tmp_path):
    few = write_jsonl(tmp_path / "few.jsonl", demo_rows(6))
    errors = refused([{"dataset": DEMO}, {"dataset": str(few)}])
    assert named(errors, "mixture[1].dataset", "has 6 usable rows: too few for an eval split"), \
        errors


# -- the prepare_data stage ------------------------------------------------------------------

def test_too_many_rows_skipped_in_one_source_fail_the_run_naming_it(tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", demo_rows(70) + [
        {"prompt": "word " * 300, "response": "x"}] * 30)
    cfg = validate_params({"procs_per_node": 1, "output_dir": str(tmp_path / "runs"),
                           "mixture": json.dumps([{"dataset": DEMO}, {"dataset": str(long)}])},
                          run_id="manual__skips")
    with pytest.raises(ConfigError) as raised:
        prepare_run_data(cfg, num_proc=1)
    (field, message), = raised.value.errors
    assert field == "max_skipped_fraction" and "30 of 100 rows of mixture[1] (long" in message


# -- what a run shows ---------------------------------------------------------------------------

SOURCES = [
    {"name": "ours", "index": 0, "dataset": "/d/ours.jsonl", "row_format": "conversations",
     "weight": 3.0, "rows": None, "rows_read": 1000, "rows_kept": 990, "skipped_rows": 10,
     "skipped_rows_by_reason": {"template_error": 10}, "longest_skipped_rows": [],
     "train_rows_available": 940, "train_examples": 900, "repeated": False, "share": 0.75,
     "eval_examples": 50, "tokens_eval": 5000},
    {"name": "public", "index": 1, "dataset": "org/public", "row_format": "prompt and response",
     "weight": None, "rows": 300, "rows_read": 200, "rows_kept": 200, "skipped_rows": 0,
     "skipped_rows_by_reason": {}, "longest_skipped_rows": [], "train_rows_available": 190,
     "train_examples": 300, "repeated": True, "share": 0.25, "eval_examples": 10,
     "tokens_eval": 400}]


def mixture_run(run_dir: Path) -> dict:
    from finetune.report import write_report

    run_dir.mkdir()
    record = {"path": "/p/k", "cache_hit": False, "seconds": 2.0, "rows_read": 1200,
              "rows_kept": 1190, "skipped_rows": 10, "skipped_rows_by_reason":
              {"template_error": 10}, "longest_skipped_rows": [], "train_rows": 1200,
              "eval_rows": 60, "tokens_per_epoch": 9000, "length_histogram": {},
              "sources": SOURCES}
    (run_dir / RUN_RECORD).write_text(json.dumps(record))
    evals = [{"type": "eval", "step": step, "eval_loss": loss, "time": 0.0,
              "eval_loss_by_source": {"ours": loss + 0.5, "public": loss - 0.5}}
             for step, loss in ((0, 6.0), (10, 3.0))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "evaluation.json").write_text(json.dumps(
        {"loss": 3.0, "loss_by_source": {"ours": 3.5, "public": 2.5}, "eval_rows": 60}))
    return write_report(run_dir, run_id="r", status="success", config={"target": "local"})


def test_the_report_shows_the_mixture_and_the_eval_loss_per_source(tmp_path):
    report = mixture_run(tmp_path / "run")
    assert report["eval_loss_by_source"] == {"ours": {"initial": 6.5, "final": 3.5},
                                             "public": {"initial": 5.5, "final": 2.5}}
    assert [s["name"] for s in report["data"]["sources"]] == ["ours", "public"]
    assert report["series"]["eval"][1]["eval_loss_by_source"] == {"ours": 3.5, "public": 2.5}
    html = (tmp_path / "run" / "report.html").read_text()
    assert "<h3>Mixture</h3>" in html and "Eval loss per source" in html
    assert "75.0%" in html and "300 (25.0%, 190 rows repeated)" in html
    assert "6.5000 → 3.5000" in html and "loss on public" in html


def test_the_runs_page_shows_each_sources_share_and_eval_loss(tmp_path):
    from finetune.runs_page import list_runs, render_runs_table

    mixture_run(tmp_path / "run")
    table = render_runs_table(list_runs([tmp_path]))
    assert "ours: 75% of training, 10 skipped, eval loss 6.500 → 3.500" in table
    assert "public: 25% of training, 0 skipped, eval loss 5.500 → 2.500" in table


def test_mlflow_gets_the_sources_as_params_and_what_each_gave_as_metrics(tmp_path):
    from finetune.tracking import source_metrics, source_params

    report = mixture_run(tmp_path / "run")
    assert source_params(report["data"]) == {"mixture/ours": "/d/ours.jsonl (weight 3)",
                                             "mixture/public": "org/public (rows 300)"}
    metrics = source_metrics(report["data"], report["evaluation"])
    assert metrics["data/ours/share"] == 0.75 and metrics["data/public/train_examples"] == 300
    assert metrics["eval/loss/ours"] == 3.5 and metrics["eval/loss/public"] == 2.5
