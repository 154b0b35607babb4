"""The prepare_data stage's work (finetune_data.prepared_set): encoded once, content-addressed,
reused, safe against a concurrent prepare and a failure; and the trainer's start that only
loads it."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from finetune_data import prepared_set as prep

from tests.support.training import demo_rows, write_jsonl
from trainer.config import load_config


def config_for(dataset: Path, out: Path, **changes):
    return load_config(None, {"dataset": str(dataset), "output_dir": str(out), **changes})


def split_bytes(path: str, split: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (Path(path) / split).glob("*.arrow")}


def sets_in(root: Path) -> list[str]:
    """Every entry of the prepared root: complete sets and anything half-written."""
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_second_identical_prepare_is_a_cache_hit_and_a_changed_source_is_not(tmp_path):
    rows = 2 * prep.ROWS_PER_PROCESS  # enough for two encoding processes
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(rows))
    config, root = config_for(data, tmp_path / "out"), tmp_path / "prepared"
    environ = os.environ
    first = prep.prepare(config, root, num_proc=2)
    # datasets' map with processes replaces os.environ; boto3's default session keeps the old
    # object and would lose the region a later test or stage sets (NoRegionError)
    assert os.environ is environ
    assert not first["cache_hit"] and first["rows_read"] == rows == first["rows_kept"]
    assert first["train_rows"] + first["eval_rows"] == rows
    assert first["tokens_per_epoch"] == first["tokens"]["train"] > 0
    assert sum(first["length_histogram"].values()) == rows
    written = {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")}
    said: list[str] = []
    second = prep.prepare(config, root, log=said.append)
    assert second["cache_hit"] and second["path"] == first["path"]
    assert "cache hit" in said[0] and "nothing encoded" in said[0]
    assert {p: p.stat().st_mtime_ns for p in Path(first["path"]).rglob("*")} == written
    # one process encodes as two did: the same set, byte for byte
    alone = prep.prepare(config, tmp_path / "one", num_proc=1)
    for split in (prep.TRAIN_SPLIT, prep.EVAL_SPLIT):
        assert split_bytes(alone["path"], split) == split_bytes(first["path"], split)
    # another seq_len, or a changed file: another key, prepared anew
    assert not prep.prepare(config_for(data, tmp_path / "out", seq_len=64), root)["cache_hit"]
    write_jsonl(data, demo_rows(rows + 1))
    changed = prep.prepare(config, root, num_proc=1)
    assert not changed["cache_hit"] and changed["rows_read"] == rows + 1
    assert len(sets_in(root)) == 3 and not [n for n in sets_in(root) if n.startswith(".")]


def test_two_runs_preparing_one_key_at_once_leave_one_whole_set(tmp_path):
    # Two preparers started together (threads: the race is the file system's, os.rename's):
    # both encode, the first rename wins, the other finds the set and reuses it.
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(2000))
    root, config = tmp_path / "prepared", config_for(data, tmp_path / "out")
    start = threading.Barrier(2)

    def run(_: int) -> dict:
        start.wait()
        return prep.prepare(config, root, num_proc=1)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, range(2)))
    assert results[0]["path"] == results[1]["path"] and sets_in(root) == [results[0]["key"]]
    paths = [results[0]["path"]]
    train, held_out, stats = prep.load_prepared(paths[0])
    assert len(train) + len(held_out) == 2000 == stats["rows_kept"]


def test_a_bad_row_with_bad_rows_error_names_file_and_line_and_leaves_no_set(tmp_path):
    rows = demo_rows(50)
    rows[36] = {"prompt": "word " * 400, "response": "x"}
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    root = tmp_path / "prepared"
    with pytest.raises(ValueError, match=r"rows.jsonl line 37: \d+ tokens, more than seq_len"):
        prep.prepare(config_for(data, tmp_path / "out", bad_rows="error"), root, num_proc=1)
    assert sets_in(root) == []


def test_a_tokenizer_failing_on_a_row_names_it_and_leaves_no_set(tmp_path, monkeypatch):
    import transformers

    rows = demo_rows(40)
    rows[9] = {"prompt": "BOOM", "response": "x"}
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    real = transformers.AutoTokenizer.from_pretrained

    def failing(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        call = type(tokenizer).__call__

        class Failing(type(tokenizer)):
            def __call__(self, text, *a, **k):
                if "BOOM" in text:
                    raise RuntimeError("cannot encode this")
                return call(self, text, *a, **k)

        tokenizer.__class__ = Failing
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", failing)
    root = tmp_path / "prepared"
    with pytest.raises(ValueError, match="rows.jsonl line 10: encoding failed: RuntimeError: "
                                         "cannot encode this"):
        prep.prepare(config_for(data, tmp_path / "out"), root, num_proc=1)
    assert sets_in(root) == []


def test_skipped_rows_are_counted_by_reason_with_the_longest_named(tmp_path):
    rows = demo_rows(100) + [{"prompt": "word " * (200 + i), "response": "x"} for i in range(3)]
    rows.append({"prompt": "no response"})
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    stats = prep.prepare(config_for(data, tmp_path / "out"), tmp_path / "prepared")
    assert stats["skipped_rows_by_reason"] == {"too_long": 3, "missing_field": 1}
    longest = stats["longest_skipped_rows"]
    assert longest[0]["where"].endswith("rows.jsonl line 103") and longest[0]["tokens"] > 200
    assert [row["tokens"] for row in longest[:3]] == sorted(
        [row["tokens"] for row in longest[:3]], reverse=True)


def test_the_trainer_loads_the_prepared_set_and_never_encodes(tmp_path, monkeypatch):
    import finetune_contract.data
    from trainer.data import build_splits

    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(200))
    stats = prep.prepare(config_for(data, tmp_path / "out", packing=True), tmp_path / "prep")

    def no_encoding(*args, **kwargs):
        raise AssertionError("the trainer encoded a row")

    for name in ("encode_row", "encode_pair", "encode_example"):
        monkeypatch.setattr(finetune_contract.data, name, no_encoding)
        monkeypatch.setattr(prep, name, no_encoding, raising=False)
    config = config_for(data, tmp_path / "out", packing=True, prepared_data=stats["path"])
    splits = build_splits(config)
    assert len(splits.train) == stats["train_rows"] and "position_ids" in splits.train.column_names
    unpacked = build_splits(config, unpacked_eval=True).eval
    assert len(unpacked) == stats["eval_examples"]
    assert json.loads((Path(stats["path"]) / prep.STATS_FILE).read_text())["key"] == stats["key"]


def test_the_eval_dataset_is_prepared_with_the_set_unpacked_and_is_in_its_key(tmp_path):
    rows = demo_rows(240)
    data = write_jsonl(tmp_path / "rows.jsonl", rows[:200])
    held = write_jsonl(tmp_path / "eval.jsonl", rows[200:230])
    config = config_for(data, tmp_path / "out", packing=True, eval_dataset=str(held))
    root = tmp_path / "prep"
    stats = prep.prepare(config, root, num_proc=1)
    assert stats["eval_dataset"]["rows_kept"] == 30 == stats["eval_dataset"]["rows_read"]
    evaluated = prep.load_eval_dataset(stats["path"])
    assert len(evaluated) == 30 and "position_ids" not in evaluated.column_names  # unpacked
    assert prep.prepare(config, root)["cache_hit"]
    # The eval data set changed, or is not asked for: another key, prepared anew.
    write_jsonl(held, rows[200:231])
    changed = prep.prepare(config, root, num_proc=1)
    assert not changed["cache_hit"] and changed["eval_dataset"]["rows_kept"] == 31
    without = prep.prepare(config_for(data, tmp_path / "out", packing=True), root, num_proc=1)
    assert not without["cache_hit"] and without["eval_dataset"] is None
    with pytest.raises(ValueError, match="holds no eval_dataset split"):
        prep.load_eval_dataset(without["path"])


def test_an_eval_dataset_without_usable_rows_fails_the_prepare_and_leaves_no_set(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", demo_rows(100))
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "no response"}] * 3)
    root = tmp_path / "prep"
    with pytest.raises(ValueError, match="eval_dataset .*eval.jsonl has no usable rows") as err:
        prep.prepare(config_for(data, tmp_path / "out", eval_dataset=str(held)), root)
    assert err.value.field == "eval_dataset"  # what the form shows it under
    assert sets_in(root) == []
    # A bad row the run fails on (bad_rows: error) is the eval_dataset's too, not the dataset's.
    with pytest.raises(ValueError, match="eval.jsonl") as err:
        prep.prepare(config_for(data, tmp_path / "out", eval_dataset=str(held),
                                bad_rows="error"), root)
    assert err.value.field == "eval_dataset" and sets_in(root) == []


def test_evaluate_measures_on_the_prepared_eval_sets_and_never_encodes(tmp_path, monkeypatch):
    import finetune_contract.data
    import trainer.data
    from trainer.evaluate import eval_rows

    rows = demo_rows(240)
    data = write_jsonl(tmp_path / "rows.jsonl", rows[:200])
    held = write_jsonl(tmp_path / "eval.jsonl", rows[200:230])
    config = config_for(data, tmp_path / "out", packing=True, eval_dataset=str(held))
    stats = prep.prepare(config, tmp_path / "prep", num_proc=1)

    def no_encoding(*args, **kwargs):
        raise AssertionError("evaluate encoded a row")

    for name in ("encode_row", "encode_pair", "encode_example"):
        monkeypatch.setattr(finetune_contract.data, name, no_encoding)
    for name in ("encode_row", "encode_pair", "tokenize", "load_rows", "prepare"):
        monkeypatch.setattr(prep, name, no_encoding)
    monkeypatch.setattr(trainer.data, "prepare", no_encoding)
    prepared = config_for(data, tmp_path / "out", packing=True, eval_dataset=str(held),
                          prepared_data=stats["path"])
    measured = eval_rows(prepared)
    assert measured["input_ids"] == prep.load_eval_dataset(stats["path"])["input_ids"]
    assert len(measured) == 30
    # without eval_dataset: the held-out split's examples, unpacked
    plain = prep.load_prepared(stats["path"], unpacked_eval=True)[1]
    held_out = eval_rows(dataclasses.replace(prepared, eval_dataset=None))
    assert len(held_out) == stats["eval_examples"] == len(plain)


# The data set's encoding (finetune_data.prepared_set and the contract's encode functions), and a
# tokenizer's own encoding calls: only these modules may reach them. The stage itself (on the
# worker and in its pod), validate's sample of rows, the benchmark, and the trainer started by
# hand without a prepared set (trainer.data, with the stage's own function). Nothing that runs
# after prepare_data (the trainer's start, evaluate, the report) is here.
ENCODING_NAMES = {"encode_row", "encode_pair", "encode_example", "encode_conversation",
                  "chat_turns", "tokenize", "load_rows", "prepare", "prepare_to_s3"}
TOKENIZER_CALLS = {"encode", "encode_plus", "batch_encode_plus", "apply_chat_template"}
MAY_ENCODE = {"finetune.prepare_stage", "finetune.validate", "bench.prepare_data",
              "trainer.prepare_data", "trainer.data"}
ENCODING_MODULES = {"finetune_data.prepared_set", "finetune_data", "finetune_contract.data",
                    "finetune_contract"}


def modules_that_encode(sources: dict[str, str]) -> set[str]:
    """The modules (name -> source) that import or call an encoding name, or call a
    tokenizer's encoding (`tokenizer(...)`, `tokenizer.encode(...)`)."""
    import ast

    found = set()
    for name, source in sources.items():
        tree = ast.parse(source)
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ENCODING_MODULES:
                names = {a.name for a in node.names}
                if names & ENCODING_NAMES:
                    found.add(name)
                aliases |= {a.asname or a.name for a in node.names
                            if f"{node.module}.{a.name}" in ENCODING_MODULES}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names
                            if a.name in ENCODING_MODULES and a.asname}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and node.attr in ENCODING_NAMES:
                found.add(name)
            if isinstance(node, ast.Call):
                func = node.func
                # a tokenizer object called (not a class, not a function that makes one)
                if isinstance(func, ast.Name) and (func.id == "tokenizer" or (
                        func.id.endswith("_tokenizer")
                        and not func.id.startswith(("save_", "train_", "load_", "make_")))):
                    found.add(name)
                if isinstance(func, ast.Attribute) and func.attr in TOKENIZER_CALLS and \
                        "tokenizer" in ast.unparse(func.value).lower():
                    found.add(name)
    return found


