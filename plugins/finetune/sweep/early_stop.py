"""A sweep trial's training followed for the early-stopping rule (finetune.sweep.asha): the train
stage of each target asks `RungWatch.poll` while it follows the training; when the trial's eval
loss reaches a rung it is recorded in the sweep's directory (finetune.sweep.records) and judged
against what the other trials recorded there; a trial to stop is stopped gracefully by the
target (a notice: the step is saved) and its outcome says at which step and why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.outputs import read_output
from finetune.report import METRICS_FILE, parse_metrics
from finetune.sweep.asha import judge, rung_steps
from finetune.sweep.records import SweepRecords

log = logging.getLogger(__name__)

# How often a local train stage reads the trial's metrics.jsonl for a new rung.
LOCAL_POLL_S = 1.0


def is_trial(cfg: RunConfig) -> bool:
    return bool(cfg.sweep_dir) and cfg.sweep_trial >= 0


def first_rung(cfg: RunConfig) -> int:
    """The first rung's step: sweep_first_rung, or the trial's first eval_interval."""
    return cfg.sweep_first_rung or cfg.eval_interval


def trial_rungs(cfg: RunConfig) -> list[int]:
    """The steps at which the trial is judged, below its last step."""
    from finetune.run_plan import plan_run

    last = cfg.max_steps or plan_run(cfg).steps
    return rung_steps(first_rung(cfg), cfg.sweep_reduction_factor, last)


def stop_reason(stop: dict[str, Any], stopped_at: int | None) -> str:
    """The outcome's words for a trial the rule stopped."""
    at = stopped_at if stopped_at is not None else stop["step"]
    return (f"stopped at step {at} by the rule: eval loss {stop['eval_loss']:.4f}, rank "
            f"{stop['rank']} of {stop['of']} at rung {stop['rung']} (step {stop['step']}; the "
            f"best {stop['kept']} go on, reduction factor {stop['factor']})")


class RungWatch:
    """The trial `cfg`'s rungs, judged as its eval losses reach them. `poll()` returns the stop
    (once) when the rule stops the trial, else None. A retry finds the verdicts recorded and
    keeps them: a trial stopped at a rung is stopped again, never judged twice."""

    def __init__(self, cfg: RunConfig, s3_client: Callable[[], Any],
                 poll_interval_s: float = 0.0):
        self.cfg, self.s3_client = cfg, s3_client
        self.records = SweepRecords(cfg.sweep_dir, s3_client)
        self.rungs = trial_rungs(cfg)
        self.next_rung = 0
        self.stop: dict[str, Any] | None = None
        self.poll_interval_s, self._polled = poll_interval_s, 0.0

    def poll(self) -> dict[str, Any] | None:
        if self.stop is not None or self.next_rung >= len(self.rungs):
            return None
        now = time.monotonic()
        if now - self._polled < self.poll_interval_s:
            return None
        self._polled = now
        text = read_output(self.cfg.run_dir, METRICS_FILE, self.s3_client) or ""
        evals = {r["step"]: r.get("eval_loss") for r in parse_metrics(text.splitlines())[1]}
        while self.next_rung < len(self.rungs) and self.rungs[self.next_rung] in evals:
            step = self.rungs[self.next_rung]
            verdict = self._verdict(step, evals[step])
            self.next_rung += 1
            if not verdict["goes_on"]:
                self.stop = verdict
                log.warning("trial %d: %s", self.cfg.sweep_trial, stop_reason(verdict, None))
                return verdict
            log.info("trial %d goes on at rung %d (step %d): eval loss %.4f, rank %d of %d",
                     self.cfg.sweep_trial, verdict["rung"], step, verdict["eval_loss"],
                     verdict["rank"], verdict["of"])
        return None

    def _verdict(self, step: int, loss: Any) -> dict[str, Any]:
        trial, factor = self.cfg.sweep_trial, self.cfg.sweep_reduction_factor
        there = self.records.rung(step)
        if trial in there:  # judged before this try: the same verdict
            return there[trial]
        loss = float(loss) if isinstance(loss, int | float) else math.nan
        verdict = judge(loss, [float(r["eval_loss"]) for t, r in sorted(there.items())
                               if t != trial], factor)
        record = {"trial": trial, "step": step, "rung": self.rungs.index(step) + 1,
                  "eval_loss": loss, "goes_on": verdict.goes_on, "rank": verdict.rank,
                  "of": verdict.of, "kept": verdict.kept, "factor": factor,
                  "time": time.time()}
        self.records.record_rung(step, trial, record)
        return record
