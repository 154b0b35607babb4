"""The eks train stage outlives every Airflow process: a worker lost between creating the
PyTorchJob and deferring, and a restart of the triggerer, the scheduler and the api-server
during the wait, end with the same job adopted and the stage succeeding.

What a restart keeps is what the metadata DB keeps: the trigger's row and the task's resume
kwargs. `through_the_metadata_db` writes them with Airflow's own models and serialisation and
builds the trigger and the resume call from the rows alone, in a new operator instance, as a
new triggerer and a new worker would.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import kubernetes
import pytest
from airflow.sdk.exceptions import TaskDeferred

from finetune.operators import StageOperator
from finetune.targets.eks.manifests import (
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    job_name,
)
from tests.support.deferral import first_event, run_deferred, through_the_metadata_db
from tests.support.eks import NS, TrainingOperator, eks_config, jobs_of_run, train_operator


class WorkerLost(BaseException):
    """The worker's process ends here (SIGKILL, a lost node): nothing after it runs."""


@pytest.mark.slow
def test_a_worker_lost_between_creating_the_job_and_deferring_leaves_the_job_to_the_retry(
        cluster, monkeypatch):
    cfg = eks_config()
    with monkeypatch.context() as m:
        def lost(self, **kwargs):
            raise WorkerLost
        m.setattr(StageOperator, "defer", lost)
        with pytest.raises(WorkerLost):
            train_operator(cfg).execute({})
    (job,) = jobs_of_run(cluster, cfg)  # the first try created it, then died
    name = job["metadata"]["name"]
    kubernetes.client.CustomObjectsApi(cluster.api()).patch_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
        {"metadata": {"annotations": {"test/created-by": "the first try"}}})
    training = TrainingOperator(cluster, cfg, outcome="Succeeded")
    training.start()
    result, _ = run_deferred(train_operator(cfg))  # the retry, on another worker
    training.join(5)
    assert result["adopted"] is True and result["job"] == name
    (job,) = jobs_of_run(cluster, cfg)  # that one, never deleted and created again
    assert job["metadata"]["annotations"]["test/created-by"] == "the first try"


def test_the_train_wait_lives_in_the_metadata_db_and_new_processes_finish_the_same_job(
        cluster):
    """Each deferral goes through the metadata DB and comes back to a new operator (a new
    worker after a scheduler or api-server restart) and a trigger built from its row (a new
    triggerer); the job is the first try's, created once."""
    cfg = eks_config()
    running = threading.Event()  # held Running until the task has woken once, on any machine
    training = TrainingOperator(cluster, cfg, outcome="Succeeded", release=running)
    training.start()
    call, created, wakes = functools.partial(train_operator(cfg).execute, {}), None, 0
    for _ in range(200):
        try:
            result = call()
            break
        except TaskDeferred as deferred:
            trigger, method, kwargs = through_the_metadata_db(deferred)
            created = created or kwargs["state"]["job"]
            assert kwargs["state"]["job"] == created  # the same job in every resume
            event = asyncio.run(first_event(trigger))
            wakes += 1
            running.set()
            call = functools.partial(getattr(train_operator(cfg), method), {}, event=event,
                                     **kwargs)
    else:
        raise AssertionError("train never finished")
    training.join(5)
    assert result["job"] == job_name(cfg) and result["adopted"] is False
    assert wakes >= 2  # it woke up (streamed the log) and was rebuilt from the DB each time
    assert [j["metadata"]["name"] for j in jobs_of_run(cluster, cfg)] == [job_name(cfg)]
