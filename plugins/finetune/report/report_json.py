"""The report as data: a run directory -> `report.json` (the headline metrics, the series, cost,
the planner's estimate beside what was measured, stragglers, hangs, preflight, evaluation, the
prepared data and a mixture's sources with their eval loss each, the error of a failed run,
warnings), written with its `report.html` beside it; and the sections the promote stage adds
later.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune.goodput import goodput
from finetune.report.report_html import render_html
from finetune.report.run_files import (
    METRICS_FILE,
    MODEL_DIR,
    REPORT_HTML,
    REPORT_JSON,
    SUMMARY_FILE,
    finite,
    hang_notes,
    load_evaluation,
    load_history,
    load_metrics,
    load_summary,
    read_object,
)
from finetune_contract.fields import (
    DPO_METRICS,
    EVALUATION_FILE,
    PREPARE_DATA_FILE,
    STRAGGLER_THRESHOLD,
)
from finetune_contract.parameters import without_secrets
from finetune_contract.preflight_result import PREFLIGHT_FILE
from finetune_contract.stragglers import RANK_STEP_TIMES, rank_medians, stragglers
from finetune_contract.throughput import run_throughput

SCHEMA_VERSION = 1
STATUSES = ("success", "failed", "stopped")  # stopped: a sweep's trial its rule stopped

TRAIN_SERIES_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu")
MAX_ERROR_CHARS = 2000


def write_report(
    run_dir: Path,
    *,
    run_id: str,
    status: str,
    config: dict,
    stages: dict | None = None,
    gpu: dict | None = None,
    host: dict | None = None,
    node_hourly_price: float | None = None,
    nodes: int | None = None,
    error: dict | None = None,
    plan: dict | None = None,
) -> dict:
    """Build the report for `run_dir`, write `report.json` and `report.html` there, return it.

    gpu: the GPU section (finetune.gpu_metrics: DCGM from Prometheus, or NVML samples);
    host: this machine's CPU and memory during training (local target). With
    `node_hourly_price` (USD per node-hour) and `nodes` the report estimates the cost of the
    training wall time. error: why a failed run failed ({"stage", "type", "message", "rank"}:
    the trainer's own root cause, finetune_contract/errors.py, or the failed stage's error).
    plan: the planner's estimate made at validate (finetune.run_plan.RunPlan.to_dict()), put beside
    what was measured.
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    run_dir = Path(run_dir)
    # a run that failed before the trainer started still gets a report
    run_dir.mkdir(parents=True, exist_ok=True)

    warnings: list[str] = []
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        warnings.append(f"{METRICS_FILE} missing: no training steps were logged")
    train, evals, bad_lines = load_metrics(metrics_path)
    if bad_lines:
        warnings.append(f"{bad_lines} unreadable lines in {METRICS_FILE}")
    summary, summary_warning = load_summary(run_dir / SUMMARY_FILE)
    if summary_warning:
        warnings.append(summary_warning)
    warnings.extend(_summary_notes(summary))
    series = _series(train, evals)
    diverged = sum(1 for r in train if r.get("loss") is not None and finite(r["loss"]) is None)
    if diverged:
        warnings.append(f"{diverged} train steps with a non-finite loss")

    warnings.extend(hang_notes(run_dir))
    ranks = rank_step_times(train, config)
    warnings.extend(
        f"rank {s['rank']} is a straggler: median step time {s['median_step_time_s']:.3g} s, "
        f"{s['slower']:.0%} slower than the ranks' median {s['ranks_median_s']:.3g} s"
        for s in (ranks or {}).get("stragglers", [])
    )

    preflight, preflight_problem = read_object(run_dir / PREFLIGHT_FILE)
    if preflight_problem:
        warnings.append(preflight_problem)
    if preflight and not preflight.get("ok"):
        warnings.append("preflight found bad node(s): " + "; ".join(
            [", ".join(preflight.get("bad_nodes") or []) or "none to blame",
             *(preflight.get("problems") or [])]))

    evaluation, evaluation_warning = load_evaluation(run_dir / EVALUATION_FILE)
    if evaluation_warning:
        warnings.append(evaluation_warning)
    data, data_problem = read_object(run_dir / PREPARE_DATA_FILE)
    if data_problem:
        warnings.append(data_problem)
    metrics = summarize(train, evals, summary)
    held = run_goodput(load_history(run_dir), train, stages, nodes,
                       node_hourly_price)
    if held:
        metrics["goodput"] = held["goodput"]
        metrics["preemptions"] = held["preemptions"]
    cost = cost_estimate(node_hourly_price, nodes, _train_wall_time(stages, metrics))
    metrics["cost_usd"] = cost["usd"] if cost else None
    if gpu:
        warnings.extend(gpu.get("warnings") or [])
        if gpu.get("missing"):
            warnings.append(gpu["missing"])
    report = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "status": status,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": without_secrets(config),
        "stages": stages or {},
        "metrics": metrics,
        "cost": cost,
        "plan": plan_vs_measured(plan, metrics, cost, _device(stages)),
        "goodput": held,
        "gpu": gpu,
        "host": host,
        "series": series,
        "artifacts": {
            "model": MODEL_DIR if (run_dir / MODEL_DIR).is_dir() else None,
            "metrics": METRICS_FILE if metrics_path.is_file() else None,
            "report_html": REPORT_HTML,
        },
        "warnings": warnings,
        "error": failure_error(error),
        "rank_step_times": ranks,
        "preflight": preflight,
        "evaluation": evaluation,
        "data": data_section(data),
        "eval_loss_by_source": eval_loss_by_source(evals, summary),
        "promotion": None,  # the promote stage's (add_sections)
        "tracking": None,
    }
    # default=str: a config may carry Paths or datetimes; the report must still be written
    _write_atomic(run_dir / REPORT_JSON, json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(run_dir / REPORT_HTML, render_html(report))
    return report


def add_sections(run_dir: Path, **sections: Any) -> dict:
    """Set top-level sections of an existing report.json (the promote stage's `promotion` and
    `tracking`), add their warnings, and render report.html again; returns the report."""
    run_dir = Path(run_dir)
    report = json.loads((run_dir / REPORT_JSON).read_text(encoding="utf-8"))
    warnings = sections.pop("warnings", [])
    report.update(sections)
    report["warnings"] = list(report.get("warnings") or []) + list(warnings)
    _write_atomic(run_dir / REPORT_JSON, json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(run_dir / REPORT_HTML, render_html(report))
    return report


def summarize(train: list[dict], evals: list[dict], summary: dict | None) -> dict:
    """Headline metrics: from `summary` where it has a value, else computed from the series.

    Computed values: initial/final eval loss = first/last eval record; throughput figures =
    finetune_contract.throughput (total tokens over total step time, steps after the first,
    which include compilation and warm-up; the median step); peak memory = max; steps = last
    train step. wall_time_s and world_size are only known from the summary and stay None
    without it.
    """
    throughput = run_throughput(train)
    computed: dict[str, Any] = {
        "initial_eval_loss": finite(evals[0].get("eval_loss")) if evals else None,
        "final_eval_loss": finite(evals[-1].get("eval_loss")) if evals else None,
        "tokens_per_s": throughput["tokens_per_s"],
        "tflops_per_device": throughput["tflops_per_device"],
        "mfu": throughput["mfu"],
        "median_step_time_s": throughput["median_step_time_s"],
        "median_step_tokens_per_s": throughput["median_step_tokens_per_s"],
        "peak_memory_bytes": max(
            (v for v in (finite(r.get("peak_memory_bytes")) for r in train) if v is not None),
            default=None,
        ),
        "wall_time_s": None,
        "time_to_first_step_s": None,  # the trainer's, from its summary
        "data_load_s": None,
        "steps": train[-1]["step"] if train else None,
        "world_size": None,
    }
    metrics = {}
    for key, fallback in computed.items():
        reported = finite((summary or {}).get(key))
        metrics[key] = fallback if reported is None else reported
    initial, final = metrics["initial_eval_loss"], metrics["final_eval_loss"]
    metrics["eval_loss_ratio"] = final / initial if initial and final is not None else None
    source = (summary or {}).get("peak_flops_source")
    metrics["peak_flops_source"] = source if isinstance(source, str) else None
    return metrics


def eval_loss_by_source(evals: list[dict], summary: dict | None) -> dict | None:
    """A mixture's eval loss per source: {name: {"initial", "final"}}, from the summary where
    it has them, else the first and last eval records; None for one data set."""
    first = (summary or {}).get("initial_eval_loss_by_source") or \
        (evals[0].get("eval_loss_by_source") if evals else None)
    last = (summary or {}).get("final_eval_loss_by_source") or \
        (evals[-1].get("eval_loss_by_source") if evals else None)
    if not isinstance(first, dict) and not isinstance(last, dict):
        return None
    first, last = first if isinstance(first, dict) else {}, last if isinstance(last, dict) else {}
    return {name: {"initial": finite(first.get(name)), "final": finite(last.get(name))}
            for name in dict.fromkeys([*first, *last])}


def _series(train: list[dict], evals: list[dict]) -> dict[str, list[dict]]:
    return {
        # a dpo run's records also hold its rewards
        "train": [{key: finite(r.get(key)) for key in TRAIN_SERIES_KEYS
                   + tuple(k for k in DPO_METRICS if k in r)} for r in train],
        # a mixture's also hold the eval loss per source
        "eval": [{"step": r["step"], "eval_loss": finite(r.get("eval_loss")),
                  **({"eval_loss_by_source": {name: finite(loss) for name, loss in
                                              r["eval_loss_by_source"].items()}}
                     if isinstance(r.get("eval_loss_by_source"), dict) else {})}
                 for r in evals],
    }


def _summary_notes(summary: dict | None) -> list[str]:
    """Facts from the summary a reader should not miss when judging the numbers."""
    if not summary:
        return []
    notes = []
    if finite(summary.get("resumed_from_step")):
        notes.append(f"run resumed from step {summary['resumed_from_step']}")
    if finite(summary.get("skipped_rows")):
        reasons = summary.get("skipped_rows_by_reason")
        detail = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(
            reasons.items())) if isinstance(reasons, dict) else ""
        notes.append(f"{summary['skipped_rows']} dataset rows skipped"
                     + (f" ({detail})" if detail else ""))
    return notes


def rank_step_times(train: list[dict], config: dict) -> dict | None:
    """Each rank's median step time (the trainer's `rank_step_time_s`) and the stragglers:
    ranks slower than the ranks' median by more than the run's straggler_threshold."""
    per_step = [r[RANK_STEP_TIMES] for r in train if isinstance(r.get(RANK_STEP_TIMES), list)
                and all(finite(t) is not None for t in r[RANK_STEP_TIMES])]
    if not per_step:
        return None
    threshold = finite(config.get("straggler_threshold")) or STRAGGLER_THRESHOLD
    return {"threshold": threshold, "median_step_time_s": rank_medians(per_step),
            "stragglers": stragglers(per_step, threshold)}


def data_section(record: dict | None) -> dict | None:
    """The prepare_data stage's record (finetune.prepare_stage) as the report shows it."""
    if not record:
        return None
    keys = ("path", "cache_hit", "seconds", "num_proc", "dataset", "row_format", "rows_read",
            "rows_kept", "skipped_rows", "skipped_rows_by_reason", "longest_skipped_rows",
            "train_rows", "eval_rows", "train_examples", "eval_examples", "packing", "seq_len",
            "tokens", "tokens_per_epoch", "length_histogram", "eval_dataset", "sources")
    return {key: record.get(key) for key in keys}


def failure_error(error: dict | None) -> dict | None:
    """The report's `error`: stage, type, message (cut) and rank, nothing else."""
    if not error:
        return None
    return {"stage": str(error.get("stage") or "unknown"), "type": str(error.get("type") or ""),
            "message": str(error.get("message") or "")[:MAX_ERROR_CHARS],
            "rank": error.get("rank") if isinstance(error.get("rank"), int) else None}


def run_goodput(history: list[dict], train: list[dict], stages: dict | None, nodes: int | None,
                node_hourly_price: float | None) -> dict | None:
    """The goodput (finetune.goodput) of the train stage's window: from its nodes being there
    (its `held_from`, else its start) to its end."""
    trained = (stages or {}).get("train") or {}
    started, ended = trained.get("held_from") or trained.get("started"), trained.get("ended")
    if not history or started is None or ended is None:
        return None
    return goodput(history, train, held_from=started, held_until=ended,
                   nodes=trained.get("nodes") or nodes or 1,
                   node_hourly_price=node_hourly_price or 0.0,
                   capacity_wait_node_s=trained.get("capacity_wait_node_s") or 0.0)


def cost_estimate(node_hourly_price: float | None, nodes: int | None,
                  wall_time_s: float | None) -> dict | None:
    """nodes x price per node-hour x training wall time; None when any of them is unknown."""
    if not node_hourly_price or not nodes or wall_time_s is None:
        return None
    hours = wall_time_s / 3600
    return {"node_hourly_price_usd": node_hourly_price, "nodes": nodes,
            "hours": hours, "usd": round(node_hourly_price * nodes * hours, 2)}


def _train_wall_time(stages: dict | None, metrics: dict) -> float | None:
    """The train stage's wall time (what the nodes were busy for), else the trainer's own."""
    train = (stages or {}).get("train")
    wall = finite(train.get("wall_time_s")) if isinstance(train, dict) else None
    return wall if wall is not None else finite(metrics.get("wall_time_s"))


def plan_vs_measured(plan: dict | None, metrics: dict, cost: dict | None,
                     device: str | None) -> dict | None:
    """The planner's estimate beside the run's measurements, with the relative error of each
    (estimate / measured - 1); n/a where either side is missing. A CPU's peak is the process's
    memory, not a GPU's: no memory comparison there."""
    if not plan:
        return None
    peak = finite(metrics.get("peak_memory_bytes"))
    measured = {
        "peak_gib": peak / 2**30 if peak is not None and device != "cpu" else None,
        "step_time_s": finite(metrics.get("median_step_time_s")),
        "tokens_per_s_per_gpu": (finite(metrics.get("tokens_per_s")) or 0) / metrics[
            "world_size"] if metrics.get("world_size") and metrics.get("tokens_per_s") else None,
        "wall_time_s": finite(metrics.get("wall_time_s")),
        "cost_usd": cost["usd"] if cost else None,
    }
    rows = {}
    for key, actual in measured.items():
        estimated = finite(plan.get(key))
        rows[key] = {"estimate": estimated, "measured": actual,
                     "error": estimated / actual - 1 if estimated is not None and actual else None}
    notes = [plan["note"]] if plan.get("note") else []
    if device == "cpu":
        notes.append("memory: n/a on a CPU (the process's memory is not a GPU peak)")
    return {"compared": rows, "settings": {k: plan.get(k) for k in (
        "activation_checkpointing", "activation_offload", "selective_ac", "chosen", "fits")},
        "notes": notes}


def _device(stages: dict | None) -> str | None:
    train = (stages or {}).get("train")
    resources = train.get("resources") if isinstance(train, dict) else None
    return resources.get("device") if isinstance(resources, dict) else None


def _write_atomic(path: Path, text: str) -> None:
    # readers (the UI, a later task) never see a half-written report
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
