import json
import re
import shutil
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
from finetune_data.prepared_set import pack
from transformers import AutoTokenizer, LlamaForCausalLM

from finetune_contract.data import IGNORE_INDEX, PROMPT_TEMPLATE, encode_example
from finetune_contract.models import BUILTIN_MODELS
from tests.support.chat_tokenizers import without_chat_template
from tests.support.training import demo_rows, read_metrics, write_jsonl
from trainer.config import load_config
from trainer.data import (
    REJECTED_IDS,
    REJECTED_LABELS,
    EvalBatches,
    ResumableSampler,
    TrainBatches,
    build_splits,
    collate,
)
from trainer.demo import DEMO_DATASET, DEMO_PREFERENCES, DEMO_TOKENIZER
from trainer.demo.make_data import MONTHS, WEEKDAYS, make_preference_rows, make_rows
from trainer.model import builtin_config
from trainer.train import train

# A minimal chat template in the usual shape: BOS, role-tagged turns, EOS ending the assistant's.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def test_prompt_tokens_carry_no_loss_and_the_response_and_eos_do(tokenizer):
    prompt, response = "Which day comes after Monday?", "Tuesday"
    input_ids, labels = encode_example(tokenizer, prompt, response)
    prompt_ids = tokenizer(PROMPT_TEMPLATE.format(prompt=prompt))["input_ids"]
    n = len(prompt_ids)
    assert input_ids[:n] == prompt_ids
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == input_ids[n:]
    assert input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(input_ids[n:-1]).strip() == response


def test_plain_text_rows_take_loss_on_every_token(tokenizer):
    input_ids, labels = encode_example(tokenizer, None, "the sun and the moon")
    assert labels == input_ids and input_ids[-1] == tokenizer.eos_token_id


