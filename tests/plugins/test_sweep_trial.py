"""A sweep trial's train task (finetune.operators.TrialOperator) on the local target, its
training stood in for: its outcome is its result whatever happens (completed, stopped by the
rule, failed with its first cause), recorded in the sweep's directory, where a retry of the task
or of the sweep finds it; its rendezvous is made once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.config import ConfigError
from finetune.operators import TrialOperator
from finetune.pipeline import RESUMABLE
from finetune.sweep.records import SweepRecords
from finetune.targets.base import StageFailed, TrainingFailed
from finetune.targets.local.target import LocalTarget
from finetune.validate import validate_params
from finetune_contract.errors import ERRORS_DIR

IMAGE = {"image_tag": "test", "image": "local/finetune-trainer:test"}
RENDEZVOUS = {"backend": "c10d", "endpoint": "127.0.0.1:1", "rdzv_id": "r"}


@pytest.fixture
def trial(tmp_path):
    cfg = validate_params({"procs_per_node": 1, "output_dir": str(tmp_path)},
                          run_id="manual__trial")
    return dataclasses.replace(cfg, sweep_dir=str(tmp_path / "sweep"), sweep_trial=1,
                               run_dir=str(tmp_path / "sweep" / "trial-1"))


@pytest.fixture
def stages(monkeypatch):
    """The local target's rendezvous and train stood in for: `calls` counts them; `train`
    is what the training does (a function of nothing)."""
    stand_in = SimpleNamespace(calls=[], train=lambda: {"wall_time_s": 1.0})

    def rendezvous(self, cfg):
        stand_in.calls.append("rendezvous")
        return RENDEZVOUS

    def train(self, cfg, image, rendezvous):
        stand_in.calls.append(("train", rendezvous["rdzv_id"]))
        return stand_in.train()

    monkeypatch.setattr(LocalTarget, "rendezvous", rendezvous)
    monkeypatch.setattr(LocalTarget, "train", train)
    return stand_in


def run(cfg, try_number: int = 1) -> dict:
    operator = TrialOperator(task_id="train", run_config=cfg.to_dict(),
                             inputs={"image": IMAGE}, **RESUMABLE)
    return operator.execute({"ti": SimpleNamespace(try_number=try_number)})


def records(cfg) -> SweepRecords:
    return SweepRecords(cfg.sweep_dir, lambda: None)


def test_a_completed_trial_records_its_outcome_with_its_final_eval_loss(trial, stages):
    stages.train = lambda: (_write_summary(trial), {"wall_time_s": 1.0})[1]
    outcome = run(trial)
    assert (outcome["outcome"], outcome["final_eval_loss"]) == ("completed", 4.25)
    assert records(trial).outcome(1) == outcome
    assert stages.calls == ["rendezvous", ("train", "r")]


def _write_summary(cfg) -> None:
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "summary.json").write_text(json.dumps({"final_eval_loss": 4.25}))


def test_a_trial_the_rule_stopped_is_stopped_not_failed(trial, stages):
    stages.train = lambda: {"model_dir": None, "stopped": {"reason": "stopped at step 9 by the "
                                                                     "rule: ..."}}
    outcome = run(trial)
    assert outcome["outcome"] == "stopped" and outcome["reason"].startswith("stopped at step 9")


def test_a_training_that_failed_is_the_trials_outcome_with_the_trainers_first_cause(
        trial, stages):
    errors = records(trial).sweep_dir + "/trial-1/" + ERRORS_DIR

    def fails() -> dict:
        Path(errors).mkdir(parents=True)
        (Path(errors) / "rank_0.json").write_text(json.dumps({
            "rank": 0, "stage": "train", "type": "ValueError", "time": 1.0,
            "message": "model has no safetensors weights", "traceback": ""}))
        raise TrainingFailed("training failed: node 0 exited with code 1; last lines ...")

    stages.train = fails
    outcome = run(trial)
    assert outcome["outcome"] == "failed"
    assert outcome["reason"] == "failed: ValueError: model has no safetensors weights"
    assert records(trial).outcome(1)["outcome"] == "failed"


def test_a_lost_try_is_retried_and_fails_the_trial_only_on_its_last_try(trial, stages):
    def lost() -> dict:
        raise ConnectionError("the API server went away")

    stages.train = lost
    with pytest.raises(ConnectionError):
        run(trial, try_number=1)
    assert records(trial).outcome(1) is None
    outcome = run(trial, try_number=RESUMABLE["retries"] + 1)
    assert outcome["outcome"] == "failed" and "the API server went away" in outcome["reason"]
    # the rendezvous was made once: a retry may reattach to a training that uses it
    assert stages.calls.count("rendezvous") == 1


def test_a_verdict_on_the_trial_fails_it_at_once_not_only_on_its_last_try(trial, stages):
    def unschedulable() -> dict:
        raise StageFailed("2 pod(s) of PyTorchJob x could not be scheduled for 600 s or more")

    stages.train = unschedulable
    outcome = run(trial, try_number=1)
    assert outcome["outcome"] == "failed" and "could not be scheduled" in outcome["reason"]


def test_a_failed_trial_gives_back_what_it_started_at_once_not_at_the_sweeps_teardown(
        trial, stages):
    """The next trial takes its nodes: on eks its job (pods restarting or Pending) deleted, on
    the local target its processes and etcd stopped (LocalTarget.release, as here)."""
    from finetune.etcd import LocalEtcd
    from finetune.targets.local.state import write_state
    from tests.support.system import etcd_or_skip

    server = LocalEtcd.start(etcd_or_skip(), Path(trial.run_dir) / "logs")
    write_state(trial, "etcd", server.to_dict())
    try:
        def unschedulable() -> dict:
            raise StageFailed("2 pod(s) of PyTorchJob x could not be scheduled for 600 s")

        stages.train = unschedulable
        assert run(trial, try_number=1)["outcome"] == "failed"
        assert not server.is_running() and not Path(server.data_dir).exists()
    finally:
        server.stop()


def test_a_refused_trial_fails_at_once(trial, stages):
    def refused() -> dict:
        raise ConfigError([("dataset", "changed while it was prepared")])

    stages.train = refused
    assert run(trial, try_number=1)["outcome"] == "failed"


def test_a_retry_of_the_sweep_adopts_an_ended_trial_and_tries_a_failed_one_again(trial, stages):
    ended = {"trial": 1, "outcome": "stopped", "reason": "stopped at step 6 by the rule: ...",
             "train": {}, "final_eval_loss": None}
    records(trial).record_outcome(1, ended)
    assert run(trial) == ended and stages.calls == []
    records(trial).record_outcome(1, {**ended, "outcome": "failed", "reason": "failed: x"})
    assert run(trial)["outcome"] == "completed"
    assert stages.calls == ["rendezvous", ("train", "r")]
