"""llm_finetune_scheduled: the same stages as llm_finetune, on a cron or data set schedule."""

from __future__ import annotations

from finetune.demo import load_dag


def test_scheduled_dag_reuses_the_stages_runs_one_at_a_time_and_trains_in_the_cluster_pool():
    dag, manual = load_dag("llm_finetune_scheduled"), load_dag("llm_finetune")
    assert sorted(dag.task_ids) == sorted(manual.task_ids)
    for task_id in dag.task_ids:
        assert dag.get_task(task_id).upstream_task_ids == \
            manual.get_task(task_id).upstream_task_ids, task_id
    assert dag.max_active_runs == 1 and not dag.catchup
    assert dag.get_task("train").pool == "finetune_cluster"
    assert manual.get_task("train").pool == "default_pool"  # manual runs: unchanged
    schedule = dag.timetable
    assert type(schedule).__name__ == "AssetOrTimeSchedule"
    assert schedule.timetable.expression == "0 3 * * 0"
    assert schedule.asset_condition.name == "finetune_dataset"
    assert [a.name for a in dag.get_task("promote").outlets] == [
        "llm_finetune_scheduled.model"]


def test_a_variable_that_is_not_json_fails_validate_naming_it_and_nothing_else_runs(
        monkeypatch, tmp_path, capfd):
    from finetune.demo import run_dag, task_results

    monkeypatch.setenv("AIRFLOW_VAR_LLM_FINETUNE_SCHEDULED", '{"max_steps": 5,')
    dag_run = run_dag({"output_dir": str(tmp_path)}, dag_id="llm_finetune_scheduled")
    captured = capfd.readouterr()
    assert "Variable llm_finetune_scheduled: is not valid JSON" in captured.out + captured.err
    states = task_results(dag_run)
    assert states["validate"] == "failed"
    assert all(state in ("upstream_failed", "None") for task, state in states.items()
               if task != "validate"), states
    assert list(tmp_path.iterdir()) == []
