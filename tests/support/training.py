"""The trainer tests' helpers: torchrun in the repo root, demo rows and JSONL files, the metrics a
run wrote, the ranks of torchrun's workers, steps and saves made slower in the trainer processes
a test starts (`slow_trainer`); fixture `world_of_one`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

from tests.support import REPO_ROOT


def demo_rows(n: int) -> list[dict[str, str]]:
    from trainer.demo import DEMO_DATASET

    with open(DEMO_DATASET) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def lm_step(model, optimizer, input_ids) -> float:
    """One optimizer step of a Hugging Face causal LM on `input_ids` as its own labels."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def torchrun(args: list[str], nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun `args` (`-m module ...` or `script ...`) in the repo root; fail with its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
        )
    return result


def read_metrics(output_dir: Path) -> list[dict[str, object]]:
    with open(output_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def logged_steps(output_dir: Path) -> list[int]:
    """The train steps in metrics.jsonl so far (a line still being written is skipped)."""
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "train":
            steps.append(record["step"])
    return steps


def torchrun_workers(pids: Iterable[int]) -> dict[int, int]:
    """Global rank -> pid of the torchrun workers among `pids` (RANK in their environment);
    torchrun agents, and processes that ended meanwhile, are left out."""
    workers = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            cmdline, environ = process.cmdline(), process.environ()
        except psutil.Error:
            continue
        if "torch.distributed.run" in cmdline or "trainer.launch" in cmdline:
            continue  # a torchrun agent
        if "RANK" in environ:
            workers[int(environ["RANK"])] = pid
    return workers


@pytest.fixture(scope="module")
def world_of_one():
    """A one-process gloo (or NCCL) group in this process, as `python -m trainer.train` makes."""
    import torch.distributed as dist

    from trainer.parallel import init_distributed

    env = init_distributed()
    yield env
    dist.destroy_process_group()


# Injected into the trainer processes (a sitecustomize on their PYTHONPATH): each optimizer step
# and each checkpoint save takes this much longer (FINETUNE_TEST_DELAYS="step_s,save_s").
DELAYS = """
import os, time
if os.environ.get("FINETUNE_TEST_DELAYS"):
    step_s, save_s = map(float, os.environ["FINETUNE_TEST_DELAYS"].split(","))
    import torch.optim
    from trainer.checkpoint import Checkpointer
    step, save = torch.optim.AdamW.step, Checkpointer.save
    def slow_step(self, *args, **kwargs):
        time.sleep(step_s)
        return step(self, *args, **kwargs)
    def slow_save(self, *args, **kwargs):
        time.sleep(save_s)
        return save(self, *args, **kwargs)
    torch.optim.AdamW.step, Checkpointer.save = slow_step, slow_save
"""


def slow_trainer(hook_dir: Path, env: pytest.MonkeyPatch, step_s: float, save_s: float) -> None:
    """Every trainer process started with `env` (torchrun's workers inherit it) steps `step_s`
    and saves `save_s` slower: a sitecustomize in `hook_dir`, first on PYTHONPATH."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(DELAYS)
    env.setenv("PYTHONPATH", os.pathsep.join(
        [str(hook_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setenv("FINETUNE_TEST_DELAYS", f"{step_s},{save_s}")
