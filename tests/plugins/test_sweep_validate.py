"""A sweep's conf before anything starts (finetune.sweep.trials.validate_sweep): every trial
through the run's own validate, a bad one naming "trial N: field"; the sweep's run config for
the trials run at once; the prepared-data groups; the planner's figures of each trial."""

from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError
from finetune.params import dag_params
from finetune.sweep.trials import plan_rows, plan_table, plan_totals, validate_sweep
from finetune.targets.local.machine import local_resources
from finetune.validate import validate_params
from tests.support.eks import EKS_PARAMS

BASE = {"procs_per_node": 1, "max_steps": 16, "eval_interval": 4, "seq_len": 64,
        "micro_batch": 4}


def conf(trials: list[dict], **changes) -> dict:
    return {**BASE, "sweep_space": json.dumps({"trials": trials}), **changes}


def refused(params: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        validate_sweep(params, run_id="manual__s", dag_id="llm_finetune_sweep")
    return err.value.errors


@pytest.fixture(scope="module")
def sweep():
    return validate_sweep(conf([{}, {"lr": 0.01}, {"seq_len": 96}], sweep_parallel=2,
                               sweep_first_rung=8, sweep_reduction_factor=2),
                          run_id="manual__s", dag_id="llm_finetune_sweep")


def test_each_trial_is_the_conf_with_its_values_in_a_directory_of_the_sweeps(sweep):
    trials = sweep.trials
    assert [t.lr for t in trials] == [0.003, 0.01, 0.003]
    assert [t.seq_len for t in trials] == [64, 64, 96]
    assert [t.run_dir for t in trials] == [f"{sweep.config.run_dir}/trial-{i}" for i in range(3)]
    assert len({t.rdzv_id for t in trials} | {sweep.config.rdzv_id}) == 4
    assert all(t.sweep_dir == sweep.config.run_dir and t.sweep_trial == i
               for i, t in enumerate(trials))
    assert {t.node_reservation for t in trials} == {sweep.config.rdzv_id}
    assert {(t.sweep_first_rung, t.sweep_reduction_factor) for t in trials} == {(8, 2)}


def test_the_sweeps_own_config_holds_the_nodes_of_the_trials_at_once(sweep):
    assert sweep.at_once == 2 and sweep.config.nodes == 2 * sweep.trials[0].nodes
    assert sweep.config.sweep_trial == -1 and sweep.config.run_id == "manual__s"


def test_trials_that_differ_only_in_training_fields_share_a_prepared_data_group(sweep):
    assert sweep.groups == (0, 0, 2)  # lr: the same set; seq_len: another
    assert [t["sweep_trial"] for t in sweep.to_dict()["prepare"]] == [0, 2]


def test_trials_with_different_mixtures_prepare_apart():
    mixtures = [json.dumps([{"dataset": "trainer/demo/instructions.jsonl", "weight": w},
                            {"dataset": "trainer/demo/conversations.jsonl", "weight": 1}])
                for w in (1, 3)]
    mixed = validate_sweep(conf([{"mixture": m} for m in [*mixtures, mixtures[0]]]),
                           run_id="manual__m", dag_id="llm_finetune_sweep")
    assert mixed.groups == (0, 1, 0)


def test_a_sweep_with_a_bad_trial_is_refused_naming_the_trial_and_the_field():
    errors = refused(conf([{}, {"micro_batch": 4000}, {"tp_degree": 3}]))
    assert sorted({field for field, _ in errors}) == ["trial 1: micro_batch",
                                                      "trial 2: tp_degree"]


def test_the_trials_at_once_must_fit_where_the_sweep_runs():
    capacity = local_resources(1, 1)["capacity"]
    [(field, message)] = refused(conf([{}, {"lr": 0.01}], procs_per_node=capacity,
                                      sweep_parallel=2))
    assert field == "sweep_parallel" and "do not fit this machine" in message
    [(field, message)] = refused({**EKS_PARAMS, "max_nodes": 1, "sweep_parallel": 2,
                                  "sweep_space": json.dumps({"grid": {"lr": [0.001, 0.01]}})})
    assert field == "sweep_parallel" and "exceeds max_nodes = 1" in message


def test_early_stopping_needs_each_trials_eval_loss_at_its_rungs():
    [(field, message)] = refused(conf([{}, {"eval_interval": 0}]))
    assert field == "trial 1: eval_interval" and "sweep_reduction_factor 1" in message
    [(field, _)] = refused(conf([{}, {"eval_interval": 3}], sweep_first_rung=8))
    assert field == "trial 1: eval_interval"
    validate_sweep(conf([{"eval_interval": 0}], sweep_reduction_factor=1), run_id="m",
                   dag_id="d")  # nothing stopped: no rung needed


def test_the_sweeps_own_fields_are_checked_and_refused_in_a_single_runs_conf():
    errors = refused(conf([{}], sweep_parallel=0, sweep_space="{"))
    assert [field for field, _ in errors] == ["sweep_parallel"]  # then the space, once valid
    with pytest.raises(ConfigError, match="unknown parameter"):
        validate_params({"procs_per_node": 1, "sweep_parallel": 2}, run_id="manual__r")
    assert "sweep_space" in dag_params(sweep=True) and "sweep_space" not in dag_params()


def test_the_validate_log_has_each_trials_planned_memory_and_the_sum(sweep):
    rows = plan_rows(list(sweep.trials), list(sweep.values))
    assert [row["trial"] for row in rows] == [0, 1, 2]
    assert all(row["peak_gib"] and row["steps"] == 16 for row in rows)
    table = plan_table(rows, plan_totals(rows, sweep.at_once))
    assert "lr=0.01" in table and "seq_len=96" in table and "(the conf)" in table
    assert table.splitlines()[-1].lstrip().startswith("sum")
    priced = [{**row, "wall_time_s": 3600.0, "cost_usd": 2.0} for row in rows]
    totals = plan_totals(priced, at_once=2)
    assert (totals["cost_usd"], totals["wall_time_s"], totals["sweep_wall_time_s"]) == \
        (6.0, 10800.0, 5400.0)


def test_a_trials_value_equal_to_the_built_in_default_stands_over_the_preset():
    """The trigger form sends every field; one still at its built-in default is not set on
    purpose, so a preset's value stands for it. A trial's value is set on purpose even when it
    equals the built-in default: tiny-local's warmup_steps 4 and seq_len 96 must not replace
    the trials' 10 and 128 (the defaults)."""
    from finetune_contract.parameters import FORM_PARAMETERS, SWEEP_PARAMETERS

    every = {p.name: p.default for p in (*SWEEP_PARAMETERS, *FORM_PARAMETERS)}
    form = {**every, "preset": "tiny-local", "procs_per_node": 1,
            "sweep_space": json.dumps({"grid": {"warmup_steps": [10, 5],
                                                "seq_len": [128, 64]}})}
    assert (form["warmup_steps"], form["seq_len"]) == (10, 128)  # the built-in defaults
    sweep = validate_sweep(form, run_id="manual__s", dag_id="llm_finetune_sweep", given=form)
    assert sorted((t.warmup_steps, t.seq_len) for t in sweep.trials) == \
        [(5, 64), (5, 128), (10, 64), (10, 128)]
    assert {t.max_steps for t in sweep.trials} == {40}  # the preset's, for a field left alone


def test_trials_whose_eval_interval_differ_need_a_first_rung_they_share():
    """sweep_first_rung 0 starts each trial's rungs at its own eval_interval: 4 and 8 would
    give rungs 4, 8, ... and 8, 16, ... and the rule would judge each trial alone."""
    errors = refused(conf([{"eval_interval": 4}, {"eval_interval": 8}], sweep_first_rung=0,
                          sweep_reduction_factor=2))
    assert [field for field, _ in errors] == ["sweep_first_rung"], errors
    assert "(4, 8)" in errors[0][1] and "e.g. 8" in errors[0][1]
    validate_sweep(conf([{"eval_interval": 4}, {"eval_interval": 8}], sweep_first_rung=8,
                        sweep_reduction_factor=2), run_id="manual__s", dag_id="llm_finetune_sweep")
    validate_sweep(conf([{"eval_interval": 4}, {"eval_interval": 8}], sweep_first_rung=0,
                        sweep_reduction_factor=1), run_id="manual__s", dag_id="llm_finetune_sweep")
