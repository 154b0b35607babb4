"""validate refuses, naming the field, what a later stage would refuse: by class, each with a
case that used to pass validate and fail only after the stages that cost money."""

from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError
from finetune.validate import validate_params
from tests.support.chat_tokenizers import without_chat_template

DEMO_TOKENIZER = "trainer/demo/tokenizer"


def refused(conf: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        validate_params({"procs_per_node": 1, **conf}, run_id="manual__r")
    return err.value.errors


def named(errors: list[tuple[str, str]], field: str, words: str) -> bool:
    return any(f == field and words in m for f, m in errors)


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


ROWS = [{"prompt": f"Repeat owl {i % 5 + 1} times.", "response": " ".join(["owl"] * (i % 5 + 1))}
        for i in range(60)]


# -- data the validate stage can see ---------------------------------------------------------

def test_a_field_the_data_set_does_not_have_is_named_with_the_columns_it_has(tmp_path):
    errors = refused({"dataset": jsonl(tmp_path / "d.jsonl", ROWS), "prompt_field": "promt"})
    assert named(errors, "prompt_field", "'promt' is not a column of"), errors
    assert named(errors, "prompt_field", "(columns: prompt, response)"), errors


def test_data_files_with_other_columns_are_refused(tmp_path):
    rows = [{"question": "q", "answer": "a"}] * 40
    errors = refused({"dataset": jsonl(tmp_path / "d.jsonl", rows)})
    assert named(errors, "prompt_field", "not a column") and named(errors, "response_field",
                                                                     "not a column"), errors


def test_chat_template_with_a_tokenizer_that_has_none_is_refused(tmp_path):
    plain = without_chat_template(tmp_path / "plain")  # the demo tokenizer has a template
    errors = refused({"dataset": jsonl(tmp_path / "d.jsonl", ROWS), "prompt_template": "chat",
                      "tokenizer": str(plain)})
    assert named(errors, "prompt_template", "has no chat template"), errors


def test_a_tokenizer_directory_without_tokenizer_files_is_refused(tmp_path):
    (tmp_path / "tok").mkdir()
    errors = refused({"tokenizer": str(tmp_path / "tok")})
    assert named(errors, "tokenizer", "has no tokenizer files"), errors


def test_a_data_directory_without_data_files_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "README.md").write_text("no data here")
    errors = refused({"dataset": str(tmp_path / "data")})
    assert named(errors, "dataset", "holds no data files"), errors


def test_a_json_file_holding_one_object_is_refused(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}))
    errors = refused({"dataset": str(path)})
    assert named(errors, "dataset", "holds a JSON dict"), errors


