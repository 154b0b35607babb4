"""A notice before the round's first step (SIGTERM while the model loads) through trainer.launch:
nothing was trained to save, the node exits 138 and records the notice in the run directory (a
path or S3), so the run's history counts it as a preemption, not as a restart without one."""

import json
import os
import subprocess
import sys

import pytest

from finetune.outputs import run_history
from finetune.report.run_files import load_history
from finetune_contract.errors import ERROR_DIR_ENV, NODE_NAME_ENV
from finetune_contract.run_history import PREEMPTED_EXIT_CODE, preemptions
from tests.support import REPO_ROOT
from trainer.launch import record_startup_notice, trainer_output_dir, write_startup_notice

TRAINER_ARGS = ["--max_steps", "2", "--seq_len", "64", "--micro_batch", "4"]


def launched(output_dir, when: str) -> subprocess.CompletedProcess:
    """trainer.launch (torchrun) of the trainer, its node noticed `when` (launched_notice_worker);
    as on eks, no FINETUNE_ERROR_DIR."""
    env = {k: v for k, v in os.environ.items() if k != ERROR_DIR_ENV}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", NOTICE_WHEN=when,
               **{NODE_NAME_ENV: "1 (test-host)"})
    command = [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc-per-node=1",
               "tests/trainer/launched_notice_worker.py", "--output_dir", str(output_dir),
               *TRAINER_ARGS]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # a trainer started under torchrun, noticed once loaded
def test_a_notice_while_the_model_loads_is_recorded_by_its_node_and_counted_as_a_preemption(
        tmp_path):
    output_dir = tmp_path / "run"
    result = launched(output_dir, "load")
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == PREEMPTED_EXIT_CODE, output
    assert "a notice came before the first step" in result.stderr, output

    [path] = (output_dir / "notices").glob("*.json")
    record = json.loads(path.read_text())
    assert record["event"] == "preempted" and record["before_first_step"] is True
    assert record["step"] is None and record["save_s"] == 0.0
    assert record["node"] == "1 (test-host)"
    assert record["started"] < record["notice"] <= record["time"]
    history = load_history(output_dir)
    assert [e["event"] for e in history] == ["preempted"]  # the round never began
    assert [e["nodes"] for e in preemptions(history)] == [["1 (test-host)"]]


def test_a_notice_is_recorded_in_an_s3_run_directory(s3):
    client, bucket = s3
    run_dir = f"s3://{bucket}/runs/r1"
    where = write_startup_notice(run_dir, {"notice": 33.0, "started": 30.0}, "worker-1")
    assert where == f"{run_dir}/notices/worker-1-33000.json"
    [noticed] = preemptions(run_history(run_dir, lambda: client))
    assert noticed["notice"] == 33.0 and noticed["nodes"] == ["worker-1"]


def test_the_run_directory_is_the_trainers_output_else_the_environments(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"output_dir": "s3://bucket/runs/r1"}))
    launched = ["--nnodes=2", "--nproc-per-node=8", "-m", "trainer.train", "--config"]
    assert trainer_output_dir([*launched, str(config)]) == "s3://bucket/runs/r1"
    assert trainer_output_dir([*launched, str(config), "--output_dir", str(tmp_path)]) == \
        str(tmp_path)
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path / "named"))
    assert trainer_output_dir(["-m", "trainer.train", "--no_such_option", "1"]) == \
        str(tmp_path / "named")


def test_a_notice_that_cannot_be_recorded_is_told_and_raises_nothing(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = ["-m", "trainer.train", "--output_dir", str(tmp_path / "file" / "run")]
    record_startup_notice(argv, {"step_saved": False, "notice": 33.0, "started": 30.0})
    assert "could not be recorded in the run directory" in capsys.readouterr().err


@pytest.mark.slow  # a trainer started under torchrun, noticed while it imports
def test_a_notice_before_the_trainer_can_hear_one_is_recorded_and_counted_as_a_preemption(
        tmp_path):
    """Before the trainer installs its handler SIGTERM ends it with no mark: its agent, which
    marked the notice, records it as one before the first step and exits 138, not as failed."""
    output_dir = tmp_path / "run"
    result = launched(output_dir, "import")
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == PREEMPTED_EXIT_CODE, output
    # with when its node started: the records of the nodes one notice reached are one preemption
    [path] = (output_dir / "notices").glob("*.json")
    record = json.loads(path.read_text())
    assert record["started"] < record["notice"] <= record["time"]
    assert [e["nodes"] for e in preemptions(load_history(output_dir))] == [["1 (test-host)"]]


@pytest.mark.slow  # a trainer run to its end under torchrun, noticed during its export
def test_a_notice_during_the_export_lets_it_finish_and_the_node_ends_done(tmp_path):
    """A notice after the last step's and the end's own asking (Trainer.finish): the workers
    finish the export within torchrun's shutdown timeout, and the node exits 0 (before, its
    agent's SignalException made it exit 1: a finished run's job failed)."""
    output_dir = tmp_path / "run"
    result = launched(output_dir, "export")
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert "a notice came after this node's workers finished the training" in result.stderr
    assert (output_dir / "summary.json").is_file() and (output_dir / "model").is_dir()
    assert preemptions(load_history(output_dir)) == []
