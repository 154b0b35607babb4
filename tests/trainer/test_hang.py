"""A rank that stops (SIGSTOP) mid-run: its peer's watchdog fires after hang_timeout_s, dumps
stacks and the collective flight recorder, records a TrainingHang naming the stopped rank and
exits; torchrun restarts both workers, which resume from the newest checkpoint to the losses of
an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from finetune.targets.base import TORCHRUN_ENV
from tests.support import REPO_ROOT
from tests.support.training import logged_steps, read_metrics, torchrun, torchrun_workers
from trainer.errors import read_root_cause
from trainer.watchdog import HANG_EXIT_CODE

pytestmark = pytest.mark.slow  # two torchrun runs, one hung for hang_timeout_s and restarted

STEPS, INTERVAL, STOP_AFTER, HANG_TIMEOUT_S = 10, 2, 5, 8


def trainer_args(output_dir: Path) -> list[str]:
    return [
        "-m", "trainer.train", "--output_dir", str(output_dir), "--max_steps", str(STEPS),
        "--seq_len", "64", "--micro_batch", "4", "--warmup_steps", "2", "--eval_interval", "0",
        "--checkpoint_interval", str(INTERVAL), "--log_interval", "1",
        "--hang_timeout_s", str(HANG_TIMEOUT_S),
    ]  # fmt: skip


def losses(output_dir: Path) -> dict[int, float]:
    """Loss per step; after a resume the record written last for a step is the one kept."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if r["type"] == "train"}


def worker_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun `agent`'s worker of global rank `rank`, None if it has none now."""
    return torchrun_workers(child.pid for child in psutil.Process(agent).children()).get(rank)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run_with_rank_stopped(output_dir: Path, rank: int) -> tuple[subprocess.CompletedProcess,
                                                                 float, int]:
    """torchrun (2 workers, 1 restart) with `rank` stopped after step STOP_AFTER; (its result,
    when the rank was stopped, the stopped pid). Nothing of the run is left running."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=1", *trainer_args(output_dir)]
    env = {**os.environ, **TORCHRUN_ENV, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    log = (output_dir.parent / f"{output_dir.name}.log").open("w+")
    agent = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    stopped = None
    try:
        wait_until(lambda: STOP_AFTER in logged_steps(output_dir), 240, f"step {STOP_AFTER}")
        stopped = worker_pid(agent.pid, rank)
        assert stopped is not None, f"no worker of rank {rank}"
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        agent.wait(timeout=300)
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
    log.seek(0)
    return subprocess.CompletedProcess(command, agent.returncode, log.read(), ""), stopped_at, \
        stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    torchrun(trainer_args(output_dir))
    return output_dir


def test_a_stopped_rank_is_named_by_its_peers_watchdog_and_the_restart_resumes_to_the_same_losses(
    tmp_path, uninterrupted
):
    output_dir = tmp_path / "run"
    result, stopped_at, stopped_pid = run_with_rank_stopped(output_dir, rank=1)
    assert result.returncode == 0, result.stdout[-6000:]
    # rank 0's watchdog ended it; torchrun restarted the workers once
    assert result.stdout.count("failed (exitcode") == 1, result.stdout[-6000:]
    assert f"failed (exitcode: {HANG_EXIT_CODE}) local_rank: 0" in result.stdout

    # The root cause names the hang and the stopped rank, found within the timeout.
    cause = read_root_cause(str(output_dir))
    assert cause is not None and cause["type"] == "TrainingHang" and cause["rank"] == 0, cause
    assert f"rank 1 (pid {stopped_pid} " in cause["message"], cause
    assert "stopped responding" in cause["message"], cause
    detected_after = cause["time"] - stopped_at
    assert HANG_TIMEOUT_S - 2 < detected_after < HANG_TIMEOUT_S + 10, detected_after

    # The dump: what rank 0 saw, its threads' stacks, its flight recorder of gloo collectives.
    dump = (output_dir / "hangs" / "rank_0.txt").read_text()
    assert cause["message"] in dump
    assert "Python stacks of every thread" in dump and "trainer/train.py" in dump
    trace = json.loads((output_dir / "hangs" / "rank_0.fr.json").read_text())
    assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"])
    assert not (output_dir / "hangs" / "rank_1.txt").exists()  # a stopped rank dumps nothing

    # The restart resumed from the newest checkpoint and trained to the uninterrupted losses.
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    resumed = summary["resumed_from_step"]
    assert resumed is not None and resumed % INTERVAL == 0 and resumed >= STOP_AFTER - INTERVAL
    assert losses(output_dir) == pytest.approx(losses(uninterrupted), rel=1e-5)
    final = json.loads((uninterrupted / "summary.json").read_text())["final_eval_loss"]
    assert summary["final_eval_loss"] == pytest.approx(final, rel=1e-5)


def test_every_step_logs_each_ranks_step_time_and_a_rank_slow_to_get_its_batches_is_a_straggler(
    tmp_path,
):
    delay_s = 0.3
    args = trainer_args(tmp_path)[2:] + ["--max_steps", "6", "--checkpoint_interval", "0"]
    torchrun(["tests/trainer/straggler_worker.py", "1", str(delay_s), *args])

    train = [r for r in read_metrics(tmp_path) if r["type"] == "train"]
    assert len(train) == 6 and all(len(r["rank_step_time_s"]) == 2 for r in train)
    # Rank 0 waited for rank 1 at each step's first collective: that wait is not its time. The
    # median step, as the straggler rule takes it: on a busy machine one step of rank 0 may be
    # slow for reasons of its own.
    gaps = sorted(r["rank_step_time_s"][1] - r["rank_step_time_s"][0] for r in train)
    assert (gaps[2] + gaps[3]) / 2 > 0.8 * delay_s, gaps
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["rank"] for s in summary["stragglers"]] == [1]
