"""The one deferrable operator: `StageOperator` runs a long stage of whichever target the run
names (scale_up, build_image, train).

It calls the stage; a result is the task's return value (XCom); a `targets.Wait` defers the task
on its trigger (no worker slot held while nodes come up, an image builds or the job trains) and
resumes with the method the Wait names, which returns the result or the next Wait.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Iterator
from typing import Any

from airflow.sdk import BaseOperator

log = logging.getLogger(__name__)

# The framework's timeout backstops a trigger's own deadline (whose event says more).
DEFERRAL_GRACE_S = 300


@contextlib.contextmanager
def _no_retry_when_the_training_failed() -> Iterator[None]:
    """Retries are for lost tries (a worker, the scheduler, Airflow restarted), not for a
    training that failed by itself."""
    from airflow.sdk.exceptions import AirflowFailException

    from finetune.targets.base import TrainingFailed

    try:
        yield
    except TrainingFailed as exc:
        raise AirflowFailException(str(exc)) from exc


class StageOperator(BaseOperator):
    """Run `stage` of the run's target with `inputs` (templated: other tasks' results).

    target_options: the target's constructor options (poll intervals, timeouts), for tests and
    for DAGs that need another pace.
    """

    template_fields = ("run_config", "inputs")

    def __init__(self, *, stage: str, run_config: Any, inputs: dict[str, Any] | None = None,
                 target_options: dict[str, Any] | None = None, **kwargs: Any):
        from finetune.targets.base import Stage

        super().__init__(**kwargs)
        self.stage, self.run_config = Stage(stage), run_config  # ValueError: not a long stage
        self.inputs, self.target_options = inputs or {}, target_options or {}

    def _target(self) -> tuple[Any, Any]:
        from finetune.targets import run_target

        return run_target(self.run_config, **self.target_options)

    def execute(self, context: Any) -> dict:
        target, cfg = self._target()
        with _no_retry_when_the_training_failed():
            return self._result_or_defer(target.run_stage(self.stage, cfg, **self.inputs))

    def resume(self, context: Any, event: dict, resume: str, state: dict) -> dict:
        """Back from a trigger: the target's `resume` method takes its event."""
        target, cfg = self._target()
        with _no_retry_when_the_training_failed():
            return self._result_or_defer(target.resumer(resume)(cfg, event, state))

    def _result_or_defer(self, outcome: Any) -> dict:
        from finetune.targets.base import Wait

        if not isinstance(outcome, Wait):
            return outcome
        timeout = None
        if outcome.deadline is not None:
            timeout = datetime.timedelta(
                seconds=max(0.0, outcome.deadline - time.time()) + DEFERRAL_GRACE_S)
        self.defer(trigger=outcome.trigger, method_name="resume", timeout=timeout,
                   kwargs={"resume": outcome.resume_name, "state": outcome.state})

    def on_kill(self) -> None:
        """Killed on a worker: what the stage started is left as it is. A SIGTERM from a
        deployment or a lost heartbeat looks the same as a person's mark-failed here; the
        retry reattaches to (or adopts) what runs, and after a mark-failed teardown stops and
        deletes it. (While deferred, a mark-failed reaches the trigger's on_kill.)"""
        log.info("%s killed on its worker: what it started is left to its retry or to teardown",
                 self.task_id)
