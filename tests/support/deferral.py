"""Driving deferrable operators and triggers as Airflow does: the trigger serialised and built
again (as the triggerer gets it), run to its first event, and the event into the method the
deferral names."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
from typing import Any

from airflow.sdk.exceptions import TaskDeferred


def reloaded(trigger: Any) -> Any:
    """The trigger as the triggerer gets it: serialised to JSON and built again."""
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    return getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))


async def first_event(trigger: Any) -> dict:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def run_deferred(operator: Any, max_defers: int = 200) -> tuple[Any, list[dict]]:
    """Run an operator to the end, each deferral's trigger inline: (result, events). The
    trigger and the resume kwargs go through JSON, as they go through the metadata DB."""
    call, events = functools.partial(operator.execute, {}), []
    for _ in range(max_defers):
        try:
            return call(), events
        except TaskDeferred as deferred:
            event = asyncio.run(first_event(reloaded(deferred.trigger)))
            events.append(event)
            kwargs = json.loads(json.dumps(deferred.kwargs or {}))
            call = functools.partial(getattr(operator, deferred.method_name), {}, event=event,
                                     **kwargs)
    raise AssertionError(f"still deferring after {max_defers} deferrals")


def through_the_metadata_db(deferred: TaskDeferred) -> tuple[Any, str, dict]:
    """A deferral as it survives every Airflow process: the task runner's serialisation of the
    trigger and the resume kwargs, the trigger's row written to the metadata DB (Airflow's own
    `Trigger` model, committed), then read back in a new session and built as the triggerer
    builds it; the resume kwargs as the task runner gets them back (the TI's JSON column).
    Returns (trigger, method name, resume kwargs); nothing else of the deferring process is
    kept."""
    from airflow._shared.module_loading import import_string
    from airflow.models.trigger import Trigger
    from airflow.sdk.serde import deserialize, serialize
    from airflow.serialization.decoders import smart_decode_trigger_kwargs
    from airflow.utils.session import create_session

    classpath, trigger_kwargs = deferred.trigger.serialize()
    next_kwargs = json.dumps(serialize(deferred.kwargs or {}))  # the TI's next_kwargs column
    with create_session() as session:
        row = Trigger(classpath=classpath, kwargs=serialize(trigger_kwargs))
        session.add(row)
        session.flush()
        trigger_id = row.id
    with create_session() as session:  # as the triggerer reads it
        row = session.get(Trigger, trigger_id)
        stored_classpath, encrypted = row.classpath, row.encrypted_kwargs
        session.delete(row)
    kwargs = {k: smart_decode_trigger_kwargs(v)
              for k, v in Trigger._decrypt_kwargs(encrypted).items()}
    trigger = import_string(stored_classpath)(**kwargs)
    return trigger, deferred.method_name, deserialize(json.loads(next_kwargs))


def task_outcome(task: Any, tries_left: bool) -> str:
    """The state Airflow's task runner gives `task` (in a DAG) after a try that ends as its
    execute ends, the API server saying whether a retry is left (`tries_left`): "success",
    "failed", "up_for_retry", "deferred"... Airflow's own decision, in this process: the
    supervisor's channel stood in for, nothing sent anywhere."""
    import datetime
    from types import SimpleNamespace
    from unittest import mock

    import structlog
    from airflow.sdk.api.datamodels._generated import TIRunContext
    from airflow.sdk.execution_time import task_runner

    server = TIRunContext.model_construct(
        should_retry=tries_left, xcom_keys_to_clear=[], next_method=None, next_kwargs=None,
        dag_run=SimpleNamespace(team_name=None))
    ti = task_runner.RuntimeTaskInstance.model_construct(
        id="0190ddd1-0000-7000-8000-000000000000", task=task, dag_id=task.dag_id,
        task_id=task.task_id, run_id="manual__test", try_number=1, map_index=-1,
        max_tries=task.retries, start_date=datetime.datetime.now(datetime.UTC))
    ti._ti_context_from_server = server
    with mock.patch.object(task_runner, "SUPERVISOR_COMMS", mock.MagicMock(), create=True):
        state, _, _ = task_runner._run_task_and_map_outcome(
            ti, {"ti": ti, "task": task}, structlog.get_logger())
    return str(state.value)
