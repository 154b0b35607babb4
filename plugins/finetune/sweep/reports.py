"""What a sweep's tasks make of its trials' outcomes: each trial's own report
(`write_trial_report`), the winner (`winner_of`), MLflow's parent and child runs and the
sweep's report (`track_and_report`: finetune.tracking.track_sweep,
finetune.report.sweep_report).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from finetune.config import RunConfig
from finetune.outputs import ReportUnavailable, build_report, read_output, trainer_root_cause
from finetune.report import REPORT_JSON
from finetune.report.sweep_report import (
    sweep_report,
    sweep_report_files,
    trial_row,
    write_sweep_report,
)
from finetune.run_plan import plan_run
from finetune.sweep.early_stop import trial_rungs
from finetune.sweep.records import SweepRecords
from finetune.sweep.trials import plan_rows, plan_totals
from finetune.tracking import end_sweep_run, track_sweep
from finetune_contract.parameters import SWEEP_PARAMETERS

log = logging.getLogger(__name__)

NO_OUTCOME = ("failed: its train task ended without an outcome (it failed before it could "
              "record one, or did not run: see the task's log)")


def _records(target: Any, cfg: RunConfig) -> SweepRecords:
    return SweepRecords(cfg.sweep_dir, lambda: target.s3_client(cfg))


def trial_outcome(target: Any, cfg: RunConfig) -> dict[str, Any]:
    """The trial's recorded outcome; a failed one, recorded, when its train left none."""
    records = _records(target, cfg)
    outcome = records.outcome(cfg.sweep_trial)
    if outcome is None:
        outcome = {"trial": cfg.sweep_trial, "outcome": "failed", "train": None,
                   "reason": NO_OUTCOME, "final_eval_loss": None}
        records.record_outcome(cfg.sweep_trial, outcome)
    return outcome


def write_trial_report(target: Any, cfg: RunConfig) -> dict[str, Any]:
    """The trial's report in its run directory: a completed trial's by the target's
    collect_metrics (as a single run's), a stopped or failed one's from what it left, with
    why it ended; its summary and outcome."""
    outcome = trial_outcome(target, cfg)
    if outcome["outcome"] == "completed":
        return {**target.collect_metrics(cfg, outcome["train"]), "outcome": "completed"}
    s3 = lambda: target.s3_client(cfg)  # noqa: E731
    error = None
    if outcome["outcome"] == "failed":
        error = trainer_root_cause(cfg.run_dir, s3) or {
            "stage": "train", "type": "TrialFailed", "message": outcome["reason"], "rank": None}
    if not cfg.run_dir.startswith("s3://"):  # a trial that failed before it wrote anything
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    try:
        summary = build_report(cfg.run_dir, s3, run_id=cfg.run_id, status=outcome["outcome"],
                               config=cfg.to_dict(),
                               stages={"train": outcome["train"]} if outcome["train"] else {},
                               error=error, node_hourly_price=cfg.node_hourly_price,
                               nodes=cfg.nodes, plan=plan_run(cfg).to_dict())
    except ReportUnavailable as exc:
        log.warning("trial %d: %s", cfg.sweep_trial, exc)
        summary = {"status": outcome["outcome"], "run_dir": cfg.run_dir, "warning": str(exc)}
    return {**summary, "outcome": outcome["outcome"], "reason": outcome["reason"]}


def sweep_outcomes(target: Any, sweep: RunConfig, trial_configs: list[dict],
                   values: list[dict]) -> list[dict[str, Any]]:
    """Every trial: its run config, values, outcome and report.json (None without one)."""
    out = []
    for trial, trial_values in zip(trial_configs, values, strict=True):
        cfg = RunConfig.from_dict(trial)
        text = read_output(cfg.run_dir, REPORT_JSON, lambda cfg=cfg: target.s3_client(cfg))
        try:
            report = json.loads(text) if text else None
        except ValueError:
            report = None
        out.append({"cfg": cfg, "values": trial_values, "outcome": trial_outcome(target, cfg),
                    "report": report})
    return out


def winner_of(outcomes: list[dict[str, Any]]) -> int | None:
    """The completed trial with the lowest final eval loss (the first of a tie); None when no
    trial completed with one."""
    losses = [(o["outcome"].get("final_eval_loss"), o["cfg"].sweep_trial) for o in outcomes
              if o["outcome"]["outcome"] == "completed"]
    known = [(loss, trial) for loss, trial in losses
             if isinstance(loss, int | float) and math.isfinite(loss)]
    return min(known)[1] if known else None


def track_and_report(target: Any, sweep: RunConfig, dag_id: str,
                     outcomes: list[dict[str, Any]], final: bool = False) -> dict[str, Any]:
    """The winner, MLflow's parent and child runs, and the sweep's report written; final: the
    parent run ended with the report beside it. What the winner's stages need."""
    winner = winner_of(outcomes)
    settings = {p.name: getattr(sweep, p.name) for p in SWEEP_PARAMETERS}
    warnings: list[str] = []
    try:
        tracked = track_sweep(sweep, dag_id, outcomes, winner, settings, final=final)
    except Exception as exc:  # the sweep's outcome stands without its tracking
        log.warning("MLflow tracking of the sweep failed: %s", exc)
        tracked = {"warning": f"MLflow tracking of the sweep failed: {exc}"}
    if tracked.get("warning"):
        warnings.append(tracked["warning"])
    trial_cfgs = [o["cfg"] for o in outcomes]
    planned = plan_rows(trial_cfgs, [o["values"] for o in outcomes])
    rows = [trial_row(o["cfg"].to_dict(), o["values"], o["outcome"], o["report"], plan)
            for o, plan in zip(outcomes, planned, strict=True)]
    winner_report = next((o["report"] for o in outcomes if o["cfg"].sweep_trial == winner), None)
    report = sweep_report(
        sweep.to_dict(), rows, winner=winner, settings=settings,
        rungs=trial_rungs(trial_cfgs[0]), plan_totals=plan_totals(
            planned, min(sweep.sweep_parallel, len(trial_cfgs))),
        winner_report=winner_report,
        tracking={k: v for k, v in tracked.items() if k != "children"}, warnings=warnings)
    files = sweep_report_files(report)
    where = write_sweep_report(sweep.run_dir, lambda: target.s3_client(sweep), files)
    log.info("the sweep's report: %s (winner: %s)", where["report_html"],
             "none" if winner is None else f"trial {winner}")
    if final and not tracked.get("warning"):
        try:
            end_sweep_run(sweep, tracked, files)
        except Exception as exc:
            log.warning("could not end the sweep's MLflow run: %s", exc)
    chosen = next((o for o in outcomes if o["cfg"].sweep_trial == winner), None)
    child = (tracked.get("children") or {}).get(winner)
    return {"winner": chosen["cfg"].to_dict() if chosen else None,
            "trained": chosen["outcome"]["train"] if chosen else None, "trial": winner,
            "mlflow_run": {"run_id": child} if child else None,
            "sweep": {"run_id": sweep.run_id, "winner_trial": winner,
                      "winner_run_id": chosen["cfg"].run_id if chosen else None,
                      "values": chosen["values"] if chosen else None,
                      "trials": len(outcomes), "report_html": where["report_html"]},
            "report": where}
