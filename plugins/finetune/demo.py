"""Run `llm_finetune` once in this process (like `airflow dags test`) and say where outputs are.

    python -m finetune.demo [--conf '{"max_steps": 50}']

Exits non-zero when the DAG run fails. `make demo` calls this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from finetune import REPO_ROOT

DAG_ID = "llm_finetune"


def load_dag(dag_id: str = DAG_ID):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    if dag_id not in bag.dags:
        raise SystemExit(f"DAG {dag_id} did not load: {bag.import_errors}")
    return bag.dags[dag_id]


def run_dag(conf: dict, dag_id: str = DAG_ID):
    """One DAG run through Airflow in this process; returns the finished DagRun."""
    return load_dag(dag_id).test(run_conf=conf)


def task_results(dag_run) -> dict[str, str]:
    """task id -> final state, in the order the tasks started."""
    tis = sorted(dag_run.get_task_instances(),
                 key=lambda ti: (ti.start_date is None, ti.start_date or 0, ti.task_id))
    return {ti.task_id: str(ti.state) for ti in tis}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conf", default="{}", help="run parameters as a JSON object")
    args = parser.parse_args(argv)
    conf = json.loads(args.conf)
    dag_run = run_dag(conf)
    states = task_results(dag_run)
    print(f"\nDAG run {dag_run.run_id}: {dag_run.state}")
    for task_id, state in states.items():
        print(f"  {task_id:16s} {state}")
    from finetune.config import resolve_path
    from finetune.names import run_dir_name
    from finetune.report import mfu_text

    output_dir = resolve_path(conf.get("output_dir", "runs"))
    run_dir = Path(output_dir) / run_dir_name(dag_run.run_id)
    report = run_dir / "report.json"
    if report.is_file():
        m = json.loads(report.read_text())["metrics"]
        if m["initial_eval_loss"] and m["final_eval_loss"]:
            print(f"eval loss {m['initial_eval_loss']:.3f} -> {m['final_eval_loss']:.3f} "
                  f"({m['final_eval_loss'] / m['initial_eval_loss']:.2f}x) after {m['steps']} "
                  f"steps; {m['tokens_per_s'] or 0:.0f} tokens/s, MFU {mfu_text(m)}")
    print(f"run:    {run_dir}")
    print(f"model:  {run_dir / 'model'}")
    print(f"report: {report}")
    print(f"        {run_dir / 'report.html'}")
    return 0 if str(dag_run.state) == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
