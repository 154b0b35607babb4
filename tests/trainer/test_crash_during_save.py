"""A trainer killed in the middle of a checkpoint save: the half-written checkpoint is never
resumed from; the restart resumes from the newest complete one and reproduces the losses."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.training import read_metrics
from trainer.checkpoint import Checkpointer

pytestmark = pytest.mark.slow  # trainer runs killed and restarted

STEPS, INTERVAL = 6, 2


def trainer_args(output_dir) -> list[str]:
    return [
        "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--seq_len", "64",
        "--micro_batch", "4", "--warmup_steps", "2", "--eval_interval", "0",
        "--checkpoint_interval", str(INTERVAL), "--log_interval", "1",
    ]  # fmt: skip


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_save_killed_midway_is_ignored_and_the_restart_resumes_from_the_last_complete_one(
    tmp_path,
):
    crashed = run(["tests/trainer/crash_save_worker.py", "2", *trainer_args(tmp_path)])
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    half_written = checkpoints / "step_00000004.tmp"
    assert any(half_written.iterdir())  # shards were written ...
    assert not (half_written / "trainer_state.json").exists()  # ... the save never completed
    latest = Checkpointer(str(tmp_path), 2, 0).latest()
    assert latest is not None and latest.name == "step_00000002"
    before = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if r["type"] == "train"}
    assert sorted(before) == [1, 2, 3, 4]  # step 4 was trained, its checkpoint was not saved

    restarted = run(["-m", "trainer.train", *trainer_args(tmp_path)])
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_00000002'}" in restarted.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == STEPS
    after = {}
    for record in read_metrics(tmp_path):
        if record["type"] == "train":
            after[record["step"]] = record["loss"]  # the restart's record of a step comes last
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in (3, 4):  # trained again from the step-2 checkpoint: the same losses
        assert abs(after[step] - before[step]) <= 1e-4 * abs(before[step]), step
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000006"]
