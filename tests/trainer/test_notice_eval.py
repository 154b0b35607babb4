"""A notice during a step the eval is due at: the step is saved before its eval (the notice's
save comes first, within the pods' grace), and the resumed round takes that eval before it trains
on, so the eval curve and a sweep's rung at that step are not lost."""

import json
import os
import subprocess
import sys

import pytest

from finetune_contract.run_history import PREEMPTED_EXIT_CODE
from tests.support import REPO_ROOT
from tests.support.training import read_metrics

pytestmark = pytest.mark.slow  # a trainer run noticed, then resumed

STEPS, EVAL_EVERY, NOTICED = 6, 2, 4


def trainer_args(output_dir, eval_every: int = EVAL_EVERY) -> list[str]:
    return [
        "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--seq_len", "64",
        "--micro_batch", "4", "--warmup_steps", "2", "--eval_interval", str(eval_every),
        "--checkpoint_interval", "3", "--log_interval", "1",
    ]  # fmt: skip


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def evals(output_dir) -> list[int]:
    return sorted(r["step"] for r in read_metrics(output_dir) if r["type"] == "eval")


def test_a_notice_at_an_eval_step_saves_it_and_the_resumed_round_takes_its_eval(tmp_path):
    noticed = run(["tests/trainer/notice_worker.py", str(NOTICED), *trainer_args(tmp_path)])
    output = noticed.stdout[-3000:] + noticed.stderr[-3000:]
    assert noticed.returncode == PREEMPTED_EXIT_CODE, output
    assert f"preempted at step {NOTICED}" in noticed.stdout
    assert evals(tmp_path) == [0, 2]  # step 4's eval was due when the notice's save came

    resumed = run(["-m", "trainer.train", *trainer_args(tmp_path)])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert evals(tmp_path) == [0, 2, 4, 6]  # each once
    trained = [r["step"] for r in read_metrics(tmp_path) if r["type"] == "train"]
    assert trained == list(range(1, STEPS + 1))


def test_a_notice_during_the_final_eval_saves_the_last_step_and_the_next_round_exports(
        tmp_path):
    """After the last step's gather no step tells the ranks of a notice: the end of the run
    asks them itself, so a notice during the final eval saves the last step and exits as one
    during a step does (before, the run went on, and torchrun's agent, stopping on the signal,
    ended its node as failed). The next round trains nothing and evaluates and exports."""
    # Evals at 0 and 4, then the final one; step 6 is checkpointed (every 3) before the notice.
    args = trainer_args(tmp_path, eval_every=4)
    noticed = run(["tests/trainer/notice_worker.py", "final-eval", *args])
    output = noticed.stdout[-3000:] + noticed.stderr[-3000:]
    assert noticed.returncode == PREEMPTED_EXIT_CODE, output
    assert f"preempted at step {STEPS}" in noticed.stdout
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()
    # Step 6, saved at its interval, is not saved again (on S3 a save first deletes what is
    # there): its checkpoint's trainer state is rewritten with the final eval.
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in history if e["event"] == "save"] == [3, STEPS]
    saved = json.loads((tmp_path / "checkpoints" / f"step_{STEPS:08d}" /
                        "trainer_state.json").read_text())
    assert saved["last_eval_step"] == STEPS and saved["eval_loss"] is not None

    assert evals(tmp_path) == [0, 4, STEPS]  # the final eval finished before the notice was asked
    resumed = run(["-m", "trainer.train", *args])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert evals(tmp_path) == [0, 4, STEPS]
    trained = [r["step"] for r in read_metrics(tmp_path) if r["type"] == "train"]
    assert trained == list(range(1, STEPS + 1))
    assert (tmp_path / "model").is_dir() and (tmp_path / "summary.json").is_file()
    # The round that only evaluated and exported is a round of the history (goodput's).
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [e["event"] for e in history if e["event"] in ("start", "preempted", "end")] == \
        ["start", "preempted", "start", "end"]
