"""The llm_finetune_sweep DAG, run for real through Airflow on the local target: a 4-trial sweep,
2 at a time, on the tiny model with one CPU process a trial: one trial stopped early by the rule,
one failing on purpose (a model directory validate accepts whose weights are missing), the best
evaluated and promoted, one prepare_data for the trials that share data and a second for the
trial whose seq_len differs; then the same sweep retried, adopting what ended; and a sweep with
one bad trial refused before any stage runs."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from finetune.demo import load_dag, run_dag, task_results
from finetune.names import run_dir_name
from finetune.targets.local.processes import trainer_processes
from tests.support.training import slow_trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "llm_finetune_sweep"
# Short trials: an eval every 4 steps, so the rule's rungs are steps 4 and 12 (factor 3).
TRIAL = {"max_steps": 16, "seq_len": 64, "micro_batch": 4, "eval_interval": 4,
         "checkpoint_interval": 4, "warmup_steps": 2, "eval_fraction": 0.01,
         "procs_per_node": 1, "preflight": False, "eval_tasks": "", "sample_prompts": 0}
SWEEP = {"sweep_parallel": 2, "sweep_reduction_factor": 3}
GOOD, LONGER, SLOW_LR, BROKEN = range(4)
STEP_DELAY_S = 0.4


def checkpoint_name(step: int) -> str:
    """The trainer's checkpoint directory of a step (trainer/checkpoint.py)."""
    return f"step_{step:08d}"


def sweep_conf(output_dir: Path, trials: list[dict]) -> dict:
    return {**TRIAL, **SWEEP, "output_dir": str(output_dir),
            "sweep_space": json.dumps({"trials": trials})}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_sweep_maps_the_stages_over_trials_with_one_scale_up_and_a_guaranteed_teardown():
    dag = load_dag(DAG_ID)
    up = {t: set(dag.get_task(t).upstream_task_ids) for t in dag.task_ids}
    assert up["prepare_data"] == {"prepare_groups"} and dag.get_task("prepare_data").is_mapped
    assert up["snapshot"] >= {"trials"} and dag.get_task("snapshot").is_setup
    assert up["scale_up"] >= {"snapshot"} and not dag.get_task("scale_up").is_mapped
    assert up["trial.wait_for_slot"] >= {"preflight", "trials"}
    assert up["trial.train"] >= {"trial.wait_for_slot", "build_image"}
    assert dag.get_task("trial.train").pool == "finetune_cluster"
    assert up["choose_winner"] >= {"trial.collect_metrics"}
    assert up["evaluate"] >= {"choose_winner", "find_champion"}
    assert up["promote"] >= {"collect_metrics", "find_champion"}
    assert dag.get_task("teardown").is_teardown
    # the form: the sweep's own fields, then every field of a run
    assert list(dag.params)[:2] == ["sweep_space", "sweep_max_trials"]
    assert "sweep_space" not in load_dag("llm_finetune").params
    # its doc (the UI's) describes every task and no other
    described = set(re.findall(r"^- \*\*([\w.]+)\*\*:", dag.doc_md, re.M))
    assert described == set(dag.task_ids)


