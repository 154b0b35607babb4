"""Mixtures prepared and trained: each source's training examples drawn by weight or rows (the
proportions within a row of the weights), the same rows for the same seed, each source's own
held-out split labelled with it, every source and weight in the key, each source counted apart,
preference pairs mixed the same way, and the trainer's eval loss per source."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
from finetune_data import prepared_set as prep
from finetune_data.mixing import SOURCE_COLUMN

from tests.support.training import demo_rows, read_metrics, write_jsonl
from trainer.config import load_config
from trainer.data import build_splits
from trainer.demo import DEMO_CONVERSATIONS, DEMO_PREFERENCES
from trainer.train import train


def conversations(n: int) -> list[dict]:
    return [json.loads(line) for line in DEMO_CONVERSATIONS.read_text().splitlines()[:n]]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three data sets of three shapes: instructions, conversations, plain text."""
    root = tmp_path_factory.mktemp("sources")
    return {
        "instructions": write_jsonl(root / "instructions.jsonl", demo_rows(1200)),
        "chats": write_jsonl(root / "chats.jsonl", conversations(600)),
        "notes": write_jsonl(root / "notes.jsonl", [{"note": row["response"]}
                                                    for row in demo_rows(900)]),
    }


def mixture_config(out: Path, mixture: list[dict], **changes):
    return load_config(None, {"mixture": json.dumps(mixture), "output_dir": str(out),
                              **changes})


def three(sources: dict[str, Path], weights=(1, 2, 3)) -> list[dict]:
    return [{"dataset": str(sources["instructions"]), "weight": weights[0]},
            {"dataset": str(sources["chats"]), "weight": weights[1], "name": "chats"},
            {"dataset": str(sources["notes"]), "text_field": "note", "weight": weights[2]}]


def test_weights_give_their_shares_and_the_seed_the_rows(tmp_path, sources):
    config = mixture_config(tmp_path, three(sources))
    stats = prep.prepare(config, tmp_path / "a", num_proc=1)
    by_name = {s["name"]: s for s in stats["sources"]}
    assert list(by_name) == ["instructions", "chats", "notes"]
    assert [by_name[n]["row_format"] for n in by_name] == \
        ["prompt and response", "conversations", "text"]
    train, held_out, _ = prep.load_prepared(stats["path"])
    drawn = Counter(train[SOURCE_COLUMN])
    total = sum(drawn.values())
    # 1 : 2 : 3 of the training examples, to a row; the source that runs out first (chats: 570
    # training rows for a share of 2/6) is drawn whole and bounds the others; none repeated.
    for index, weight in enumerate((1, 2, 3)):
        assert abs(drawn[index] / total - weight / 6) < 1 / total + 1e-9, drawn
    assert drawn[1] == by_name["chats"]["train_rows_available"] == 570
    assert [by_name[n]["train_examples"] for n in by_name] == [drawn[0], drawn[1], drawn[2]]
    assert not any(s["repeated"] for s in stats["sources"])
    # each source's held-out split is its own, eval_fraction of its rows, labelled with it
    assert Counter(held_out[SOURCE_COLUMN]) == {0: 60, 1: 30, 2: 45}
    assert [by_name[n]["eval_examples"] for n in by_name] == [60, 30, 45]
    # the same seed, the same rows in the same order; another seed, others
    again = prep.prepare(config, tmp_path / "b", num_proc=2)
    assert again["key"] == stats["key"]
    assert prep.load_prepared(again["path"])[0]["input_ids"] == train["input_ids"]
    other = prep.prepare(dataclasses.replace(config, seed=7), tmp_path / "c", num_proc=1)
    assert prep.load_prepared(other["path"])[0]["input_ids"] != train["input_ids"]


