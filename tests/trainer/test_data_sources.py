"""Where data sets come from: files, directories, S3 (a real moto server) and the hub."""

import json

import datasets
import pandas as pd
import pytest
from finetune_data.prepared_set import S3_CACHE_DIR, download_s3
from transformers import AutoTokenizer

from tests.support.training import demo_rows, write_jsonl
from trainer.config import dataset_source, load_config
from trainer.data import build_splits
from trainer.demo import DEMO_TOKENIZER


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def jsonl_bytes(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def usable_rows(config, tokenizer) -> int:
    splits = build_splits(config)
    return len(splits.train) + len(splits.eval)


@pytest.mark.parametrize(
    ("dataset", "source"),
    [
        ("s3://bucket/data/rows.jsonl", "s3"),
        ("s3://bucket/data/", "s3"),
        ("tatsu-lab/alpaca", "hub"),
        ("imdb", "hub"),
        ("data/rows.jsonl", "local"),  # a missing file is reported missing, not sent to the hub
        ("/no/such/dir", "local"),
        ("./alpaca", "local"),
    ],
)
def test_a_data_set_name_is_read_as_s3_a_local_path_or_a_hub_name(dataset, source):
    assert dataset_source(dataset) == source


def test_an_existing_directory_is_local_even_when_shaped_like_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert dataset_source("org/name") == "local"
    assert load_config(None, {"dataset": "org/name"}).dataset == str(tmp_path / "org" / "name")


def test_a_hub_name_is_loaded_with_the_configured_split(monkeypatch, tmp_path, tokenizer):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(demo_rows(30))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    config = load_config(None, {"dataset": "org/name", "dataset_split": "train[:90%]"})
    assert config.dataset == "org/name"  # not made into a path of the working dir
    assert usable_rows(config, tokenizer) == 30
    assert calls == [(("org/name",), {"split": "train[:90%]"})]


def test_an_unknown_hub_name_says_it_was_looked_up_on_the_hub(tokenizer):
    config = load_config(None, {"dataset": "nobody-here/no-such-data"})
    with pytest.raises(ValueError, match="'nobody-here/no-such-data' is no local file or dir"):
        build_splits(config)


def test_a_directory_loads_its_data_files_and_skips_hidden_and_underscore_files(
    tmp_path, tokenizer
):
    rows = demo_rows(50)
    write_jsonl(tmp_path / "a.jsonl", rows[:20])
    (tmp_path / "part").mkdir()
    write_jsonl(tmp_path / "part" / "b.jsonl", rows[20:30])
    write_jsonl(tmp_path / ".c.jsonl", rows[30:40])  # e.g. a partial download
    write_jsonl(tmp_path / "_d.jsonl", rows[40:50])  # e.g. a writer's metadata
    (tmp_path / "README.md").write_text("# not data\n")
    assert usable_rows(load_config(None, {"dataset": str(tmp_path)}), tokenizer) == 30


def test_a_directory_of_mixed_formats_needs_dataset_format(tmp_path, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", demo_rows(20))
    pd.DataFrame(demo_rows(30)).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(ValueError, match="formats csv, json.*dataset_format"):
        build_splits(load_config(None, {"dataset": str(tmp_path)}))
    config = load_config(None, {"dataset": str(tmp_path), "dataset_format": "csv"})
    assert usable_rows(config, tokenizer) == 30


def test_an_s3_object_is_downloaded_under_output_dir_and_loaded(s3, tmp_path, tokenizer):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="sets/rows.jsonl", Body=jsonl_bytes(demo_rows(30)))
    uri = f"s3://{bucket}/sets/rows.jsonl"
    config = load_config(None, {"dataset": uri, "output_dir": str(tmp_path)})
    assert config.dataset == uri
    assert usable_rows(config, tokenizer) == 30
    assert (tmp_path / S3_CACHE_DIR / bucket / "sets" / "rows.jsonl").is_file()


def test_an_s3_prefix_is_loaded_as_a_directory_of_data_files(s3, tmp_path, tokenizer):
    client, bucket = s3
    rows = demo_rows(60)
    client.put_object(Bucket=bucket, Key="sets/a.jsonl", Body=jsonl_bytes(rows[:20]))
    client.put_object(Bucket=bucket, Key="sets/more/b.jsonl", Body=jsonl_bytes(rows[20:30]))
    client.put_object(Bucket=bucket, Key="sets/_SUCCESS", Body=b"")
    # Shares the prefix "sets" but not "sets/": not part of the data set.
    client.put_object(Bucket=bucket, Key="sets-old/c.jsonl", Body=jsonl_bytes(rows[30:60]))
    config = load_config(None, {"dataset": f"s3://{bucket}/sets", "output_dir": str(tmp_path)})
    assert usable_rows(config, tokenizer) == 30


def test_a_downloaded_s3_object_is_reused_until_it_changes(s3, tmp_path):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="rows.jsonl", Body=jsonl_bytes(demo_rows(10)))
    uri = f"s3://{bucket}/rows.jsonl"
    first = download_s3(uri, tmp_path)
    inode = first.stat().st_ino
    assert download_s3(uri, tmp_path).stat().st_ino == inode  # not fetched again

    client.put_object(Bucket=bucket, Key="rows.jsonl", Body=jsonl_bytes(demo_rows(12)))
    again = download_s3(uri, tmp_path)
    assert again == first and again.read_bytes() == jsonl_bytes(demo_rows(12))
    assert [p.name for p in first.parent.iterdir()] == ["rows.jsonl"]  # no partial files left


def test_a_missing_s3_object_or_prefix_is_named(s3, tmp_path, tokenizer):
    _, bucket = s3
    uri = f"s3://{bucket}/nothing/here.jsonl"
    config = load_config(None, {"dataset": uri, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=f"dataset '{uri}': no object"):
        build_splits(config)
