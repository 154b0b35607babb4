"""How long Airflow takes to parse this project's DAG files and to serialize each DAG, as its DAG
processor does on every parse (each task's copy of each trigger-form Param is resolved, its
schema checked).

    PYTHONPATH=plugins:. AIRFLOW_HOME=.airflow .venv/bin/python -m bench.dag_parse [--repeat N]

Prints the parse time of the folder, then per DAG its Params, tasks and the median time of a
serialization, and how many Param resolutions one serialization makes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="serializations per DAG")
    args = parser.parse_args(argv)

    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.definitions.param import Param
    from airflow.serialization.serialized_objects import DagSerialization

    start = time.perf_counter()
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    print(f"parse of dags/: {time.perf_counter() - start:.2f} s, {len(bag.dags)} DAGs, "
          f"{len(bag.import_errors)} import errors")
    resolve = Param.resolve
    calls = 0

    def counted(self, *a, **kw):
        nonlocal calls
        calls += 1
        return resolve(self, *a, **kw)

    Param.resolve = counted
    try:
        for dag_id, dag in sorted(bag.dags.items()):
            times = []
            for _ in range(args.repeat):
                calls = 0
                start = time.perf_counter()
                DagSerialization.to_dict(dag)
                times.append(time.perf_counter() - start)
            print(f"{dag_id}: {len(dag.params)} params, {len(dag.tasks)} tasks, serialize "
                  f"{statistics.median(times) * 1e3:.0f} ms (median of {args.repeat}), "
                  f"{calls} Param resolutions")
    finally:
        Param.resolve = resolve
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
