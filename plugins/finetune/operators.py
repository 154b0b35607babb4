"""The one deferrable operator: `StageOperator` runs a long stage of whichever target the run
names (scale_up, build_image, train); `TrialOperator` is its train stage for a sweep's trial.

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
def _no_retry_on_a_verdict() -> Iterator[None]:
    """Retries are for lost tries (a worker, the scheduler, Airflow restarted) and errors that
    may pass, not for a stage's definite verdict (`targets.base.VERDICTS`: a training that
    failed, capacity that did not come, an image not in ECR...): that fails the task at once,
    so teardown gives the nodes back now."""
    from airflow.sdk.exceptions import AirflowFailException

    from finetune.targets.base import VERDICTS

    try:
        yield
    except VERDICTS as exc:
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
        with _no_retry_on_a_verdict():
            return self._result_or_defer(target.run_stage(self.stage, cfg, **self.inputs))

    def resume(self, context: Any, event: dict, resume: str, state: dict) -> dict:
        """Back from a trigger: the target's `resume` method takes its event."""
        target, cfg = self._target()
        with _no_retry_on_a_verdict():
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


class TrialOperator(StageOperator):
    """A sweep trial's training (finetune.sweep): a clean rendezvous of its own, then the train
    stage as StageOperator runs it, the sweep's early-stopping rule following it
    (finetune.sweep.early_stop). It always ends in the trial's outcome, so the sweep goes on:

    - completed, with its final eval loss;
    - stopped by the rule: at which step and why (the step saved, its nodes free);
    - failed: its first cause (the trainer's own record, else the error). A verdict (a
      training that failed by itself, pods that cannot be scheduled, its deadline:
      `targets.base.VERDICTS`) fails the trial at once; another error (a lost try) is retried
      as StageOperator's are, and fails the trial on the last try.

    The outcome is recorded in the sweep's directory (finetune.sweep.records) before it is
    returned: a retry of the task or of the whole sweep adopts a completed or stopped trial
    instead of training it again (a failed one is tried again). The rendezvous is recorded
    too, so a retry that reattaches to a running training does not clear the store that
    training uses; the sweep's teardown forgets it. inputs: {"image": build_image's result}.
    """

    def __init__(self, *, run_config: Any, inputs: dict[str, Any] | None = None,
                 **kwargs: Any):
        from finetune.targets.base import Stage

        super().__init__(stage=Stage.TRAIN, run_config=run_config, inputs=inputs, **kwargs)

    def execute(self, context: Any) -> dict:
        target, cfg = self._target()
        records = self._records(target, cfg)
        ended = records.outcome(cfg.sweep_trial)
        if ended is not None and ended["outcome"] != "failed":
            log.info("trial %d ended before this try (%s): its outcome is taken as it is",
                     cfg.sweep_trial, ended["outcome"])
            return ended
        if ended is not None:
            log.info("trial %d failed before this try (%s): it is tried again",
                     cfg.sweep_trial, ended["reason"])
        try:
            rendezvous = records.rendezvous(cfg.sweep_trial)
            if rendezvous is None:
                rendezvous = target.rendezvous(cfg)
                records.record_rendezvous(cfg.sweep_trial, rendezvous)
            trained = self._result_or_defer(target.run_stage(
                self.stage, cfg, image=self.inputs["image"], rendezvous=rendezvous))
        except Exception as exc:
            return self._failed(context, target, cfg, exc)
        return self._ended(target, cfg, trained)

    def resume(self, context: Any, event: dict, resume: str, state: dict) -> dict:
        target, cfg = self._target()
        try:
            trained = self._result_or_defer(target.resumer(resume)(cfg, event, state))
        except Exception as exc:
            return self._failed(context, target, cfg, exc)
        return self._ended(target, cfg, trained)

    @staticmethod
    def _records(target: Any, cfg: Any) -> Any:
        from finetune.sweep.records import SweepRecords

        return SweepRecords(cfg.sweep_dir, lambda: target.s3_client(cfg))

    def _ended(self, target: Any, cfg: Any, trained: dict) -> dict:
        """The trial's training ended by itself or by the rule: its outcome, recorded."""
        import json

        from finetune.outputs import read_output
        from finetune.report import SUMMARY_FILE

        stopped = trained.get("stopped")
        summary = None if stopped else read_output(cfg.run_dir, SUMMARY_FILE,
                                                   lambda: target.s3_client(cfg))
        outcome = {"trial": cfg.sweep_trial, "outcome": "stopped" if stopped else "completed",
                   "train": trained, "reason": stopped["reason"] if stopped else None,
                   "final_eval_loss": json.loads(summary).get("final_eval_loss")
                   if summary else None}
        self._records(target, cfg).record_outcome(cfg.sweep_trial, outcome)
        log.info("trial %d %s%s", cfg.sweep_trial, outcome["outcome"],
                 f": {outcome['reason']}" if stopped else
                 f", final eval loss {outcome['final_eval_loss']}")
        return outcome

    def _failed(self, context: Any, target: Any, cfg: Any, exc: Exception) -> dict:
        """A failure of the trial as its outcome; an error a retry may get past is raised
        instead while tries are left."""
        from finetune.outputs import trainer_root_cause
        from finetune.targets.base import VERDICTS

        ti = context.get("ti") if isinstance(context, dict) else None
        last_try = ti is None or ti.try_number > self.retries
        if not (isinstance(exc, VERDICTS) or last_try):
            raise exc
        try:
            cause = trainer_root_cause(cfg.run_dir, lambda: target.s3_client(cfg))
        except Exception:  # the run directory unreadable: the error says what there is
            cause = None
        first = (f"{cause['type']}: {cause['message']}" if cause else
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        outcome = {"trial": cfg.sweep_trial, "outcome": "failed", "train": None,
                   "reason": f"failed: {first}"[:2000], "error": str(exc)[-4000:],
                   "final_eval_loss": None}
        self._records(target, cfg).record_outcome(cfg.sweep_trial, outcome)
        log.error("trial %d failed (the sweep goes on): %s", cfg.sweep_trial, exc)
        try:  # its job (pods restarting, or Pending) would hold the nodes the next trial needs
            target.release(cfg)
        except Exception as release_error:
            log.warning("trial %d: not all it started was stopped (%s); the sweep's teardown "
                        "releases it again", cfg.sweep_trial, release_error)
        return outcome
