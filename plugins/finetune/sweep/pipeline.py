"""The sweep's task graph (the llm_finetune_sweep DAG): the single run's stages, with Airflow's
dynamic task mapping over the parts that differ per trial; `SWEEP_DOC` says what its tasks do
(the DAG's doc_md: the graph drawn once there), in the pipeline's own words where a task is
the pipeline's.

Trials run `sweep_parallel` at a time on the nodes scale_up brought up for that many: trial N
waits for trial N - sweep_parallel's train to end (finetune.sweep's lanes; Airflow's own
per-task limits are fixed when the DAG is parsed, the form's value is not), so a trial stopped
by the rule or failed gives its nodes to the next one at once. A trial's train never fails the
sweep (finetune.operators.TrialOperator: its outcome is its result); the winner, the completed
trial with the lowest final eval loss, goes through the single run's evaluate, collect_metrics
and promote (finetune.pipeline's, not copies).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from typing import Any

from airflow.sdk import Asset, PokeReturnValue, get_current_context, task, task_group

from finetune.operators import StageOperator, TrialOperator
from finetune.pipeline import (
    PIPELINE_DOC,
    RESUMABLE,
    _target,
    collect_run_metrics,
    find_champion_of,
    promote_model,
    run_conf,
)
from finetune.targets.base import Stage

log = logging.getLogger(__name__)

TRIAL_GROUP = "trial"
TRIAL_TRAIN = f"{TRIAL_GROUP}.train"
# A trial waiting for its turn looks again this often, its worker slot given back between
# looks (a sensor in reschedule mode). FINETUNE_SLOT_POKE_S: another pace (the tests').
SLOT_POKE_S = float(os.environ.get("FINETUNE_SLOT_POKE_S", "30"))
SLOT_TIMEOUT = datetime.timedelta(days=7)
# A train task in one of these has ended: its trial's nodes are free.
ENDED_STATES = ("success", "failed", "upstream_failed", "skipped", "removed")


def _described(task_id: str) -> str:
    """The pipeline's own words for a task it shares with the sweep (PIPELINE_DOC)."""
    found = re.search(rf"^- \*\*{task_id}\*\*: (.+(?:\n  .+)*)", PIPELINE_DOC, re.M)
    if found is None:
        raise KeyError(f"PIPELINE_DOC does not describe {task_id}")
    text = " ".join(found[1].split())
    return text[:1].upper() + text[1:]


# Markdown; tests/dags/test_llm_finetune_sweep.py holds it to the DAG's tasks.
SWEEP_DOC = f"""
```
validate_sweep -> prepare_groups -> prepare_data [a group each] -> trials -> snapshot (setup)
  -> scale_up -> build_image -> preflight
  -> trial [a trial each, sweep_parallel at once]: wait_for_slot -> train -> collect_metrics
  -> choose_winner -> evaluate -> collect_metrics -> promote -> sweep_report
find_champion -> evaluate, promote
teardown (whenever the setup ran)
```

- **validate_sweep**: the search space expanded; every trial's conf validated as a run's, a bad
  one refusing the sweep ("trial N: field"); each trial's planned memory and cost, and the sum.
- **prepare_groups**: the prepared-data groups, by their first trials.
- **prepare_data**: one per prepared-data group (trials that differ only in training fields
  share one). {_described("prepare_data")}
- **trials**: each trial's run config with its group's prepared set.
- **snapshot**: {_described("snapshot")}
- **scale_up**: the nodes of sweep_parallel trials at once, once for the sweep.
- **build_image**: {_described("build_image")}
- **preflight**: {_described("preflight")}
- **{TRIAL_GROUP}.wait_for_slot**: a trial's turn: when the trial sweep_parallel before it ended.
- **{TRIAL_TRAIN}**: its rendezvous and training on the sweep's nodes; the early-stopping rule
  may stop it (the step saved); a failure is its outcome, and the sweep goes on.
- **{TRIAL_GROUP}.collect_metrics**: the trial's report (completed, stopped or failed).
- **choose_winner**: the completed trial with the lowest eval loss; MLflow's parent run and a
  child run per trial; the sweep's report.
- **find_champion**: {_described("find_champion")}
- **evaluate**: the winner's model. {_described("evaluate")}
- **collect_metrics**: the winner's report, with its evaluation.
- **promote**: {_described("promote")} The model asset event names the winning trial.
- **sweep_report**: the sweep's report.html: every trial, its curves, why it ended, the winner.
- **teardown**: every trial's processes or jobs stopped, the sweep's nodes given back once,
  after any failure too.
"""