@pytest.mark.slow  # a mixture prepared over many seeds
def test_a_mixtures_proportions_hold_within_sampling_error_over_seeds(tmp_path, sources):
    """The rows drawn change with the seed; the share of each source in any run's training
    split does not, and any contiguous stretch of the shuffled split is a fair sample."""
    for seed in (1, 2, 3):
        config = mixture_config(tmp_path, three(sources, (1, 1, 2)), seed=seed)
        train = prep.load_prepared(prep.prepare(config, tmp_path / str(seed), num_proc=1)
                                   ["path"])[0]
        window = Counter(train[SOURCE_COLUMN][:400])  # the first 400 of the shuffled rows
        for index, share in enumerate((0.25, 0.25, 0.5)):
            # binomial sampling error of 400 draws: 3 standard deviations
            assert abs(window[index] / 400 - share) < 3 * (share * (1 - share) / 400) ** 0.5


def test_rows_give_exactly_that_many_examples_repeating_a_small_source(tmp_path, sources):
    unique = write_jsonl(tmp_path / "unique.jsonl", [
        {"prompt": f"Count to {i}", "response": f"{i}"} for i in range(100)])
    mixture = [{"dataset": str(sources["instructions"]), "rows": 500},
               {"dataset": str(unique), "rows": 250}]
    stats = prep.prepare(mixture_config(tmp_path, mixture), tmp_path / "p", num_proc=1)
    train = prep.load_prepared(stats["path"])[0]
    assert Counter(train[SOURCE_COLUMN]) == {0: 500, 1: 250}
    small = stats["sources"][1]
    assert small["repeated"] and small["train_rows_available"] == 92  # 8 held out
    # each of its 92 training rows drawn twice or three times: full passes, then part of one
    times = Counter(tuple(ids) for ids, source in zip(train["input_ids"], train[SOURCE_COLUMN])
                    if source)
    assert len(times) == 92 and set(times.values()) == {2, 3} and sum(times.values()) == 250


def test_the_key_covers_every_source_its_fields_and_its_weight(tmp_path, sources):
    config = mixture_config(tmp_path, three(sources))
    root = tmp_path / "prepared"
    first = prep.prepare(config, root, num_proc=1)
    assert prep.prepare(config, root)["cache_hit"]
    changed = [three(sources, (1, 2, 4)),
               [{**s, "name": "other"} if i == 1 else s for i, s in enumerate(three(sources))],
               three(sources)[:2]]
    keys = {prep.prepare(mixture_config(tmp_path, mixture), root, num_proc=1)["key"]
            for mixture in changed}
    assert first["key"] not in keys and len(keys) == 3
    write_jsonl(sources["notes"], [{"note": row["response"]} for row in demo_rows(901)])
    assert not prep.prepare(config, root, num_proc=1)["cache_hit"]


def test_each_source_is_counted_apart_and_a_source_that_fails_is_named(tmp_path, sources):
    bad = write_jsonl(tmp_path / "bad.jsonl", [*demo_rows(95), {"prompt": "p"},
                                               *[{"prompt": "q", "response": " "}] * 4])
    mixture = [{"dataset": str(sources["instructions"])}, {"dataset": str(bad)}]
    stats = prep.prepare(mixture_config(tmp_path, mixture), tmp_path / "p", num_proc=1)
    counted = {s["name"]: (s["rows_read"], s["rows_kept"], s["skipped_rows_by_reason"])
               for s in stats["sources"]}
    assert counted == {"instructions": (1200, 1200, {}),
                       "bad": (100, 95, {"missing_field": 1, "empty": 4})}
    assert stats["skipped_rows_by_reason"] == {"missing_field": 1, "empty": 4}
    with pytest.raises(ValueError, match=rf"mixture\[1\] \(bad\): .*{bad} line 96") as err:
        prep.prepare(mixture_config(tmp_path, mixture, bad_rows="error"), tmp_path / "e")
    assert err.value.field == "mixture[1].dataset"
    few = write_jsonl(tmp_path / "few.jsonl", demo_rows(8))
    with pytest.raises(ValueError, match=r"mixture\[1\] \(few\): dataset .* has 8 usable rows"):
        prep.prepare(mixture_config(tmp_path, [mixture[0], {"dataset": str(few)}]),
                     tmp_path / "f")


