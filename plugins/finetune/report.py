"""Run report: a trainer's run directory -> `report.json` and a self-contained `report.html`.

Standard library only: this runs in the Airflow worker, which has neither torch nor plotting
libraries, and the page must open offline (no scripts, no external resources).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune.pages import Markup, render
from finetune_contract.errors import ERRORS_DIR
from finetune_contract.fields import (
    DPO_METRICS,
    EVALUATION_FILE,
    PREPARE_DATA_FILE,
    STRAGGLER_THRESHOLD,
)
from finetune_contract.preflight_result import PREFLIGHT_FILE
from finetune_contract.stragglers import RANK_STEP_TIMES, rank_medians, stragglers
from finetune_contract.throughput import run_throughput

SCHEMA_VERSION = 1
STATUSES = ("success", "failed")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
MODEL_DIR = "model"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"

TRAIN_SERIES_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu")

GIB = 1024**3
MIB = 1024**2


# --- reading the run directory ---------------------------------------------------------------


def load_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """Read `metrics.jsonl` -> (train records, eval records, unreadable line count).

    Records are sorted by step; when a step appears more than once (a resumed run logs it
    again) the last record wins. A missing file reads as empty.
    """
    path = Path(path)
    if not path.is_file():
        return [], [], 0
    with path.open(encoding="utf-8", errors="replace") as f:
        train, evals, bad_lines, _ = parse_metrics(f)
    return train, evals, bad_lines


def parse_metrics(lines: Iterable[str]) -> tuple[list[dict], list[dict], int, dict | None]:
    """metrics.jsonl's lines -> (train records, eval records, unreadable line count, the last
    data record: rows and max_steps), as load_metrics reads them."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    data = None
    bad_lines = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad_lines += 1
            continue
        step = record.get("step") if isinstance(record, dict) else None
        # bool is an int subclass; a record without an integer step cannot be placed
        if not isinstance(step, int) or isinstance(step, bool):
            bad_lines += 1
            continue
        if record.get("type") == "train":
            train[step] = record
        elif record.get("type") == "eval":
            evals[step] = record
        elif record.get("type") == "data":
            data = record
        # other record types are the trainer's business, not unreadable
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], bad_lines, data


def _read_object(path: Path) -> tuple[dict | None, str | None]:
    """A JSON object file of the run -> (object or None, why it is unusable or None); a missing
    file is (None, None)."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path.name} unreadable ({exc})"
    if not isinstance(data, dict):
        return None, f"{path.name} is not an object"
    return data, None


def _load_summary(path: Path) -> tuple[dict | None, str | None]:
    """Read `summary.json` -> (summary or None, warning or None)."""
    if not path.is_file():
        return None, f"{SUMMARY_FILE} missing: training did not finish"
    summary, problem = _read_object(path)
    if problem:
        return None, f"{problem}: metrics computed from {METRICS_FILE}"
    return summary, None


# --- numbers ---------------------------------------------------------------------------------


def _finite(value: Any) -> float | int | None:
    """The value if it is a finite number, else None (JSON has no NaN, and None is honest)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _mean(values: list[Any]) -> float | None:
    nums = [v for v in (_finite(x) for x in values) if v is not None]
    return sum(nums) / len(nums) if nums else None


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
        "initial_eval_loss": _finite(evals[0].get("eval_loss")) if evals else None,
        "final_eval_loss": _finite(evals[-1].get("eval_loss")) if evals else None,
        "tokens_per_s": throughput["tokens_per_s"],
        "tflops_per_device": throughput["tflops_per_device"],
        "mfu": throughput["mfu"],
        "median_step_time_s": throughput["median_step_time_s"],
        "median_step_tokens_per_s": throughput["median_step_tokens_per_s"],
        "peak_memory_bytes": max(
            (v for v in (_finite(r.get("peak_memory_bytes")) for r in train) if v is not None),
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
        reported = _finite((summary or {}).get(key))
        metrics[key] = fallback if reported is None else reported
    initial, final = metrics["initial_eval_loss"], metrics["final_eval_loss"]
    metrics["eval_loss_ratio"] = final / initial if initial and final is not None else None
    source = (summary or {}).get("peak_flops_source")
    metrics["peak_flops_source"] = source if isinstance(source, str) else None
    return metrics


def _series(train: list[dict], evals: list[dict]) -> dict[str, list[dict]]:
    return {
        # a dpo run's records also hold its rewards
        "train": [{key: _finite(r.get(key)) for key in TRAIN_SERIES_KEYS
                   + tuple(k for k in DPO_METRICS if k in r)} for r in train],
        "eval": [{"step": r["step"], "eval_loss": _finite(r.get("eval_loss"))} for r in evals],
    }


def _summary_notes(summary: dict | None) -> list[str]:
    """Facts from the summary a reader should not miss when judging the numbers."""
    if not summary:
        return []
    notes = []
    if _finite(summary.get("resumed_from_step")):
        notes.append(f"run resumed from step {summary['resumed_from_step']}")
    if _finite(summary.get("skipped_rows")):
        reasons = summary.get("skipped_rows_by_reason")
        detail = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(
            reasons.items())) if isinstance(reasons, dict) else ""
        notes.append(f"{summary['skipped_rows']} dataset rows skipped"
                     + (f" ({detail})" if detail else ""))
    return notes