def test_no_stage_after_prepare_data_and_no_trainer_module_encodes_the_data():
    from tests.support import REPO_ROOT

    sources = {}
    for root, tree in ((REPO_ROOT / "plugins", REPO_ROOT / "plugins" / "finetune"),
                       (REPO_ROOT, REPO_ROOT / "trainer"), (REPO_ROOT, REPO_ROOT / "bench")):
        for path in tree.rglob("*.py"):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            sources[module.removesuffix(".__init__")] = path.read_text()
    assert modules_that_encode(sources) == MAY_ENCODE


def test_the_encoding_scan_finds_a_module_that_encodes():
    assert modules_that_encode({
        "a": "from finetune_data.prepared_set import tokenize\n",
        "b": "from finetune_contract import data as d\nd.encode_row(t, c, r)\n",
        "c": "def f(tokenizer):\n    return tokenizer('text')['input_ids']\n",
        "c2": "def f(champion_tokenizer):\n    return champion_tokenizer('text')\n",
        "d": "def f(self):\n    return self.tokenizer.apply_chat_template([])\n",
        "e": "import finetune_data.prepared_set as p\np.prepare(c, r)\n",
        "clean": "from finetune_data.prepared_set import load_prepared\n",
        "clean2": "t = Tokenizer(m)\nsave_tokenizer(t, out)\n",
    }) == {"a", "b", "c", "c2", "d", "e"}
