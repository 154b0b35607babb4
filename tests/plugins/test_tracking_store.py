"""The local target's SQLite MLflow store, first touched by several tasks at once."""

import multiprocessing

import pytest

from finetune import tracking


def _first_use(uri: str, barrier, results) -> None:
    barrier.wait()  # every process creates the new store's tables at the same moment
    try:
        with tracking._client(uri) as client:
            client.search_experiments()
        results.put("ok")
    except Exception as exc:  # the failure is the result under test
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.slow
def test_tasks_first_using_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    processes = [context.Process(target=_first_use, args=(uri, barrier, results))
                 for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert outcomes == ["ok"] * 4, outcomes