def test_rows_longer_than_seq_len_fail_validate_with_bad_rows_error_naming_the_line(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", ROWS)
    errors = refused({"dataset": path, "seq_len": 16, "bad_rows": "error"})
    assert named(errors, "dataset", f"{path} line 1: ") and named(errors, "dataset",
                                                                  "more than seq_len 16"), errors


def test_rows_all_too_long_with_bad_rows_skip_leave_too_few_rows(tmp_path):
    errors = refused({"dataset": jsonl(tmp_path / "d.jsonl", ROWS), "seq_len": 8})
    assert named(errors, "dataset", "0 usable rows") and named(errors, "dataset",
                                                               "60 bad rows skipped"), errors


def test_packing_that_leaves_too_few_sequences_for_a_step_is_refused(tmp_path):
    # 60 short rows pack into a few 1024-token sequences: fewer than micro_batch 4.
    errors = refused({"dataset": jsonl(tmp_path / "d.jsonl", ROWS), "seq_len": 1024,
                      "packing": True, "micro_batch": 4})
    assert named(errors, "micro_batch", "with packing"), errors


# -- parallelism: the trainer's rules, in validate ------------------------------------------

def test_tp_degree_must_divide_the_models_kv_heads():
    errors = refused({"procs_per_node": 4, "tp_degree": 4, "micro_batch": 1})
    assert named(errors, "tp_degree", "num_key_value_heads (2)"), errors


def test_hybrid_shard_group_is_checked_against_the_data_parallel_size_under_tp():
    errors = refused({"procs_per_node": 4, "tp_degree": 2, "strategy": "HYBRID_SHARD",
                      "shard_group_size": 4, "micro_batch": 1})
    assert named(errors, "shard_group_size", "data-parallel size (2"), errors


def test_tp_degree_with_cpu_offload_is_refused():
    errors = refused({"procs_per_node": 2, "tp_degree": 2, "cpu_offload": True})
    assert named(errors, "cpu_offload", "tp_degree"), errors


# -- URIs, paths, ports, names ----------------------------------------------------------------

EKS = {"target": "eks", "cluster_name": "c", "nodegroup": "gpu", "image": "r/trainer:1",
       "image_builder": "prebuilt", "procs_per_node": 8, "micro_batch": 1,
       "output_dir": "s3://bucket/runs"}


@pytest.mark.parametrize(("field", "value", "words"), [
    ("dataset", "s3:///data.jsonl", "needs a bucket"),
    ("dataset", "s3://bucket/", "give a key"),
    ("dataset", "s3://My_Bucket/data/", "not a valid S3 bucket name"),
    ("output_dir", "s3://", "needs a bucket"),
    ("output_dir", "s3://bucket", "give a key"),
    ("output_dir", "s3://ab/runs", "not a valid S3 bucket name"),
])  # fmt: skip
def test_malformed_s3_uris_are_refused_naming_the_field(field, value, words):
    errors = refused({**EKS, field: value})
    assert named(errors, field, words), errors


@pytest.mark.parametrize("field", ["output_dir", "dataset", "tokenizer", "model"])
def test_a_path_component_over_255_bytes_is_named_not_an_oserror(field):
    errors = refused({field: "/tmp/" + "x" * 300})
    assert any(f == field and "300 bytes" in m for f, m in errors), errors


def test_metrics_port_on_the_rendezvous_port_is_refused():
    errors = refused({**EKS, "rdzv_backend": "c10d", "metrics_port": 29400})
    assert named(errors, "metrics_port", "rendezvous port"), errors
    errors = refused({"rdzv_endpoint": "127.0.0.1:9100", "metrics_port": 9100})
    assert named(errors, "metrics_port", "rendezvous port"), errors


def test_an_ipv6_rendezvous_endpoint_is_accepted():
    cfg = validate_params({"procs_per_node": 1, "rdzv_endpoint": "[::1]:2379"}, run_id="r")
    assert cfg.rdzv_endpoint == "[::1]:2379"


@pytest.mark.parametrize("value", ["hf:bad key", "hf:", "Hf_Token", "hf_" + "a" * 40])
def test_a_bad_hf_token_secret_is_refused_without_echoing_it(value):
    errors = refused({**EKS, "hf_token_secret": value})
    messages = [m for f, m in errors if f == "hf_token_secret"]
    assert messages and all(value not in m for m in messages), errors


def test_a_node_group_name_that_is_no_kubernetes_label_value_is_refused():
    errors = refused({**EKS, "nodegroup": "gpu-"})
    assert named(errors, "nodegroup", "label value"), errors


def test_rendezvous_userinfo_and_prometheus_credentials_are_never_echoed():
    errors = refused({**EKS, "rdzv_endpoint": "admin:s3cret@etcd:2379",
                      "prometheus_url": "http://grafana:hunter2@prom:9090"})
    assert named(errors, "prometheus_url", "prometheus_conn_id"), errors
    assert named(errors, "rdzv_endpoint", "not host:port"), errors
    assert "s3cret" not in str(errors) and "hunter2" not in str(errors)


@pytest.mark.parametrize("url", ["http://prom:9090/api?access_token=hunter2",
                                 "https://prom/#token=hunter2", "http://prom:9090?hunter2"])
def test_a_prometheus_url_with_a_query_or_fragment_is_refused_unechoed(url):
    """A token in the query would be stored with the run, and the queries never send it."""
    errors = refused({**EKS, "prometheus_url": url})
    assert named(errors, "prometheus_url", "query or fragment"), errors
    assert named(errors, "prometheus_url", "prometheus_conn_id"), errors
    assert "hunter2" not in str(errors)


# -- how errors are reported ------------------------------------------------------------------

def test_an_unknown_key_does_not_hide_the_other_errors():
    errors = refused({"max_stepz": 10, "nodes": 0, "strategy": "ZERO3"})
    assert {f for f, _ in errors} >= {"max_stepz", "nodes", "strategy"}, errors


def test_a_long_value_is_cut_in_the_message():
    with pytest.raises(ConfigError) as err:
        validate_params({"strategy": "Z" * 10_000}, run_id="r")
    assert len(str(err.value)) < 500 and "characters" in str(err.value)


def test_the_form_says_what_happens_to_examples_longer_than_seq_len():
    from finetune_contract.parameters import BY_NAME as SPECS_BY_NAME

    description = SPECS_BY_NAME["seq_len"].description
    assert "never truncated" in description and "bad_rows" in description


PAIRS = [{"prompt": f"Repeat owl {i % 5 + 1} times.", "chosen": " ".join(["owl"] * (i % 5 + 1)),
          "rejected": "owl"} for i in range(60)]


def test_dpo_needs_the_chosen_and_rejected_columns_named_with_the_columns_it_has(tmp_path):
    errors = refused({"method": "dpo", "dataset": jsonl(tmp_path / "d.jsonl", ROWS)})
    assert named(errors, "chosen_field", "'chosen' is not a column of"), errors
    assert named(errors, "rejected_field", "(columns: prompt, response)"), errors


def test_dpo_pairs_whose_rejected_response_is_too_long_fail_with_bad_rows_error(tmp_path):
    rows = [{**row, "rejected": "owl " * 200} for row in PAIRS]
    errors = refused({"method": "dpo", "dataset": jsonl(tmp_path / "d.jsonl", rows),
                      "bad_rows": "error", "seq_len": 64})
    assert any("rejected_field" in m and "more than seq_len" in m for _, m in errors), errors