# --- the report ------------------------------------------------------------------------------


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
    summary, summary_warning = _load_summary(run_dir / SUMMARY_FILE)
    if summary_warning:
        warnings.append(summary_warning)
    warnings.extend(_summary_notes(summary))
    series = _series(train, evals)
    diverged = sum(1 for r in train if r.get("loss") is not None and _finite(r["loss"]) is None)
    if diverged:
        warnings.append(f"{diverged} train steps with a non-finite loss")

    warnings.extend(hang_notes(run_dir))
    ranks = rank_step_times(train, config)
    warnings.extend(
        f"rank {s['rank']} is a straggler: median step time {s['median_step_time_s']:.3g} s, "
        f"{s['slower']:.0%} slower than the ranks' median {s['ranks_median_s']:.3g} s"
        for s in (ranks or {}).get("stragglers", [])
    )

    preflight, preflight_problem = _read_object(run_dir / PREFLIGHT_FILE)
    if preflight_problem:
        warnings.append(preflight_problem)
    if preflight and not preflight.get("ok"):
        warnings.append("preflight found bad node(s): " + "; ".join(
            [", ".join(preflight.get("bad_nodes") or []) or "none to blame",
             *(preflight.get("problems") or [])]))

    evaluation, evaluation_warning = load_evaluation(run_dir / EVALUATION_FILE)
    if evaluation_warning:
        warnings.append(evaluation_warning)
    data, data_problem = _read_object(run_dir / PREPARE_DATA_FILE)
    if data_problem:
        warnings.append(data_problem)
    metrics = summarize(train, evals, summary)
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
        "config": config,
        "stages": stages or {},
        "metrics": metrics,
        "cost": cost,
        "plan": plan_vs_measured(plan, metrics, cost, _device(stages)),
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
        "promotion": None,  # the promote stage's (add_sections)
        "tracking": None,
    }
    # default=str: a config may carry Paths or datetimes; the report must still be written
    _write_atomic(run_dir / REPORT_JSON, json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(run_dir / REPORT_HTML, render_html(report))
    return report


def data_section(record: dict | None) -> dict | None:
    """The prepare_data stage's record (finetune.prepare_stage) as the report shows it."""
    if not record:
        return None
    keys = ("path", "cache_hit", "seconds", "num_proc", "rows_read", "rows_kept",
            "skipped_rows", "skipped_rows_by_reason", "longest_skipped_rows", "train_rows",
            "eval_rows", "train_examples", "eval_examples", "packing", "seq_len", "tokens",
            "tokens_per_epoch", "length_histogram", "eval_dataset")
    return {key: record.get(key) for key in keys}


def _data_view(data: dict | None) -> dict | None:
    """The Data section's rows: the prepared set, its counts, lengths and longest skipped rows."""
    if not data:
        return None
    how = "reused (cache hit)" if data.get("cache_hit") else "prepared by this run"
    took = _fmt(data.get("seconds"), ".1f", " s")
    rows = [("prepared set", f"{data.get('path')}: {how} in {took}"),
            *[(key, str(data.get(key))) for key in (
                "rows_read", "rows_kept", "skipped_rows", "skipped_rows_by_reason", "train_rows",
                "eval_rows", "tokens_per_epoch")]]
    evaluated = data.get("eval_dataset")
    if evaluated:  # the separate eval data set evaluate measures on, prepared with the set
        rows.append(("eval_dataset", f"{evaluated['dataset']}: {evaluated['rows_kept']} of "
                     f"{evaluated['rows_read']} rows kept, skipped "
                     f"{evaluated['skipped_rows_by_reason'] or 'none'}"))
    histogram = data.get("length_histogram") or {}
    rows += [(f"examples of {bin_} tokens", str(n)) for bin_, n in histogram.items()]
    rows += [(f"skipped: {r['where']}", f"{r['tokens']} tokens, {r['reason']}")
             for r in data.get("longest_skipped_rows") or []]
    return {"rows": rows}


def _preflight_view(preflight: dict | None) -> dict | None:
    """The preflight's table: one row per node, its GPUs, bandwidth and problems."""
    if not preflight:
        return None
    nodes = [[n["node_name"], n["ranks"], ", ".join(n["gpus"]),
              ", ".join(f"{t:.3g}" for t in n["matmul_tflops"]),
              _fmt(n["intra_busbw_gbps"], ".1f"), _fmt(n["expected_intra_gbps"], ".0f"),
              "ok" if n["ok"] else "; ".join(n["problems"])] for n in preflight["nodes"]]
    across = (f"{_fmt(preflight['inter_busbw_gbps'], '.1f')} GB/s bus bandwidth (expected "
              f"{_fmt(preflight['expected_inter_gbps'], '.0f')}); {preflight['message_mib']:g} "
              f"MiB messages, {preflight['backend']}")
    return {"nodes": nodes, "across": across, "problems": preflight["problems"]}


def load_evaluation(path: Path) -> tuple[dict | None, str | None]:
    """The report's `evaluation` from trainer/evaluate.py's file: (section, warning); none for
    a run that failed before evaluate, or a report written before it."""
    data, problem = _read_object(path)
    if data is None:
        return None, problem
    keep = ("loss", "perplexity", "samples", "tasks", "higher_is_better", "champion",
            "eval_set", "eval_rows", "wall_time_s")
    return {key: data.get(key) for key in keep}, None


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


def hang_notes(run_dir: Path) -> list[str]:
    """The TrainingHang records (trainer/watchdog.py) the run left, also when a restart went on
    to succeed: which rank hung, and where the dumps are."""
    notes = []
    for path in sorted((Path(run_dir) / ERRORS_DIR).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and record.get("type") == "TrainingHang":
            notes.append(f"{record.get('message')} (stacks and collective traces in hangs/)")
    return notes


def rank_step_times(train: list[dict], config: dict) -> dict | None:
    """Each rank's median step time (the trainer's `rank_step_time_s`) and the stragglers:
    ranks slower than the ranks' median by more than the run's straggler_threshold."""
    per_step = [r[RANK_STEP_TIMES] for r in train if isinstance(r.get(RANK_STEP_TIMES), list)
                and all(_finite(t) is not None for t in r[RANK_STEP_TIMES])]
    if not per_step:
        return None
    threshold = _finite(config.get("straggler_threshold")) or STRAGGLER_THRESHOLD
    return {"threshold": threshold, "median_step_time_s": rank_medians(per_step),
            "stragglers": stragglers(per_step, threshold)}


def _rank_times_view(ranks: dict | None) -> dict | None:
    if not ranks:
        return None
    flagged = {s["rank"] for s in ranks["stragglers"]}
    rows = [(f"rank {rank}" + (" (straggler)" if rank in flagged else ""), _fmt(t, ".3g", " s"))
            for rank, t in enumerate(ranks["median_step_time_s"])]
    return {"threshold": f"{ranks['threshold']:.0%}", "rows": rows}


def failure_error(error: dict | None) -> dict | None:
    """The report's `error`: stage, type, message (cut) and rank, nothing else."""
    if not error:
        return None
    return {"stage": str(error.get("stage") or "unknown"), "type": str(error.get("type") or ""),
            "message": str(error.get("message") or "")[:MAX_ERROR_CHARS],
            "rank": error.get("rank") if isinstance(error.get("rank"), int) else None}


def _device(stages: dict | None) -> str | None:
    train = (stages or {}).get("train")
    resources = train.get("resources") if isinstance(train, dict) else None
    return resources.get("device") if isinstance(resources, dict) else None


def plan_vs_measured(plan: dict | None, metrics: dict, cost: dict | None,
                     device: str | None) -> dict | None:
    """The planner's estimate beside the run's measurements, with the relative error of each
    (estimate / measured - 1); n/a where either side is missing. A CPU's peak is the process's
    memory, not a GPU's: no memory comparison there."""
    if not plan:
        return None
    peak = _finite(metrics.get("peak_memory_bytes"))
    measured = {
        "peak_gib": peak / 2**30 if peak is not None and device != "cpu" else None,
        "step_time_s": _finite(metrics.get("median_step_time_s")),
        "tokens_per_s_per_gpu": (_finite(metrics.get("tokens_per_s")) or 0) / metrics[
            "world_size"] if metrics.get("world_size") and metrics.get("tokens_per_s") else None,
        "wall_time_s": _finite(metrics.get("wall_time_s")),
        "cost_usd": cost["usd"] if cost else None,
    }
    rows = {}
    for key, actual in measured.items():
        estimated = _finite(plan.get(key))
        rows[key] = {"estimate": estimated, "measured": actual,
                     "error": estimated / actual - 1 if estimated is not None and actual else None}
    notes = [plan["note"]] if plan.get("note") else []
    if device == "cpu":
        notes.append("memory: n/a on a CPU (the process's memory is not a GPU peak)")
    return {"compared": rows, "settings": {k: plan.get(k) for k in (
        "activation_checkpointing", "activation_offload", "selective_ac", "chosen", "fits")},
        "notes": notes}


def _train_wall_time(stages: dict | None, metrics: dict) -> float | None:
    """The train stage's wall time (what the nodes were busy for), else the trainer's own."""
    train = (stages or {}).get("train")
    wall = _finite(train.get("wall_time_s")) if isinstance(train, dict) else None
    return wall if wall is not None else _finite(metrics.get("wall_time_s"))


def cost_estimate(node_hourly_price: float | None, nodes: int | None,
                  wall_time_s: float | None) -> dict | None:
    """nodes x price per node-hour x training wall time; None when any of them is unknown."""
    if not node_hourly_price or not nodes or wall_time_s is None:
        return None
    hours = wall_time_s / 3600
    return {"node_hourly_price_usd": node_hourly_price, "nodes": nodes,
            "hours": hours, "usd": round(node_hourly_price * nodes * hours, 2)}


def _write_atomic(path: Path, text: str) -> None:
    # readers (the UI, a later task) never see a half-written report
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --- HTML ------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "n/a" if _finite(value) is None else f"{value:{spec}}{suffix}"


def _fmt_duration(seconds: Any) -> str:
    if _finite(seconds) is None:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _fmt_bytes(value: Any) -> str:
    if _finite(value) is None:
        return "n/a"
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.1f} MiB"


def mfu_text(metrics: dict) -> str:
    """MFU as a percentage; 'n/a (CPU)' where the run had no trusted peak to divide by."""
    mfu = _finite(metrics.get("mfu"))
    if mfu is not None:
        return f"{mfu * 100:.1f}%"
    return "n/a (CPU)" if str(metrics.get("peak_flops_source") or "").startswith("none") \
        else "n/a"


def _headline_figures(metrics: dict) -> list[tuple[str, str]]:
    loss = (
        f"{_fmt(metrics.get('initial_eval_loss'), '.4f')} → "
        f"{_fmt(metrics.get('final_eval_loss'), '.4f')}"
    )
    return [
        ("tokens/s (total tokens / step time)", _fmt(metrics.get("tokens_per_s"), ",.0f")),
        ("median step", _fmt(metrics.get("median_step_time_s"), ".3g", " s")),
        ("TFLOPs/device", _fmt(metrics.get("tflops_per_device"), ".4g")),
        ("MFU", mfu_text(metrics)),
        ("wall time", _fmt_duration(metrics.get("wall_time_s"))),
        ("peak memory", _fmt_bytes(metrics.get("peak_memory_bytes"))),
        ("eval loss", loss),
        ("steps", _fmt(metrics.get("steps"), ",.0f")),
        ("world size", _fmt(metrics.get("world_size"), ".0f")),
        ("cost estimate", _fmt(metrics.get("cost_usd"), ",.2f", " USD")),
    ]


def _gpu_headlines(gpu: dict | None) -> list[tuple[str, str]]:
    if not gpu or not gpu.get("available"):
        return []
    util = [n["metrics"].get("gpu_util_pct", {}) for n in gpu["nodes"]]
    means = [u.get("mean") for u in util if _finite(u.get("mean")) is not None]
    weights = [n["gpus"] for n, u in zip(gpu["nodes"], util, strict=True)
               if _finite(u.get("mean")) is not None]
    mean = sum(m * w for m, w in zip(means, weights, strict=True)) / sum(weights) \
        if weights else None
    return [("GPU util (mean)", _fmt(mean, ".1f", "%")),
            ("GPUs", str(len(gpu["gpus"]))),
            ("XID errors", str(len(gpu["xid_errors"])))]


def _flatten(mapping: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested dict -> [(dotted key, value text)] so nested config reads as one table."""
    rows: list[tuple[str, str]] = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, f"{name}."))
        elif isinstance(value, str):
            rows.append((name, value))
        else:
            rows.append((name, json.dumps(value, default=str)))
    return rows





def _points(records: list[dict], x_key: str, y_key: str) -> list[tuple[float, float]]:
    return [(r[x_key], r[y_key]) for r in records if r.get(y_key) is not None]


MAX_ERROR_CHARS = 2000


def _error_view(error: dict | None) -> dict | None:
    if not error:
        return None
    where = f"stage {error['stage']}" + (f", rank {error['rank']}" if error.get("rank") is not
                                          None else "")
    return {"where": where, "type": error["type"], "message": error["message"]}


def render_html(report: dict) -> str:
    """The report dict -> one self-contained HTML page (templates/report.html.j2)."""
    train, evals = report["series"]["train"], report["series"]["eval"]
    charts = [
        svg_line_chart({"train loss": _points(train, "step", "loss"),
                        "eval loss": _points(evals, "step", "eval_loss")},
                       "Loss", "step", "loss"),
        svg_line_chart({"tokens/s": _points(train, "step", "tokens_per_s")},
                       "Throughput", "step", "tokens/s"),
        svg_line_chart({"lr": _points(train, "step", "lr")}, "Learning rate", "step", "lr"),
    ]
    if any(r.get("reward_accuracy") is not None for r in train):  # a dpo run
        charts.append(svg_line_chart(
            {"reward accuracy": _points(train, "step", "reward_accuracy"),
             "reward margin": _points(train, "step", "reward_margin")},
            "Preference rewards (DPO)", "step", "value"))
    cost = report.get("cost")
    return render(
        "report.html.j2",
        run_id=report["run_id"],
        status=report["status"],
        generated_at=report["generated_at"],
        error=_error_view(report.get("error")),
        figures=_headline_figures(report["metrics"]) + _gpu_headlines(report.get("gpu")),
        charts=charts,
        config=_flatten(report["config"]),
        evaluation=_evaluation_view(report.get("evaluation"), report.get("promotion"),
                                    report.get("tracking")),
        data=_data_view(report.get("data")),
        cost=cost and {"nodes": cost["nodes"], "price": f"{cost['node_hourly_price_usd']:g}",
                       "hours": f"{cost['hours']:.2f}", "usd": f"{cost['usd']:,.2f}"},
        gpu=_gpu_view(report.get("gpu")),
        plan=_plan_view(report.get("plan")),
        host=_host_view(report.get("host")),
        ranks=_rank_times_view(report.get("rank_step_times")),
        preflight=_preflight_view(report.get("preflight")),
        stages=_flatten(report["stages"]),
        artifacts=[(k, "n/a" if v is None else v) for k, v in report["artifacts"].items()],
        warnings=report["warnings"],
    )


def _plan_view(plan: dict | None) -> dict | None:
    if not plan:
        return None
    rows = [(key, f"{_fmt(row['estimate'], '.4g')} estimated, {_fmt(row['measured'], '.4g')} "
                  f"measured" + (f" ({row['error']:+.1%})" if row["error"] is not None else ""))
            for key, row in plan["compared"].items()]
    return {"rows": rows, "notes": plan.get("notes") or []}


def _evaluation_view(evaluation: dict | None, promotion: dict | None,
                     tracking: dict | None) -> dict | None:
    if not evaluation:
        return None
    champion = evaluation.get("champion") or {}
    rows = [("eval set", f"{evaluation.get('eval_set')} ({evaluation.get('eval_rows')} rows)"),
            ("loss", _fmt(evaluation.get("loss"), ".4f")
             + (f" (champion {_fmt(champion.get('loss'), '.4f')})" if champion else "")),
            ("perplexity", _fmt(evaluation.get("perplexity"), ".3f")
             + (f" (champion {_fmt(champion.get('perplexity'), '.3f')})" if champion else ""))]
    for task, scores in (evaluation.get("tasks") or {}).items():
        theirs = (champion.get("tasks") or {}).get(task, {})
        for metric, value in scores.items():
            rows.append((f"{task} {metric}", _fmt(value, ".4f") + (
                f" (champion {_fmt(theirs.get(metric), '.4f')})" if metric in theirs else "")))
    return {
        "rows": rows,
        "promotion": promotion and {
            "decision": promotion.get("decision"), "metric": promotion.get("metric"),
            "challenger": _fmt(promotion.get("challenger"), ".4f"),
            "champion": _fmt(promotion.get("champion"), ".4f"),
            "margin": _fmt(promotion.get("margin"), "g"), "reason": promotion.get("reason", "")},
        "tracking": tracking if tracking and tracking.get("run_id") else None,
        "samples": evaluation.get("samples") or [],
    }


_GPU_COLUMNS = (("gpu_util_pct", "GPU util", "%"), ("mem_copy_util_pct", "mem copy util", "%"),
                ("sm_clock_mhz", "SM clock", "MHz"), ("fb_used_mib", "FB used", "MiB"),
                ("power_w", "power", "W"), ("temperature_c", "temperature", "°C"))
_GPU_PLOTS = (("gpu_util_pct", "GPU utilisation", "%"), ("fb_used_mib", "GPU memory used", "MiB"),
              ("power_w", "GPU power", "W"), ("temperature_c", "GPU temperature", "°C"))
_MAX_PLOTTED_GPUS = 32


def _gpu_rows(rows: list[dict], key_cols: tuple[str, ...]) -> list[list[Any]]:
    """One row of cells per node or GPU: its keys, then each column's mean / max."""
    return [[row.get(c) for c in key_cols] + [
        f"{_fmt(stat.get('mean'), ',.1f')} / {_fmt(stat.get('max'), ',.1f')}"
        for stat in (row["metrics"].get(key) or {} for key, _, _ in _GPU_COLUMNS)]
        for row in rows]


def _gpu_view(gpu: dict | None) -> dict | None:
    if not gpu:
        return None
    view: dict[str, Any] = {"xid_errors": [
        {"node": e["node"], "gpu": e["gpu"], "pods": ", ".join(e["pods"]) or "n/a",
         "codes": ", ".join(str(c) for c in e["codes"])} for e in gpu.get("xid_errors") or []]}
    if not gpu.get("available"):
        return view | {"missing": gpu.get("missing") or "GPU metrics missing"}
    query = gpu.get("query") or {}
    source = gpu["source"] + (f" {query['url']}, {query['selector']}, {query['start']} to "
                              f"{query['end']}" if "url" in query else "")
    t0 = min((p[0] for per_gpu in gpu["series"].values() for points in per_gpu.values()
              for p in points[:1]), default=0)
    charts = []
    for key, title, unit in _GPU_PLOTS:
        per_gpu = dict(list((gpu["series"].get(key) or {}).items())[:_MAX_PLOTTED_GPUS])
        charts.append(svg_line_chart(
            {name: [(t - t0, v) for t, v in points] for name, points in per_gpu.items()},
            f"{title} per GPU", "seconds", unit))
    return view | {
        "missing": None, "source": source,
        "columns": [(label, unit) for _, label, unit in _GPU_COLUMNS],
        "nodes": _gpu_rows(gpu["nodes"], ("node", "gpus")),
        "gpus": _gpu_rows(gpu["gpus"], ("node", "gpu", "model")),
        "charts": charts, "count": len(gpu["gpus"]),
        "plotted": min(len(gpu["gpus"]), _MAX_PLOTTED_GPUS),
    }


def _host_view(host: dict | None) -> dict | None:
    if not host:
        return None
    cpu, mem = host["metrics"]["cpu_percent"], host["metrics"]["memory_used_bytes"]
    series = host["series"]
    t0 = min((s[0][0] for s in series.values() if s), default=0)
    return {
        "summary": f'{host["samples"]} samples; CPU mean {_fmt(cpu["mean"], ".1f", "%")}, max '
                   f'{_fmt(cpu["max"], ".1f", "%")}; memory used max {_fmt_bytes(mem["max"])} of '
                   f'{_fmt_bytes(host.get("memory_total_bytes"))}',
        "charts": [
            svg_line_chart({"CPU %": [(t - t0, v) for t, v in series["cpu_percent"]]},
                           "Host CPU", "seconds", "%"),
            svg_line_chart({"memory used (GiB)": [(t - t0, v / GIB)
                                                  for t, v in series["memory_used_bytes"]]},
                           "Host memory", "seconds", "GiB"),
        ],
    }


# --- SVG charts ------------------------------------------------------------------------------

CHART_WIDTH, CHART_HEIGHT = 560, 300
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 64, 16, 30, 44
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
_MAX_MARKED_POINTS = 40
_LEGEND_CHAR_WIDTH = 6.5  # rough glyph width at font-size 11; SVG text cannot be measured


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round numbers (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [i * step for i in range(first, last + 1)]


def _fmt_tick(value: float) -> str:
    size = abs(value)
    if size < 1e-12:
        return "0"
    if size >= 1e6:
        return f"{value / 1e6:.3g}M"
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 1e-3:
        return f"{value:.4g}"
    return f"{value:.1e}"


def _padded_range(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi > lo:
        return lo, hi
    # a single point or a flat line still needs a non-empty axis to place it on
    pad = abs(lo) * 0.1 or 1.0
    return lo - pad, hi + pad


def svg_line_chart(
    series: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str
) -> Markup:
    """Inline SVG line chart of named (x, y) series; None/NaN points are skipped. The geometry
    is computed here, the markup is templates/chart.svg.j2."""
    w, h = CHART_WIDTH, CHART_HEIGHT
    left, right = _MARGIN_LEFT, w - _MARGIN_RIGHT
    top, bottom = _MARGIN_TOP, h - _MARGIN_BOTTOM
    clean = {
        name: [
            (float(x), float(y))
            for x, y in points
            if _finite(x) is not None and _finite(y) is not None
        ]
        for name, points in series.items()
    }
    box = {"w": w, "h": h, "left": left, "right": right, "top": top, "bottom": bottom,
           "x_mid": (left + right) / 2, "y_mid": (top + bottom) / 2}
    all_points = [p for points in clean.values() for p in points]
    if not all_points:
        return _chart(box, title, x_label, y_label, None)

    x_lo, x_hi = _padded_range([x for x, _ in all_points])
    y_lo, y_hi = _padded_range([y for _, y in all_points])

    def sx(x: float) -> float:
        return round(left + (x - x_lo) / (x_hi - x_lo) * (right - left), 2)

    def sy(y: float) -> float:
        return round(bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top), 2)

    lines = [{
        "color": _COLORS[i % len(_COLORS)],
        "coords": " ".join(f"{sx(x)},{sy(y)}" for x, y in points) if len(points) > 1 else "",
        # sparse series (eval loss, a single point) would be invisible as a bare line
        "markers": [(sx(x), sy(y)) for x, y in points] if len(points) <= _MAX_MARKED_POINTS
        else [],
    } for i, points in enumerate(clean.values())]
    # the legend sits in the top margin, laid out right to left, so it never hides a line
    legend, legend_x = [], right
    for i, name in reversed(list(enumerate(clean))):
        text_x = legend_x - _LEGEND_CHAR_WIDTH * len(name)
        if text_x - 22 < left:  # many series (GPUs): the legend shows those that fit
            break
        legend.append({"name": name, "x": text_x, "color": _COLORS[i % len(_COLORS)]})
        legend_x = text_x - 34
    return _chart(box, title, x_label, y_label, {
        "x_ticks": [(sx(t), _fmt_tick(t)) for t in _nice_ticks(x_lo, x_hi)],
        "y_ticks": [(sy(t), _fmt_tick(t)) for t in _nice_ticks(y_lo, y_hi)],
        "lines": lines, "legend": legend})


def _chart(box: dict, title: str, x_label: str, y_label: str, plot: dict | None) -> Markup:
    return Markup(render("chart.svg.j2", box=box, title=title, x_label=x_label,
                         y_label=y_label, plot=plot).strip())