def test_the_stages_a_new_try_resumes_are_retried_and_a_trials_failure_is_not_the_tasks():
    dag = load_dag(DAG_ID)
    for task_id in ("scale_up", "build_image", "preflight", "trial.train",
                    "trial.collect_metrics", "collect_metrics", "teardown"):
        assert dag.get_task(task_id).retries >= 1, task_id
    for task_id in ("validate_sweep", "snapshot", "choose_winner", "evaluate", "promote"):
        assert not dag.get_task(task_id).retries, task_id
    # what runs after the trials runs whatever each of them came to
    for task_id in ("trial.collect_metrics", "choose_winner", "sweep_report"):
        assert dag.get_task(task_id).trigger_rule == "all_done", task_id


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory) -> Path:
    """A model directory validate accepts (a Llama config.json of the architecture table) whose
    weights only loading them finds missing: that trial's training fails at start, by itself."""
    from transformers import AutoTokenizer

    from trainer.model import builtin_config

    path = tmp_path_factory.mktemp("broken") / "broken-model"
    builtin_config("tiny-llama", AutoTokenizer.from_pretrained("trainer/demo/tokenizer")) \
        .save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, broken_model):
    """One sweep of 4 trials, 2 at a time: (dag run, its conf, its directory, when it ran)."""
    output_dir = tmp_path_factory.mktemp("sweep")
    conf = sweep_conf(output_dir, [
        {},  # GOOD
        {"seq_len": 96},  # LONGER: the only trial of the second prepared-data group
        {"lr": 1e-5},  # SLOW_LR: far behind the two before it at the first rung
        {"model": str(broken_model), "tokenizer": "trainer/demo/tokenizer"},  # BROKEN
    ])
    when = datetime.now(UTC).replace(microsecond=0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FINETUNE_SLOT_POKE_S", "1")
        # The tiny model steps in milliseconds once warm: slowed, a trial outlives the second
        # or so the rule's notice takes to land after the rung (and its save is seen).
        slow_trainer(tmp_path_factory.mktemp("delays"), env, STEP_DELAY_S, 0.0)
        dag_run = load_dag(DAG_ID).test(run_after=when, logical_date=when, run_conf=conf)
    return dag_run, conf, output_dir / run_dir_name(dag_run.run_id), when


@pytest.mark.slow
def test_a_sweep_stops_one_trial_by_the_rule_contains_a_failure_and_promotes_the_best(
        sweep_run):
    dag_run, _, sweep_dir, _ = sweep_run
    states = {(ti.task_id, ti.map_index): str(ti.state) for ti in dag_run.get_task_instances()}
    assert str(dag_run.state) == "success", states
    assert states[("promote", -1)] == "success"
    # the stages a sweep shares ran once; one prepare_data per prepared-data group
    assert sorted(i for task, i in states if task == "prepare_data") == [0, 1]
    assert [i for task, i in states if task == "scale_up"] == [-1]
    assert sorted(i for task, i in states if task == "trial.train") == [0, 1, 2, 3]
    assert all(state == "success" for (task, _), state in states.items() if task != "promote")

    outcomes = [read_json(sweep_dir / "trials" / f"trial-{i}.json") for i in range(4)]
    assert [o["outcome"] for o in outcomes] == ["completed", "completed", "stopped", "failed"]
    # stopped by the rule at its first rung, gracefully: the step it was in saved
    stopped = outcomes[SLOW_LR]["train"]["stopped"]
    assert (stopped["rung"], stopped["step"], stopped["rank"], stopped["of"]) == (1, 4, 3, 3)
    at = stopped["stopped_at"]
    assert 4 <= at < TRIAL["max_steps"]
    assert outcomes[SLOW_LR]["reason"].startswith(
        f"stopped at step {at} by the rule: eval loss {stopped['eval_loss']:.4f}, rank 3 of 3 "
        "at rung 1")
    slow_dir = sweep_dir / f"trial-{SLOW_LR}"
    history = [json.loads(line) for line in (slow_dir / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in history if e["event"] == "preempted"] == [at]
    assert checkpoint_name(at) in {p.name for p in (slow_dir / "checkpoints").iterdir()}
    assert not (slow_dir / "model").exists()
    rung = {int(p.stem.split("-")[1]): read_json(p) for p in (sweep_dir / "rungs" / "step-4")
            .glob("trial-*.json")}
    assert sorted(rung) == [GOOD, LONGER, SLOW_LR] and rung[SLOW_LR]["goes_on"] is False
    assert rung[SLOW_LR]["eval_loss"] > max(rung[GOOD]["eval_loss"], rung[LONGER]["eval_loss"])
    # the failure contained, with its first cause, in the outcome and the trial's report
    assert outcomes[BROKEN]["reason"] == (
        f"failed: ValueError: {outcomes[BROKEN]['reason'].split('ValueError: ')[1]}")
    assert "has no safetensors weights" in outcomes[BROKEN]["reason"]
    broken_report = read_json(sweep_dir / f"trial-{BROKEN}" / "report.json")
    assert broken_report["status"] == "failed"
    assert "has no safetensors weights" in broken_report["error"]["message"]
    assert read_json(slow_dir / "report.json")["status"] == "stopped"

    # one prepared set for the trials that share data, a second for the longer seq_len
    cfgs = [read_json(sweep_dir / f"trial-{i}" / "trainer_config.json") for i in (0, 1, 2)]
    assert cfgs[GOOD]["prepared_data"] == cfgs[SLOW_LR]["prepared_data"] != \
        cfgs[LONGER]["prepared_data"]
    assert len(list((sweep_dir.parent / "prepared_data").iterdir())) == 2

    # the winner: the completed trial with the lowest final eval loss, evaluated and promoted
    report = read_json(sweep_dir / "report.json")
    losses = {i: outcomes[i]["final_eval_loss"] for i in (GOOD, LONGER)}
    winner = min(losses, key=lambda i: (losses[i], i))
    assert report["sweep"]["winner"] == winner and report["status"] == "success"
    assert report["promotion"]["decision"] == "first"
    winner_report = read_json(sweep_dir / f"trial-{winner}" / "report.json")
    assert winner_report["evaluation"]["loss"] > 0
    assert winner_report["promotion"]["decision"] == "first"
    rows = report["sweep"]["trials"]
    assert [r["outcome"] for r in rows] == ["completed", "completed", "stopped", "failed"]
    assert rows[SLOW_LR]["reason"] == outcomes[SLOW_LR]["reason"]
    assert [r["values"] for r in rows][:3] == [{}, {"seq_len": 96}, {"lr": 1e-5}]
    html = (sweep_dir / "report.html").read_text()
    assert "Eval loss by trial" in html and html.count("<polyline") >= 6
    assert "rank 3 of 3 at rung 1" in html and "has no safetensors weights" in html

    # the model asset event names the winning trial
    event = model_event(dag_run.run_id)
    assert event["sweep"]["winner_trial"] == winner
    assert event["sweep"]["winner_run_id"] == f"{dag_run.run_id}-trial-{winner}"

    # MLflow: a parent run, a child run per trial, the winner's with its promotion
    from mlflow import MlflowClient

    from finetune.config import RunConfig
    from finetune.tracking import tracking_uri

    client = MlflowClient(tracking_uri(RunConfig.from_dict(report["config"])))
    runs = client.search_runs([report["tracking"]["experiment_id"]])
    parent = [r for r in runs if r.info.run_id == report["tracking"]["parent_run_id"]]
    children = {r.data.tags["sweep.trial"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id}
    assert sorted(children) == ["0", "1", "2", "3"]
    assert children[str(SLOW_LR)].info.status == "KILLED"
    assert children[str(BROKEN)].info.status == "FAILED"
    assert children[str(winner)].data.tags["promotion"] == "first"

    # teardown left no trainer process of any trial
    for i in range(4):
        assert trainer_processes(str(sweep_dir / f"trial-{i}" / "trainer_config.json")) == []


def model_event(run_id: str) -> dict:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return session.scalars(select(AssetEvent.extra).join(
            AssetModel, AssetEvent.asset_id == AssetModel.id).where(
            AssetModel.name == f"{DAG_ID}.model", AssetEvent.source_run_id == run_id)).one()


@pytest.mark.slow
def test_a_retried_sweep_adopts_the_trials_that_ended_and_tries_the_failed_one_again(
        sweep_run):
    dag_run, conf, sweep_dir, when = sweep_run
    assert str(dag_run.state) == "success"
    winner = read_json(sweep_dir / "report.json")["sweep"]["winner"]
    summaries = {i: (sweep_dir / f"trial-{i}" / "summary.json").stat().st_mtime_ns
                 for i in (GOOD, LONGER)}
    metrics = {i: (sweep_dir / f"trial-{i}" / "metrics.jsonl").read_text() for i in range(3)}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FINETUNE_SLOT_POKE_S", "1")
        again = load_dag(DAG_ID).test(run_after=when, logical_date=when, run_conf=conf)
    assert again.run_id == dag_run.run_id  # the same sweep, its directory the same
    states = task_results(again)
    assert states["teardown"] == "success" and states["sweep_report"] == "success", states
    # completed and stopped trials adopted: nothing of theirs trained again
    assert {i: (sweep_dir / f"trial-{i}" / "summary.json").stat().st_mtime_ns
            for i in (GOOD, LONGER)} == summaries
    assert {i: (sweep_dir / f"trial-{i}" / "metrics.jsonl").read_text()
            for i in range(3)} == metrics
    outcomes = [read_json(sweep_dir / "trials" / f"trial-{i}.json") for i in range(4)]
    assert [o["outcome"] for o in outcomes] == ["completed", "completed", "stopped", "failed"]
    # the failed one was tried again (and fails again: its model has no weights)
    errors = sweep_dir / f"trial-{BROKEN}" / "train.log"
    assert errors.read_text().count("has no safetensors weights") >= 2
    # the same winner; its model is the champion now, so it is not promoted over itself
    assert read_json(sweep_dir / "report.json")["sweep"]["winner"] == winner
    assert states["promote"] == "skipped"


@pytest.mark.slow
def test_a_sweep_with_one_bad_trial_is_refused_naming_it_before_any_stage_runs(
        tmp_path, capfd):
    dag_run = run_dag(sweep_conf(tmp_path, [{}, {"micro_batch": 4000}]), DAG_ID)
    captured = capfd.readouterr()
    assert "- trial 1: micro_batch: " in captured.out + captured.err
    states = task_results(dag_run)
    assert str(dag_run.state) == "failed"
    assert states["validate_sweep"] == "failed"
    assert all(state in ("upstream_failed", "None", "skipped")
               for task, state in states.items() if task != "validate_sweep"), states
    assert list(tmp_path.iterdir()) == []  # nothing was created
