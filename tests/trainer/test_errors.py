"""A failed training records its root cause: errors/rank_<N>.json in the output location, and
torchrun's error file (so its ChildFailedError names the exception, not only an exit code)."""

import json
import os
import subprocess
import sys

import pytest

from finetune_contract.errors import ERROR_DIR_ENV, MAX_MESSAGE_CHARS, RECORD_KEYS
from tests.support import REPO_ROOT
from tests.support.training import demo_rows, write_jsonl
from trainer.errors import read_root_cause, write_root_cause


@pytest.mark.slow
def test_a_training_that_fails_at_start_records_the_trainers_own_message(tmp_path):
    rows = demo_rows(8) + [{"response": "owl"}]  # the prompt field is missing
    dataset = write_jsonl(tmp_path / "rows.jsonl", rows)
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
        "-m", "trainer.train", "--dataset", str(dataset), "--output_dir", str(output_dir),
        "--bad_rows", "error",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )

    assert result.returncode != 0
    record = json.loads((output_dir / "errors" / "rank_0.json").read_text())
    assert set(record) == set(RECORD_KEYS)
    assert record["stage"] == "train" and record["type"] == "ValueError" and record["rank"] == 0
    assert f"bad row in dataset {dataset}: {dataset} line 9" in record["message"]
    assert "prompt_field='prompt' is missing" in record["message"]
    assert read_root_cause(str(output_dir)) == record
    # torchrun's failure summary carries the exception too, from the @record error file.
    assert "ChildFailedError" in result.stderr
    assert "prompt_field='prompt' is missing" in result.stderr.split("ChildFailedError")[-1]


def test_a_config_that_does_not_parse_is_recorded_in_the_error_dir_when_one_is_named(
    tmp_path, monkeypatch
):
    from trainer.train import main

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path / "errors-here"))
    with pytest.raises(ValueError, match="- micro_batch: must be a number"):
        main(["--micro_batch", "lots", "--output_dir", str(tmp_path / "run")])

    record = read_root_cause(str(tmp_path / "errors-here"))
    assert record is not None and record["type"] == "ContractError"
    assert "- micro_batch: must be a number, got 'lots'" in record["message"]
    assert not (tmp_path / "run").exists()

    monkeypatch.delenv(ERROR_DIR_ENV)
    with pytest.raises(ValueError, match="- micro_batch: must be a number"):
        main(["--micro_batch", "lots", "--output_dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_the_root_cause_is_the_earliest_record_and_a_torn_one_is_ignored(tmp_path):
    write_root_cause(str(tmp_path), RuntimeError("first: rank 3 ran out of memory"), 3)
    write_root_cause(str(tmp_path), RuntimeError("then: the collective timed out"), 0)
    (tmp_path / "errors" / "rank_1.json").write_text('{"stage": "tr')
    assert read_root_cause(str(tmp_path / "nothing")) is None

    cause = read_root_cause(str(tmp_path))

    assert cause is not None and cause["rank"] == 3
    assert cause["message"] == "first: rank 3 ran out of memory"


def test_an_s3_output_gets_the_record_uploaded_by_the_failing_rank(s3, tmp_path, monkeypatch):
    client, bucket = s3
    monkeypatch.setenv("FINETUNE_STAGING_DIR", str(tmp_path))
    output_dir = f"s3://{bucket}/runs/one"

    write_root_cause(output_dir, MemoryError("x" * (MAX_MESSAGE_CHARS + 500)), 5)

    body = client.get_object(Bucket=bucket, Key="runs/one/errors/rank_5.json")["Body"].read()
    record = json.loads(body)
    assert record["type"] == "MemoryError" and record["rank"] == 5
    assert record["message"] == "x" * MAX_MESSAGE_CHARS
    assert read_root_cause(output_dir) == record
