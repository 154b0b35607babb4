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
