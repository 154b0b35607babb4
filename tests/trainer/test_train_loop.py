"""The pieces of trainer.train driven one at a time: setup, resume, step, finish."""

import json

import pytest

from tests.support.training import demo_rows, read_metrics, write_jsonl
from trainer.config import load_config
from trainer.train import Trainer, TrainState


def test_a_step_advances_the_state_and_logs_it_and_a_restart_resumes_that_state(
    world_of_one, tmp_path
):
    config = load_config(None, {
        "dataset": str(write_jsonl(tmp_path / "rows.jsonl", demo_rows(40))),
        "output_dir": str(tmp_path / "run"), "micro_batch": 4, "max_steps": 2,
        "warmup_steps": 1, "eval_interval": 0, "checkpoint_interval": 1, "log_interval": 1,
    })  # fmt: skip
    trainer = Trainer.setup(config, world_of_one, started=0)
    state = trainer.resume()
    assert state.step == 0 and state.resumed_from_step is None and state.last_eval_step == 0
    assert state.initial_eval_loss == state.eval_loss is not None

    trainer.step(state)

    assert state.step == 1
    records = read_metrics(tmp_path / "run")
    assert [(r["type"], r["step"]) for r in records] == [("data", 0), ("eval", 0), ("train", 1)]
    # A new process's trainer on the same output dir continues from the step-1 checkpoint.
    restarted = Trainer.setup(config, world_of_one, started=0)
    resumed = restarted.resume()
    assert resumed == TrainState(
        step=1, initial_eval_loss=state.initial_eval_loss, resumed_from_step=1, skipped_steps=0,
        last_eval_step=0, eval_loss=state.initial_eval_loss,  # the last eval taken: step 0's
    )
    assert restarted.sampler.state_dict() == trainer.sampler.state_dict()
    assert restarted.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()

    trainer.step(state)
    restarted.step(resumed)

    second_step = [r["loss"] for r in read_metrics(tmp_path / "run") if r["step"] == 2]
    assert len(second_step) == 2 and second_step[1] == pytest.approx(second_step[0], rel=1e-5)
    summary = restarted.finish(resumed)
    assert summary is not None and summary["steps"] == 2 and summary["resumed_from_step"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    assert resumed.last_eval_step == 2  # finish evaluated the last step
