"""Bad data set rows (not JSON, a field missing, null, not a string or empty, longer than seq_len):
skipped and counted by reason, or with bad_rows=error the first one fails naming where it is."""

import json
import re

import datasets
import pandas as pd
import pytest
from transformers import AutoTokenizer

from finetune_contract.data import encode_example
from tests.support.training import demo_rows, write_jsonl
from trainer.config import load_config
from trainer.data import build_splits
from trainer.demo import DEMO_TOKENIZER

SEQ_LEN = 48
LONG = " ".join(["owl"] * 100)  # far more than SEQ_LEN tokens
# One bad line of each kind, as written to a jsonl file: (line, reason, what the error says).
BAD_LINES = [
    ('{"prompt": "Name a bird", "response": "owl"', "malformed", "not JSON"),
    ('["Name a bird", "owl"]', "malformed", "a JSON list, not an object"),
    ('{"prompt": "Name a bird"}', "missing_field", "response_field='response' is missing"),
    ('{"prompt": null, "response": "owl"}', "missing_field", "prompt_field='prompt' is missing"),
    ('{"prompt": "Count to one", "response": 1}', "not_string",
     "response_field='response' is a int, not a string"),
    ('{"prompt": "Name a bird", "response": ""}', "empty", "response_field='response' is empty"),
    ('{"prompt": "  ", "response": "owl"}', "empty", "prompt_field='prompt' is empty"),
    (json.dumps({"prompt": "Repeat owl", "response": LONG}), "too_long",
     f"tokens, more than seq_len {SEQ_LEN}"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def good_lines(n: int) -> list[str]:
    return [json.dumps(row) for row in demo_rows(n)]


def config_for(dataset, **overrides):
    return load_config(None, {"dataset": str(dataset), "seq_len": SEQ_LEN, **overrides})


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_bad_jsonl_rows_are_skipped_and_counted_by_reason(tmp_path, tokenizer, packing):
    good = good_lines(40)
    lines = good[:20] + [line for line, _, _ in BAD_LINES] + ["", "   "] + good[20:]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")

    splits = build_splits(config_for(path, packing=packing))

    assert splits.skipped == {"malformed": 2, "missing_field": 2, "not_string": 1, "empty": 2,
                              "too_long": 1}  # blank lines are no rows
    assert splits.skipped_rows == len(BAD_LINES)
    # every good row is kept, none of the bad: the same tokens
    good_ids = [encode_example(tokenizer, r["prompt"], r["response"])[0]
                for r in demo_rows(40)]
    kept = list(splits.train["input_ids"]) + list(splits.eval["input_ids"])
    if packing:
        assert all(len(row) <= SEQ_LEN for row in kept)
        assert sorted(sum(kept, [])) == sorted(sum(good_ids, []))
    else:
        assert sorted(kept) == sorted(good_ids)


@pytest.mark.parametrize(("line", "reason", "message"), BAD_LINES,
                         ids=[f"{reason}-{i}" for i, (_, reason, _) in enumerate(BAD_LINES)])
def test_with_bad_rows_error_the_first_bad_row_fails_naming_file_line_and_problem(
        tmp_path, tokenizer, line, reason, message):
    path = tmp_path / "rows.jsonl"
    # line 4: two good rows, a blank line, the bad row, then a different bad row later
    later = BAD_LINES[0][0] if reason != "malformed" else BAD_LINES[2][0]
    path.write_text("\n".join(good_lines(2) + ["", line] + good_lines(30) + [later]) + "\n")

    with pytest.raises(ValueError, match=f"{re.escape(str(path))} line 4: .*"
                                         f"{re.escape(message)}.*bad_rows=error"):
        build_splits(config_for(path, bad_rows="error"))


def test_a_bad_row_of_a_csv_in_a_directory_is_named_by_file_and_row(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    pd.DataFrame(demo_rows(20)).to_csv(data / "a.csv", index=False)
    rows = demo_rows(20)
    rows[2] = {"prompt": "Name a bird", "response": None}
    pd.DataFrame(rows).to_csv(data / "b.csv", index=False)

    with pytest.raises(ValueError, match=re.escape(f"{data / 'b.csv'} row 3: response_field=")):
        build_splits(config_for(data, bad_rows="error"))
    assert build_splits(config_for(data)).skipped == {"missing_field": 1}


def test_a_bad_row_of_a_hub_data_set_is_named_by_split_and_row(monkeypatch, tokenizer):
    rows = demo_rows(30) + [{"prompt": "Repeat owl", "response": LONG}]
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *args, **kwargs: datasets.Dataset.from_list(rows))
    config = config_for("org/birds", dataset_split="validation", bad_rows="error")
    with pytest.raises(ValueError, match="org/birds split validation row 31: .* tokens"):
        build_splits(config)


def test_a_data_set_of_only_bad_rows_fails_with_the_counts_and_the_first_bad_row(
        tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "no prompt here"}] * 30)
    with pytest.raises(ValueError, match=r"0 usable rows.*30 missing_field.*"
                                         r"rows.jsonl line 1: prompt_field='prompt' is missing"):
        build_splits(config_for(path))


def test_an_empty_or_blank_jsonl_data_set_is_an_error_naming_it(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=f"dataset {re.escape(str(tmp_path))} has no rows"):
        build_splits(config_for(tmp_path))


def test_an_edited_jsonl_file_is_read_again_not_taken_from_the_cache(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(good_lines(30)) + "\n")
    assert build_splits(config_for(path)).skipped == {}
    path.write_text("\n".join(good_lines(30) + ["{not json"]) + "\n")
    assert build_splits(config_for(path)).skipped == {"malformed": 1}


def test_bad_rows_accepts_skip_or_error_only():
    with pytest.raises(ValueError, match="bad_rows: unknown value 'drop'; allowed: skip, error"):
        load_config(None, {"bad_rows": "drop"})