def test_a_source_of_the_other_method_fails_the_prepare_naming_it(tmp_path, sources):
    """What validate cannot read (an s3:// or hub source) prepare_data refuses in its words."""
    mixture = [{"dataset": str(sources["instructions"])}, {"dataset": str(DEMO_PREFERENCES)}]
    with pytest.raises(ValueError, match=r"mixture\[1\] \(preferences\): dataset .* holds "
                       "preference pairs") as err:
        prep.prepare(mixture_config(tmp_path, mixture), tmp_path / "p", num_proc=1)
    assert err.value.field == "mixture[1].dataset"
    assert not list((tmp_path / "p").glob("*"))  # nothing half-written is left


def test_packed_mixtures_pack_the_held_out_split_per_source(tmp_path, sources):
    config = mixture_config(tmp_path, three(sources), packing=True)
    stats = prep.prepare(config, tmp_path / "p", num_proc=1)
    splits = build_splits(dataclasses.replace(config, prepared_data=stats["path"]))
    assert SOURCE_COLUMN not in splits.train.column_names  # packed rows mix the sources
    unpacked = build_splits(dataclasses.replace(config, prepared_data=stats["path"]),
                            unpacked_eval=True)
    for name, rows in splits.eval_by_source().items():
        examples = unpacked.eval_by_source()[name]
        assert len(rows) < len(examples)
        assert sum(label != -100 for row in rows["labels"] for label in row) <= \
            sum(label != -100 for row in examples["labels"] for label in row)


def test_preference_pairs_mix_the_same_way(tmp_path):
    pairs = [json.loads(line) for line in DEMO_PREFERENCES.read_text().splitlines()]
    ours = write_jsonl(tmp_path / "ours.jsonl", [{"question": p["prompt"], "good": p["chosen"],
                                                  "bad": p["rejected"]} for p in pairs[:300]])
    public = write_jsonl(tmp_path / "public.jsonl", pairs[300:])
    mixture = [{"dataset": str(ours), "prompt_field": "question", "chosen_field": "good",
                "rejected_field": "bad", "weight": 1},
               {"dataset": str(public), "weight": 1}]
    stats = prep.prepare(mixture_config(tmp_path, mixture, method="dpo"), tmp_path / "p")
    train, held_out, _ = prep.load_prepared(stats["path"])
    assert Counter(train[SOURCE_COLUMN]) == {0: 285, 1: 285}
    assert prep.REJECTED_IDS in train.column_names
    assert prep.REJECTED_IDS not in held_out.column_names  # the chosen responses' loss
    assert {s["row_format"] for s in stats["sources"]} == {"preference pairs"}


@pytest.mark.slow  # a 3-step training in this process
def test_the_trainer_measures_the_eval_loss_per_source_and_of_the_whole(world_of_one, tmp_path,
                                                                        sources):
    mixture = three(sources)[:2]
    config = mixture_config(tmp_path / "run", mixture, max_steps=3, eval_interval=2,
                            micro_batch=4, warmup_steps=1)
    summary = train(config, world_of_one, started=0)
    evals = [r for r in read_metrics(tmp_path / "run") if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert all(set(r["eval_loss_by_source"]) == {"instructions", "chats"} for r in evals)
    assert summary["initial_eval_loss_by_source"] == evals[0]["eval_loss_by_source"]
    assert summary["final_eval_loss_by_source"] == evals[-1]["eval_loss_by_source"]
    # The whole is the sources' token-weighted mean: between the two.
    for record in evals:
        losses = record["eval_loss_by_source"].values()
        assert min(losses) - 1e-6 <= record["eval_loss"] <= max(losses) + 1e-6
