"""A sweep's report: `report.json` and `report.html` in the sweep's directory, beside its
trials' own reports: every trial's values, outcome (completed, stopped by the rule at which
step and why, failed with its first cause), eval and train loss curves of all trials on one
chart each, the planner's figures beside what each trial cost, and the winner with its
evaluation and promotion.

report.json keeps the keys the runs page reads of a run's report (run_id, status, metrics: the
winner's, config, tracking, promotion), so a sweep is one row there, its report a link; the
page is templates/sweep_report.html.j2, its charts finetune.report.chart's.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune.pages import render
from finetune.report.chart import svg_line_chart
from finetune.report.formats import fmt, fmt_duration
from finetune.report.run_files import REPORT_HTML, REPORT_JSON

SCHEMA_VERSION = 1
OUTCOMES = ("completed", "stopped", "failed")


def trial_row(cfg: dict[str, Any], values: dict[str, Any], outcome: dict[str, Any],
              report: dict | None, planned: dict[str, Any] | None) -> dict[str, Any]:
    """One trial of the report: its values, outcome and why, its figures from its own report
    (report.json of its run directory) and what the planner expected of it."""
    metrics = (report or {}).get("metrics") or {}
    series = (report or {}).get("series") or {}
    return {
        "trial": cfg["sweep_trial"], "run_id": cfg["run_id"], "run_dir": cfg["run_dir"],
        "values": values, "outcome": outcome["outcome"], "reason": outcome.get("reason"),
        "final_eval_loss": outcome.get("final_eval_loss", metrics.get("final_eval_loss")),
        "steps": metrics.get("steps"), "wall_time_s": (outcome.get("train") or {}).get(
            "wall_time_s", metrics.get("wall_time_s")),
        "cost_usd": metrics.get("cost_usd"), "planned": planned,
        "series": {"eval": [[r["step"], r["eval_loss"]] for r in series.get("eval", [])
                            if r.get("eval_loss") is not None],
                   "train": [[r["step"], r["loss"]] for r in series.get("train", [])
                             if r.get("loss") is not None]},
        "report_html": f"{cfg['run_dir'].rstrip('/')}/{REPORT_HTML}" if report else None,
    }


def sweep_report(sweep: dict[str, Any], trials: list[dict[str, Any]], *, winner: int | None,
                 settings: dict[str, Any], rungs: list[int], plan_totals: dict[str, Any],
                 winner_report: dict | None = None, tracking: dict | None = None,
                 warnings: list[str] | None = None) -> dict[str, Any]:
    """The sweep's report.json: `sweep` its run config, `trials` trial_row's."""
    counts = {outcome: sum(t["outcome"] == outcome for t in trials) for outcome in OUTCOMES}
    measured = [t["cost_usd"] for t in trials]
    winner_metrics = dict((winner_report or {}).get("metrics") or {})
    return {
        "schema_version": SCHEMA_VERSION, "kind": "sweep", "run_id": sweep["run_id"],
        "status": "success" if winner is not None else "failed",
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": sweep,
        "metrics": {**winner_metrics, "trials": len(trials), **counts,
                    "cost_usd": sum(measured) if measured and None not in measured else None},
        "sweep": {"settings": settings, "rungs": rungs, "winner": winner,
                  "plan": plan_totals, "trials": trials},
        "error": None if winner is not None else {
            "stage": "choose_winner", "type": "NoTrialCompleted", "rank": None,
            "message": "no trial completed: " + "; ".join(
                f"trial {t['trial']} {t['outcome']}" + (f": {t['reason']}" if t["reason"]
                                                         else "") for t in trials)},
        "evaluation": (winner_report or {}).get("evaluation"),
        "promotion": (winner_report or {}).get("promotion"),
        "tracking": tracking,
        "warnings": list(warnings or []),
    }


def render_sweep_html(report: dict[str, Any]) -> str:
    """report.html of a sweep (templates/sweep_report.html.j2)."""
    sweep, trials = report["sweep"], report["sweep"]["trials"]
    winner = sweep["winner"]
    charts = [
        svg_line_chart({_name(t, winner): t["series"]["eval"] for t in trials},
                       "Eval loss by trial", "step", "eval loss"),
        svg_line_chart({_name(t, winner): t["series"]["train"] for t in trials},
                       "Train loss by trial", "step", "loss"),
    ]
    plan = sweep["plan"]
    promotion = report.get("promotion") or {}
    tracking = report.get("tracking") or {}
    return render(
        "sweep_report.html.j2", run_id=report["run_id"], status=report["status"],
        generated_at=report["generated_at"], error=report.get("error"), charts=charts,
        figures=[("trials", str(len(trials))),
                 *[(o, str(report["metrics"].get(o, 0))) for o in OUTCOMES],
                 ("winner", "none" if winner is None else f"trial {winner}"),
                 ("winner's eval loss", fmt(_winner_loss(trials, winner), ".4f")),
                 ("cost (measured)", fmt(report["metrics"].get("cost_usd"), ",.2f", " USD")),
                 ("cost (planned)", fmt(plan.get("cost_usd"), ",.2f", " USD"))],
        rungs=", ".join(str(step) for step in sweep["rungs"]) or "none",
        settings=[(k, json.dumps(v) if not isinstance(v, str) else v)
                  for k, v in sweep["settings"].items()],
        trials=[_trial_view(t, winner) for t in trials],
        promotion=promotion and {
            "decision": promotion.get("decision"), "metric": promotion.get("metric"),
            "challenger": fmt(promotion.get("challenger"), ".4f"),
            "champion": fmt(promotion.get("champion"), ".4f"),
            "margin": fmt(promotion.get("margin"), "g"), "reason": promotion.get("reason", "")},
        tracking=tracking if tracking.get("parent_run_id") or tracking.get("url") else None,
        warnings=report.get("warnings") or [])


def _name(trial: dict[str, Any], winner: int | None) -> str:
    return f"trial {trial['trial']}" + (" (winner)" if trial["trial"] == winner else "")


def _winner_loss(trials: list[dict[str, Any]], winner: int | None) -> float | None:
    return next((t["final_eval_loss"] for t in trials if t["trial"] == winner), None)


def _trial_view(trial: dict[str, Any], winner: int | None) -> dict[str, Any]:
    planned = trial.get("planned") or {}
    return {
        "trial": trial["trial"], "winner": trial["trial"] == winner,
        "varied": ", ".join(f"{k}={v}" for k, v in trial["values"].items()) or "(the conf)",
        "outcome": trial["outcome"], "reason": trial.get("reason") or "",
        "eval_loss": fmt(trial["final_eval_loss"], ".4f"),
        "steps": fmt(trial["steps"], ",.0f"), "wall_time": fmt_duration(trial["wall_time_s"]),
        "cost": fmt(trial["cost_usd"], ",.2f", " USD"),
        "planned": f"{fmt(planned.get('peak_gib'), '.1f', ' GiB')}, "
                   f"{fmt(planned.get('cost_usd'), ',.2f', ' USD')}",
        # beside the sweep's report: <sweep dir>/trial-<N>/report.html
        "report": trial["run_dir"].rstrip("/").rsplit("/", 1)[-1] + f"/{REPORT_HTML}"
        if trial.get("report_html") else None}


def sweep_report_files(report: dict[str, Any]) -> dict[str, str]:
    """The sweep report's files: name -> text."""
    return {REPORT_JSON: json.dumps(report, indent=2, default=str) + "\n",
            REPORT_HTML: render_sweep_html(report)}


def write_sweep_report(sweep_dir: str, s3_client: Callable[[], Any],
                       files: dict[str, str]) -> dict[str, str]:
    """The report's files (sweep_report_files) in the sweep's directory (a path or an S3
    prefix); where report.json and report.html are."""
    base = sweep_dir.rstrip("/")
    if base.startswith("s3://"):
        from finetune.outputs import split_s3

        bucket, prefix = split_s3(base)
        for name, content_type in ((REPORT_JSON, "application/json"),
                                   (REPORT_HTML, "text/html; charset=utf-8")):
            s3_client().put_object(Bucket=bucket, Key=f"{prefix}/{name}",
                                   Body=files[name].encode(), ContentType=content_type)
    else:
        Path(base).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():  # whole, as the runs page may read it meanwhile
            with tempfile.NamedTemporaryFile("w", dir=base, delete=False, suffix=".tmp",
                                             encoding="utf-8") as tmp:
                tmp.write(text)
            Path(tmp.name).replace(Path(base) / name)
    return {"report_json": f"{base}/{REPORT_JSON}", "report_html": f"{base}/{REPORT_HTML}"}