def sweep_pipeline(*, model_asset: Asset | None = None, pool: str | None = None) -> None:
    """Add the sweep's stages to the DAG being defined (its params: finetune.params.dag_params
    with sweep=True). pool: the pool each trial's train takes a slot of (one per training on
    the cluster); model_asset: gets an event naming the winning trial when it is promoted."""

    @task(multiple_outputs=True)
    def validate_sweep() -> dict:
        """The sweep's conf -> every trial's validated run config, or a refusal naming each
        problem (trial N: field); the planner's figures of each trial and the sum logged."""
        from finetune.sweep.trials import plan_rows, plan_table, plan_totals
        from finetune.sweep.trials import validate_sweep as validated
        from finetune.validate import config_table

        context = get_current_context()
        params, given = run_conf(context, None, None)
        sweep = validated(params, run_id=context["run_id"], dag_id=context["dag_run"].dag_id,
                          given=given)
        log.info("the sweep's conf (each trial: these values, with its own from the space; a "
                 "field left at its built-in default takes the preset's value):\n%s",
                 config_table(sweep.trials[0]))
        rows = plan_rows(list(sweep.trials), list(sweep.values))
        log.info("%d trial(s), %d at once on %d node(s); prepared-data groups %s; the "
                 "planner's figures (finetune.run_plan) of each trial and their sum:\n%s",
                 len(sweep.trials), sweep.at_once, sweep.config.nodes, list(sweep.groups),
                 plan_table(rows, plan_totals(rows, sweep.at_once)))
        return sweep.to_dict()

    @task
    def prepare_groups(first_trials: list[dict]) -> list[dict]:
        """The prepared-data groups, each by its first trial's run config: one prepare_data
        each (Airflow maps a task over a task's return value only)."""
        return first_trials

    @task
    def trials(validated: dict, prepared: list[dict]) -> list[dict]:
        """Each trial's run config with the prepared set of its group (prepared once, by the
        group's first trial); refused, naming the trial, where the set's statistics forbid it."""
        from finetune.config import ConfigError, RunConfig
        from finetune.outputs import read_output
        from finetune.prepare_stage import share_prepared
        from finetune_contract.fields import PREPARE_DATA_FILE

        firsts = sorted(set(validated["groups"]))
        by_group = dict(zip(firsts, (RunConfig.from_dict(p) for p in prepared), strict=True))
        out, errors = [], []
        for i, (trial, group) in enumerate(zip(validated["trials"], validated["groups"],
                                               strict=True)):
            target, cfg = _target(trial)
            first = by_group[group]
            if i == group:
                out.append(first.to_dict())
                continue
            s3 = lambda target=target, cfg=cfg: target.s3_client(cfg)  # noqa: E731
            record = json.loads(read_output(first.run_dir, PREPARE_DATA_FILE, s3) or "{}")
            try:
                out.append(share_prepared(cfg, record, s3).to_dict())
            except ConfigError as exc:
                errors += [(f"trial {i}: {field}", message) for field, message in exc.errors]
            log.info("trial %d uses trial %d's prepared set %s", i, group, first.prepared_data)
        if errors:
            raise ConfigError(errors)
        return out

    @task
    def snapshot(run_config: dict) -> dict:
        """Setup: record what teardown restores (the node group's scaling config on eks)."""
        target, cfg = _target(run_config)
        return target.snapshot(cfg)

    @task.sensor(poke_interval=SLOT_POKE_S, mode="reschedule", timeout=SLOT_TIMEOUT)
    def wait_for_slot(run_config: dict) -> PokeReturnValue:
        """The trial's turn: at once for the first sweep_parallel trials; then when the train
        of the trial sweep_parallel before it has ended (its nodes free)."""
        from finetune.config import RunConfig

        cfg = RunConfig.from_dict(run_config)
        before = cfg.sweep_trial - cfg.sweep_parallel
        if before < 0:
            return PokeReturnValue(is_done=True)
        context = get_current_context()
        run_id = context["run_id"]
        states = context["ti"].get_task_states(
            dag_id=context["dag_run"].dag_id, map_index=before, task_ids=[TRIAL_TRAIN],
            run_ids=[run_id])
        state = (states.get(run_id) or {}).get(f"{TRIAL_TRAIN}_{before}")
        log.info("trial %d waits for trial %d's train (now %s)", cfg.sweep_trial, before, state)
        return PokeReturnValue(is_done=state in ENDED_STATES)

    @task(task_id="collect_metrics", trigger_rule="all_done", **RESUMABLE)
    def trial_report(run_config: dict) -> dict:
        """The trial's report in its run directory: the target's collect_metrics for a
        completed trial; a stopped or failed one's from what it left, saying why."""
        from finetune.sweep.reports import write_trial_report

        target, cfg = _target(run_config)
        return write_trial_report(target, cfg)

    @task(multiple_outputs=True, trigger_rule="all_done")
    def choose_winner(validated: dict, trial_configs: list[dict]) -> dict:
        """The completed trial with the lowest final eval loss; MLflow's parent and child runs;
        the sweep's report so far. Fails when no trial completed (teardown still runs)."""
        from airflow.sdk.exceptions import AirflowFailException

        from finetune.sweep.reports import sweep_outcomes, track_and_report

        context = get_current_context()
        target, sweep = _target(validated["sweep"])
        outcomes = sweep_outcomes(target, sweep, trial_configs, validated["values"])
        chosen = track_and_report(target, sweep, context["dag_run"].dag_id, outcomes)
        if chosen["winner"] is None:
            raise AirflowFailException("no trial completed: " + "; ".join(
                f"trial {o['cfg'].sweep_trial} {o['outcome']['outcome']}: "
                f"{o['outcome'].get('reason')}" for o in outcomes))
        return chosen

    @task
    def find_champion(run_config: dict) -> dict:
        """The DAG's champion in the MLflow registry ({} when none), for evaluate to measure."""
        return find_champion_of(run_config)

    @task(**RESUMABLE)
    def collect_metrics(run_config: dict, trained: dict) -> dict:
        return collect_run_metrics(run_config, trained)

    @task(outlets=[model_asset] if model_asset is not None else [])
    def promote(run_config: dict, summary: dict, champion_found: dict, sweep: dict,
                mlflow_run: dict | None) -> dict:
        """The winner through the single run's promotion (tracked in its trial's child run);
        its model asset event names the sweep and the winning trial."""
        return promote_model(run_config, summary, champion_found, model_asset,
                             event_extra={"sweep": sweep}, mlflow_run=mlflow_run)

    @task(trigger_rule="all_done", **RESUMABLE)
    def sweep_report(validated: dict, trial_configs: list[dict]) -> dict:
        """The sweep's report.json and report.html again, with the winner's evaluation and
        promotion; MLflow's parent run ended with them."""
        from finetune.sweep.reports import sweep_outcomes, track_and_report

        context = get_current_context()
        target, sweep = _target(validated["sweep"])
        outcomes = sweep_outcomes(target, sweep, trial_configs, validated["values"])
        chosen = track_and_report(target, sweep, context["dag_run"].dag_id, outcomes,
                                  final=True)
        # This task runs whatever came before it: the sweep's run fails here when the winner's
        # stages did (a rejected promotion is a skip, not a failure).
        run_id = context["run_id"]
        states = context["ti"].get_task_states(
            dag_id=context["dag_run"].dag_id, run_ids=[run_id],
            task_ids=["choose_winner", "evaluate", "collect_metrics", "promote"])
        failed = sorted(task for task, state in (states.get(run_id) or {}).items()
                        if state in ("failed", "upstream_failed"))
        if failed:
            from airflow.sdk.exceptions import AirflowFailException

            where = chosen["report"]["report_html"]
            raise AirflowFailException(f"the sweep's report is written ({where}), but "
                                       f"{', '.join(failed)} did not succeed")
        return chosen["report"]

    @task(**RESUMABLE)
    def teardown(sweep_config: dict, snapshot_result: dict, trial_configs: list[dict]) -> dict:
        """Every trial released (its processes or jobs, its rendezvous; a failed report where
        it has none), then the sweep's own teardown: its nodes given back once. Every step is
        tried; a step that failed fails the task after the others."""
        from finetune.sweep.records import SweepRecords

        target, sweep = _target(sweep_config)
        done: dict[str, Any] = {"trials": {}}
        problems = []
        for trial in trial_configs or []:
            _, cfg = _target(trial)
            try:
                done["trials"][cfg.sweep_trial] = target.release(cfg)
                SweepRecords(cfg.sweep_dir, lambda cfg=cfg: target.s3_client(cfg)) \
                    .forget_rendezvous(cfg.sweep_trial)
            except Exception as exc:
                problems.append(f"trial {cfg.sweep_trial}: {exc}")
        try:
            done["sweep"] = target.teardown(sweep, snapshot_result)
        except Exception as exc:
            problems.append(f"the sweep: {exc}")
        log.info("teardown: %s", done)
        if problems:
            raise RuntimeError("teardown incomplete: " + "; ".join(problems))
        return done

    validated = validate_sweep()
    prepared = StageOperator.partial(task_id="prepare_data", stage=Stage.PREPARE_DATA) \
        .expand(run_config=prepare_groups(validated["prepare"]))
    trial_configs = trials(validated, prepared.output)
    sweep_config = validated["sweep"]
    snap = snapshot(sweep_config)
    trial_configs >> snap
    up = StageOperator(task_id="scale_up", stage=Stage.SCALE_UP, run_config=sweep_config,
                       **RESUMABLE)
    snap >> up
    image = StageOperator(task_id="build_image", stage=Stage.BUILD_IMAGE,
                          run_config=sweep_config, **RESUMABLE)
    up >> image
    checked = StageOperator(task_id="preflight", stage=Stage.PREFLIGHT, run_config=sweep_config,
                            inputs={"image": image.output, "rendezvous": {}}, **RESUMABLE)

    @task_group(group_id=TRIAL_GROUP)
    def trial(run_config: dict) -> Any:
        """One trial: its turn, its training, its report."""
        turn = wait_for_slot(run_config)
        checked >> turn
        trained = TrialOperator(task_id="train", run_config=run_config,
                                inputs={"image": image.output}, **RESUMABLE,
                                **({"pool": pool} if pool else {}))
        reported = trial_report(run_config)
        turn >> trained >> reported
        return reported

    reports = trial.expand(run_config=trial_configs)
    chosen = choose_winner(validated, trial_configs)
    reports >> chosen
    champion_found = find_champion(sweep_config)
    evaluated = StageOperator(task_id="evaluate", stage=Stage.EVALUATE,
                              run_config=chosen["winner"],
                              inputs={"trained": chosen["trained"], "image": image.output,
                                      "champion": champion_found})
    metrics = collect_metrics(chosen["winner"], chosen["trained"])
    evaluated >> metrics
    promoted = promote(chosen["winner"], metrics, champion_found, chosen["sweep"],
                       chosen["mlflow_run"])
    final = sweep_report(validated, trial_configs)
    promoted >> final
    final >> teardown(sweep_config, snap, trial_configs).as_teardown(setups=snap)
