"""The sweep's early-stopping rule (finetune.sweep.asha), with made-up losses: its rungs, its
reduction factor, the decision at a rung given what the other trials reported there; and the
rung watch a train stage asks (finetune.sweep.early_stop), on a trial's metrics.jsonl and the
rung records of the sweep's directory."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from finetune.sweep.asha import MAX_RUNGS, judge, rung_steps
from finetune.sweep.early_stop import RungWatch, stop_reason
from finetune.sweep.records import SweepRecords
from finetune.validate import validate_params


def test_rungs_grow_by_the_reduction_factor_below_the_last_step():
    assert rung_steps(4, 3, 16) == [4, 12]
    assert rung_steps(50, 3, 150) == [50]
    assert rung_steps(10, 2, 100) == [10, 20, 40, 80]
    assert rung_steps(8, 2, 8) == []  # a rung at the last step judges nothing: the trial is done
    assert rung_steps(4, 1, 100) == []  # factor 1 stops no trial
    assert len(rung_steps(1, 2, None)) == MAX_RUNGS  # the last step not known here


def test_fewer_trials_than_the_factor_all_go_on():
    for others in ([], [1.0]):
        verdict = judge(9.0, others, factor=3)
        assert verdict.goes_on and verdict.kept == len(others) + 1


def test_a_trial_goes_on_only_in_the_best_share_of_those_at_the_rung():
    assert judge(3.0, [1.0, 2.0], factor=3) == judge(3.0, [2.0, 1.0], factor=3)
    worst = judge(3.0, [1.0, 2.0], factor=3)
    assert (worst.goes_on, worst.rank, worst.of, worst.kept) == (False, 3, 3, 1)
    best = judge(0.5, [1.0, 2.0], factor=3)
    assert (best.goes_on, best.rank) == (True, 1)
    # 4 at the rung with factor 2: the best ceil(4/2) = 2 go on
    assert judge(1.5, [1.0, 2.0, 3.0], factor=2).goes_on
    assert not judge(2.5, [1.0, 2.0, 3.0], factor=2).goes_on


def test_a_tie_goes_to_the_trial_that_reached_the_rung_first_and_nan_ranks_last():
    assert judge(1.0, [1.0], factor=2).rank == 2
    diverged = judge(math.nan, [5.0, 6.0], factor=3)
    assert (diverged.goes_on, diverged.rank) == (False, 3)
    assert judge(7.0, [math.nan, 5.0], factor=3).rank == 2


def test_an_asynchronous_sweep_stops_the_trials_that_fall_behind_as_they_arrive():
    """Eight trials arrive at one rung in turn (factor 2); each is judged once, on arrival,
    against the losses recorded before it: none is stopped later by a better newcomer."""
    arrivals = [5.0, 4.0, 6.0, 3.0, 4.5, 7.0, 2.0, 3.5]
    recorded, stopped = [], []
    for trial, loss in enumerate(arrivals):
        if not judge(loss, recorded, factor=2).goes_on:
            stopped.append(trial)
        recorded.append(loss)
    assert stopped == [2, 5]  # 6.0 (rank 3 of 3), 7.0 (rank 6 of 6); 4.5 is rank 3 of 5


@pytest.fixture(scope="module")
def trial_config():
    cfg = validate_params({"procs_per_node": 1, "max_steps": 16, "eval_interval": 4},
                          run_id="manual__rule")
    return cfg


def trial_of(cfg, sweep_dir: Path, trial: int):
    return dataclasses.replace(cfg, sweep_dir=str(sweep_dir), sweep_trial=trial,
                               run_dir=str(sweep_dir / f"trial-{trial}"),
                               sweep_first_rung=0, sweep_reduction_factor=3)


def write_evals(run_dir: Path, losses: dict[int, float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"type": "eval", "step": step, "eval_loss": loss}) + "\n"
        for step, loss in losses.items()))


def no_s3():
    raise AssertionError("a local sweep directory")


def test_the_watch_records_each_rung_and_stops_the_trial_that_falls_behind(tmp_path,
                                                                           trial_config):
    records = SweepRecords(str(tmp_path), no_s3)
    for trial, loss in ((0, 5.0), (1, 5.5)):
        write_evals(tmp_path / f"trial-{trial}", {0: 6.6, 4: loss})
        assert RungWatch(trial_of(trial_config, tmp_path, trial), no_s3).poll() is None
    slow = trial_of(trial_config, tmp_path, 2)
    watch = RungWatch(slow, no_s3)
    assert watch.rungs == [4, 12]
    write_evals(tmp_path / "trial-2", {0: 6.6})
    assert watch.poll() is None  # not at the rung yet
    write_evals(tmp_path / "trial-2", {0: 6.6, 4: 6.5})
    stop = watch.poll()
    assert (stop["rung"], stop["step"], stop["rank"], stop["of"], stop["goes_on"]) == \
        (1, 4, 3, 3, False)
    assert watch.poll() is None  # the stop is said once
    assert sorted(records.rung(4)) == [0, 1, 2] and records.rung(4)[2]["eval_loss"] == 6.5
    assert stop_reason(stop, 6) == ("stopped at step 6 by the rule: eval loss 6.5000, rank 3 "
                                    "of 3 at rung 1 (step 4; the best 1 go on, reduction "
                                    "factor 3)")
    # A retry's watch keeps the recorded verdict: a better loss now changes nothing.
    write_evals(tmp_path / "trial-2", {0: 6.6, 4: 1.0})
    assert RungWatch(slow, no_s3).poll()["eval_loss"] == 6.5


def test_a_single_run_has_no_rungs_to_watch(trial_config):
    from finetune.sweep.early_stop import is_trial

    assert not is_trial(trial_config)