def test_padding_carries_no_loss(tokenizer):
    rows = [
        dict(zip(("input_ids", "labels"), encode_example(tokenizer, p, r)))
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
    splits = build_splits(config)
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
    splits = build_splits(load_config(None, {"dataset": str(path)}))
    assert len(splits.train) + len(splits.eval) == 30


def test_a_missing_column_is_named_with_the_option_that_chose_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", demo_rows(20))
    config = load_config(None, {"dataset": str(path), "text_field": "body"})
    with pytest.raises(ValueError, match="text_field='body'"):
        build_splits(config)


def test_the_eval_split_is_held_out_deterministically_and_holds_at_least_a_batch(tokenizer):
    config = load_config(None, {"eval_fraction": 0.001, "micro_batch": 8})
    first, second = build_splits(config), build_splits(config)
    assert len(first.eval) == 8
    assert first.eval["input_ids"] == second.eval["input_ids"]
    assert first.train["input_ids"] == second.train["input_ids"]
    assert len(first.train) + len(first.eval) == 3000


def test_ranks_draw_disjoint_rows_covering_an_epoch():
    samplers = [ResumableSampler(50, 4, rank, 3, seed=7) for rank in range(3)]
    assert samplers[0].batches_per_epoch == 4  # 50 // 3 ranks = 16 rows, 4 batches of 4
    epoch = [[i for _ in range(4) for i in s.next_indices()] for s in samplers]
    flat = [i for rows in epoch for i in rows]
    assert len(flat) == len(set(flat)) == 48


def test_a_restored_sampler_continues_with_the_same_batches_across_epochs():
    sampler = ResumableSampler(40, 4, 1, 2, seed=3)
    for _ in range(3):
        sampler.next_indices()
    state = sampler.state_dict()
    expected = [sampler.next_indices() for _ in range(10)]  # crosses into epochs 1 and 2
    restored = ResumableSampler(40, 4, 1, 2, seed=3)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert [restored.next_indices() for _ in range(10)] == expected


def test_each_epoch_is_a_new_permutation():
    sampler = ResumableSampler(16, 8, 0, 1, seed=0)
    first = sampler.next_indices() + sampler.next_indices()
    second = sampler.next_indices() + sampler.next_indices()
    assert sorted(first) == sorted(second) == list(range(16)) and first != second


def test_every_rank_runs_the_same_number_of_eval_batches_and_each_row_is_counted_once(tokenizer):
    config = load_config(None, {})
    ds = build_splits(config).eval.select(range(21))
    per_rank = [list(EvalBatches(ds, 4, rank, 4, tokenizer.pad_token_id)) for rank in range(4)]
    assert {len(batches) for batches in per_rank} == {2}  # ceil(ceil(21 / 4) / 4)
    labelled = sum(
        int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for batches in per_rank for b in batches
    )
    assert labelled == sum(sum(label != IGNORE_INDEX for label in row[1:]) for row in ds["labels"])


def test_the_demo_data_is_what_the_generator_makes():
    with open(DEMO_DATASET) as f:
        assert [json.loads(line) for line in f] == make_rows(3000, seed=0)


def answer_kind(answer: str) -> str:
    """What kind of question an answer answers, read off the answer alone."""
    words = answer.split()
    if answer in MONTHS:
        return "month"
    if answer in WEEKDAYS:
        return "weekday"
    if answer.isupper():
        return "capitals"
    if answer.isdigit():
        return "sum"
    if all(w.isdigit() for w in words):
        return "sort"
    return "repeat" if len(set(words)) == 1 else "reverse"


PROMPT_KINDS = {"Which month": "month", "Which day": "weekday", "Write in capitals": "capitals",
                "What is": "sum", "Sort ascending": "sort", "Repeat": "repeat",
                "Reverse the list": "reverse"}


def test_the_demo_preference_pairs_are_what_the_generator_makes_and_learnable():
    """Chosen answers the question asked, rejected a question of another kind: a rule the prompt's
    first words decide, so the tiny demo model learns it in 150 steps (reward accuracy past 0.8);
    a wrong answer of the right kind left it at 0.61."""
    rows = [json.loads(line) for line in DEMO_PREFERENCES.read_text().splitlines()]
    assert rows == make_preference_rows(1000, 2)
    for row in rows:
        (asked,) = [kind for start, kind in PROMPT_KINDS.items() if row["prompt"].startswith(start)]
        assert answer_kind(row["chosen"]) == asked, row
        assert answer_kind(row["rejected"]) != asked, row
    assert {answer_kind(row["rejected"]) for row in rows} == set(PROMPT_KINDS.values())


def test_the_demo_tokenizer_fills_the_tiny_llama_vocabulary(tokenizer):
    assert len(tokenizer) == BUILTIN_MODELS["tiny-llama"]["vocab_size"]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """The demo tokenizer (which has no chat template) saved with one."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(path)
    return path


def test_chat_template_rows_take_loss_on_the_assistant_turn_only(chat_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    prompt, response = "Which day comes after Monday?", "Tuesday"
    input_ids, labels = encode_example(tokenizer, prompt, response, "chat")
    user = [{"role": "user", "content": prompt}]
    prompt_text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    assert input_ids[:n] == prompt_ids
    assert labels[:n] == [IGNORE_INDEX] * n
    assert labels[n:] == input_ids[n:]
    assert tokenizer.decode(input_ids[n:], skip_special_tokens=True).strip() == response
    # The template's own BOS and EOS, each once: none added on top.
    assert input_ids.count(tokenizer.bos_token_id) == 1 and input_ids[0] == tokenizer.bos_token_id
    assert input_ids.count(tokenizer.eos_token_id) == 1 and tokenizer.eos_token_id in input_ids[n:]


def test_dpo_pairs_from_an_s3_prefix_with_the_chat_template_encode_both_responses_as_sft(
    s3, tmp_path, chat_tokenizer_dir
):
    """Preference rows take the SFT path for each response: the same sources (here a moto S3
    prefix), the same chat template with the loss on the assistant turn only."""
    client, bucket = s3
    rows = [json.loads(line) for line in DEMO_PREFERENCES.read_text().splitlines()[:40]]
    client.put_object(Bucket=bucket, Key="prefs/a.jsonl",
                      Body="".join(json.dumps(row) + "\n" for row in rows).encode())
    config = load_config(None, {"method": "dpo", "dataset": f"s3://{bucket}/prefs/",
                                "prompt_template": "chat", "tokenizer": str(chat_tokenizer_dir),
                                "output_dir": str(tmp_path)})
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    splits = build_splits(config)
    assert len(splits.train) + len(splits.eval) == len(rows)
    expected = []
    for row in rows:
        chosen = encode_example(tokenizer, row["prompt"], row["chosen"], "chat")
        rejected = encode_example(tokenizer, row["prompt"], row["rejected"], "chat")
        expected.append((*chosen, *rejected))
    for row in splits.train:
        pair = (row["input_ids"], row["labels"], row[REJECTED_IDS], row[REJECTED_LABELS])
        assert pair in expected
        n = pair[1].count(IGNORE_INDEX)  # the prompt, template included, takes no loss
        assert pair[0][:n] == pair[2][:n] and pair[3][:n] == [IGNORE_INDEX] * n
        assert tokenizer.decode(pair[2][n:], skip_special_tokens=True).strip() in {
            r["rejected"] for r in rows}


def test_prompt_template_chat_tokenizes_every_row_with_the_chat_template(
    tmp_path, chat_tokenizer_dir
):
    path = write_jsonl(tmp_path / "d.jsonl", demo_rows(30))
    config = load_config(
        None,
        {"dataset": str(path), "prompt_template": "chat", "tokenizer": str(chat_tokenizer_dir)},
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    splits = build_splits(config)
    expected = [
        encode_example(tokenizer, row["prompt"], row["response"], "chat")
        for row in demo_rows(30)
    ]
    actual = [(row["input_ids"], row["labels"]) for row in (*splits.train, *splits.eval)]
    assert sorted(actual) == sorted(expected)


def test_prompt_template_chat_without_a_chat_template_fails_at_start_naming_both(
    tmp_path, tokenizer
):
    # The data set does not exist: the template is checked before any data is read. (The demo
    # tokenizer has a chat template: a copy without it.)
    plain = without_chat_template(tmp_path / "plain")
    config = load_config(
        None, {"dataset": str(tmp_path / "missing.jsonl"), "prompt_template": "chat",
               "tokenizer": str(plain)}
    )
    expected = f"prompt_template=chat.*tokenizer {re.escape(config.tokenizer)} has no chat"
    with pytest.raises(ValueError, match=expected):
        build_splits(config)


def tokenized_examples(tokenizer, pairs, seq_len=128) -> datasets.Dataset:
    encoded = [encode_example(tokenizer, p, r) for p, r in pairs]
    return datasets.Dataset.from_dict(
        {"input_ids": [ids for ids, _ in encoded], "labels": [labels for _, labels in encoded]}
    )


PAIRS = [
    ("Write in capitals: owl", "OWL"),
    ("Reverse the list: a b c", "c b a"),
    ("Which day comes after Monday?", "Tuesday"),
    ("Repeat cat 4 times.", "cat cat cat cat"),
    ("Write in capitals: sun and moon", "SUN AND MOON"),
]


def test_packing_concatenates_whole_examples_in_order_with_positions_restarting(tokenizer):
    examples = tokenized_examples(tokenizer, PAIRS)
    seq_len = 48
    packed = pack(examples, seq_len)
    assert len(packed) < len(examples)
    recovered_ids, recovered_labels = [], []
    for row in packed:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) <= seq_len
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        for start, end in zip(starts, [*starts[1:], len(row["input_ids"])]):
            assert row["position_ids"][start:end] == list(range(end - start))
            recovered_ids.append(row["input_ids"][start:end])
            recovered_labels.append(row["labels"][start:end])
    assert recovered_ids == examples["input_ids"]
    # An example's first token is not predicted from the one before it.
    for labels, original in zip(recovered_labels, examples["labels"]):
        assert labels == [IGNORE_INDEX, *original[1:]]


def test_packed_batches_are_seq_len_long_and_their_padding_is_a_document_of_its_own(tokenizer):
    packed = pack(tokenized_examples(tokenizer, PAIRS), 48)
    drawn = ResumableSampler(len(packed), 2, 0, 1, seed=0).next_indices()
    sampler = ResumableSampler(len(packed), 2, 0, 1, seed=0)
    batch = next(TrainBatches(packed, sampler, tokenizer.pad_token_id, pad_to=48))
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, 48)
    for i, row in enumerate(packed.select(drawn)):
        n = len(row["input_ids"])
        assert (batch.labels[i, n:] == IGNORE_INDEX).all()
        assert batch.position_ids[i, n:].tolist() == list(range(48 - n))
    assert set(batch.model_inputs()) == {"input_ids", "position_ids"}
    evals = list(EvalBatches(packed, 4, 1, 4, tokenizer.pad_token_id, pad_to=48))
    assert all(b.input_ids.shape[1] == 48 and b.position_ids is not None for b in evals)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_document_in_a_packed_row_has_the_logits_it_has_alone(tokenizer, attention):
    examples = tokenized_examples(tokenizer, PAIRS[:3])
    packed = pack(examples, 64)
    assert len(packed) == 1  # all three in one row, then padding
    torch.manual_seed(0)
    config = builtin_config("tiny-llama", tokenizer)
    config._attn_implementation = attention
    model = LlamaForCausalLM(config).eval()
    batch = collate([packed[0]], tokenizer.pad_token_id, pad_to=64)
    with torch.no_grad():
        logits = model(**batch.model_inputs(), use_cache=False).logits[0]
        unmasked = model(input_ids=batch.input_ids, use_cache=False).logits[0]
        start = 0
        for i, ids in enumerate(examples["input_ids"]):
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            inside = slice(start, start + len(ids))
            torch.testing.assert_close(logits[inside], alone, rtol=1e-5, atol=1e-5)
            if i > 0:  # the check has teeth: attending across documents changes the logits
                assert not torch.allclose(unmasked[inside], alone, rtol=1e-3, atol=1e-3)
            start += len(ids)


def labelled_tokens(ds: datasets.Dataset) -> int:
    return sum(sum(label != IGNORE_INDEX for label in labels[1:]) for labels in ds["labels"])


def test_packing_keeps_every_labelled_token_and_the_same_split_on_every_run(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", demo_rows(200))
    plain = build_splits(load_config(None, {"dataset": str(path)}))
    config = load_config(None, {"dataset": str(path), "packing": True, "seq_len": 128})
    packed, again = build_splits(config), build_splits(config)
    assert len(packed.train) < len(plain.train) / 2
    assert labelled_tokens(packed.train) == labelled_tokens(plain.train)
    assert labelled_tokens(packed.eval) == labelled_tokens(plain.eval)
    assert packed.train["input_ids"] == again.train["input_ids"]
    assert packed.train["position_ids"] == again.train["position_ids"]


def test_a_packed_run_resumed_mid_epoch_reproduces_the_uninterrupted_losses(world_of_one, tmp_path):
    # 80 examples pack into 13 rows: 6 micro batches of 2 per epoch, so the checkpoint at step 2
    # (4 micro batches) is mid-epoch and steps 3-4 cross into the next epoch.
    values = {
        "dataset": str(write_jsonl(tmp_path / "d.jsonl", demo_rows(80))),
        "packing": True,
        "micro_batch": 2,
        "grad_accum": 2,
        "max_steps": 4,
        "warmup_steps": 1,
        "eval_interval": 0,
        "checkpoint_interval": 2,
    }

    def run(name: str) -> dict:
        config = load_config(None, {**values, "output_dir": str(tmp_path / name)})
        return train(config, world_of_one, started=0)

    assert 4 < run("full")["train_rows"] // 2 < 8  # micro batches per epoch
    checkpoint = Path("checkpoints") / "step_00000002"
    shutil.copytree(tmp_path / "full" / checkpoint, tmp_path / "resumed" / checkpoint)
    run("resumed")

    def losses(run: str) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / run) if r["type"] == "train"}

    resumed, uninterrupted = losses("resumed"), losses("full")
    assert resumed.keys() == {3, 4}
    assert resumed == pytest.approx({s: uninterrupted[s] for s in (3, 4)}, rel=1e-5)


def test_the_demo_assets_the_contract_names_are_the_trainers_and_exist():
    """The Airflow side (prepare_data's tokenizer, the form's defaults) and the trainer find the
    demo assets by the contract's paths, relative to the repository's root."""
    from finetune_contract import fields
    from trainer import demo

    root = Path(__file__).resolve().parents[2]
    for name in ("DEMO_DATASET", "DEMO_PREFERENCES", "DEMO_TOKENIZER"):
        assert getattr(demo, name) == root / getattr(fields, name), name
        assert (root / getattr(fields, name)).exists(), name
    assert (root / fields.DEMO_TOKENIZER / "tokenizer.json").is_file()
