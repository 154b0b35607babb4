import json

import pandas as pd
import pytest
from conftest import demo_rows, write_jsonl
from transformers import AutoTokenizer

from trainer.config import load_config
from trainer.data import (
    IGNORE_INDEX,
    PROMPT_TEMPLATE,
    DistributedSampler,
    EvalBatches,
    build_splits,
    collate,
    encode_example,
)
from trainer.demo import DEMO_DATASET, DEMO_TOKENIZER
from trainer.demo.make_data import make_rows
from trainer.model import BUILTIN_CONFIGS


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def test_prompt_tokens_carry_no_loss_and_the_response_and_eos_do(tokenizer):
    prompt, response = "Which day comes after Monday?", "Tuesday"
    input_ids, labels = encode_example(tokenizer, 128, prompt, response)
    prompt_ids = tokenizer(PROMPT_TEMPLATE.format(prompt=prompt))["input_ids"]
    n = len(prompt_ids)
    assert input_ids[:n] == prompt_ids
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == input_ids[n:]
    assert input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(input_ids[n:-1]).strip() == response


def test_plain_text_rows_take_loss_on_every_token(tokenizer):
    input_ids, labels = encode_example(tokenizer, 128, None, "the sun and the moon")
    assert labels == input_ids and input_ids[-1] == tokenizer.eos_token_id


def test_examples_are_truncated_to_seq_len(tokenizer):
    input_ids, labels = encode_example(tokenizer, 8, "Repeat cat 4 times.", "cat cat cat cat")
    assert len(input_ids) == len(labels) == 8


def test_padding_carries_no_loss(tokenizer):
    rows = [
        dict(zip(("input_ids", "labels"), encode_example(tokenizer, 128, p, r)))
        for p, r in [("Write in capitals: owl", "OWL"), ("Reverse the list: a b c", "c b a")]
    ]
    batch = collate(rows, pad_id=tokenizer.pad_token_id)
    short = min(range(2), key=lambda i: len(rows[i]["input_ids"]))
    n = len(rows[short]["input_ids"])
    assert (batch.input_ids[short, n:] == tokenizer.pad_token_id).all()
    assert (batch.labels[short, n:] == IGNORE_INDEX).all()
    assert batch.num_tokens == sum(len(row["input_ids"]) for row in rows)


def test_rows_with_empty_or_missing_fields_are_skipped_and_counted(tmp_path, tokenizer):
    rows = demo_rows(40) + [
        {"prompt": "Write in capitals: owl", "response": ""},
        {"prompt": None, "response": "OWL"},
        {"prompt": "Write in capitals: owl"},
    ]
    config = load_config(None, {"dataset": str(write_jsonl(tmp_path / "d.jsonl", rows))})
    splits = build_splits(config, tokenizer)
    assert splits.skipped_rows == 3
    assert len(splits.train) + len(splits.eval) == 40


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_csv_parquet_and_json_files_load_by_extension(tmp_path, tokenizer, suffix):
    frame = pd.DataFrame(demo_rows(30))
    path = tmp_path / f"rows.{suffix}"
    if suffix == "csv":
        frame.to_csv(path, index=False)
    elif suffix == "parquet":
        frame.to_parquet(path)
    else:
        path.write_text(json.dumps(frame.to_dict(orient="records")))
    splits = build_splits(load_config(None, {"dataset": str(path)}), tokenizer)
    assert len(splits.train) + len(splits.eval) == 30


def test_a_missing_column_is_named_with_the_option_that_chose_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", demo_rows(20))
    config = load_config(None, {"dataset": str(path), "text_field": "body"})
    with pytest.raises(ValueError, match="text_field='body'"):
        build_splits(config, tokenizer)


def test_the_eval_split_is_held_out_deterministically_and_holds_at_least_a_batch(tokenizer):
    config = load_config(None, {"eval_fraction": 0.001, "micro_batch": 8})
    first, second = build_splits(config, tokenizer), build_splits(config, tokenizer)
    assert len(first.eval) == 8
    assert first.eval["input_ids"] == second.eval["input_ids"]
    assert first.train["input_ids"] == second.train["input_ids"]
    assert len(first.train) + len(first.eval) == 3000


def test_ranks_draw_disjoint_rows_covering_an_epoch():
    samplers = [DistributedSampler(50, 4, rank, 3, seed=7) for rank in range(3)]
    assert samplers[0].batches_per_epoch == 4  # 50 // 3 ranks = 16 rows, 4 batches of 4
    epoch = [[i for _ in range(4) for i in s.next_indices()] for s in samplers]
    flat = [i for rows in epoch for i in rows]
    assert len(flat) == len(set(flat)) == 48


def test_a_restored_sampler_continues_with_the_same_batches_across_epochs():
    sampler = DistributedSampler(40, 4, 1, 2, seed=3)
    for _ in range(3):
        sampler.next_indices()
    state = sampler.state_dict()
    expected = [sampler.next_indices() for _ in range(10)]  # crosses into epochs 1 and 2
    restored = DistributedSampler(40, 4, 1, 2, seed=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert [restored.next_indices() for _ in range(10)] == expected


def test_each_epoch_is_a_new_permutation():
    sampler = DistributedSampler(16, 8, 0, 1, seed=0)
    first = sampler.next_indices() + sampler.next_indices()
    second = sampler.next_indices() + sampler.next_indices()
    assert sorted(first) == sorted(second) == list(range(16)) and first != second


def test_every_rank_runs_the_same_number_of_eval_batches_and_each_row_is_counted_once(tokenizer):
    config = load_config(None, {})
    ds = build_splits(config, tokenizer).eval.select(range(21))
    per_rank = [list(EvalBatches(ds, 4, rank, 4, tokenizer.pad_token_id)) for rank in range(4)]
    assert {len(batches) for batches in per_rank} == {2}  # ceil(ceil(21 / 4) / 4)
    labelled = sum(
        int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for batches in per_rank for b in batches
    )
    assert labelled == sum(sum(label != IGNORE_INDEX for label in row[1:]) for row in ds["labels"])


def test_the_demo_data_is_what_the_generator_makes():
    with open(DEMO_DATASET) as f:
        assert [json.loads(line) for line in f] == make_rows(3000, seed=0)


def test_the_demo_tokenizer_fills_the_tiny_llama_vocabulary(tokenizer):
    assert len(tokenizer) == BUILTIN_CONFIGS["tiny-llama"]["vocab_size"]
