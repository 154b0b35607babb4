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
    assert [a.name for a in dag.get_task("collect_metrics").outlets] == [
        "llm_finetune_scheduled.model"]
