"""Run report: a trainer's run directory -> `report.json` and a self-contained `report.html`.

Standard library only: this runs in the Airflow worker, which has neither torch nor plotting
libraries, and the page must open offline (no scripts, no external resources).
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune_contract.errors import ERRORS_DIR
from finetune_contract.fields import DPO_METRICS, EVALUATION_FILE, STRAGGLER_THRESHOLD
from finetune_contract.preflight import PREFLIGHT_FILE
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
    plan: the planner's estimate made at validate (finetune.planning.RunPlan.to_dict()), put beside
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
        "promotion": None,  # the promote stage's (add_sections)
        "tracking": None,
    }
    # default=str: a config may carry Paths or datetimes; the report must still be written
    _write_atomic(run_dir / REPORT_JSON, json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(run_dir / REPORT_HTML, render_html(report))
    return report


def _preflight_html(preflight: dict | None) -> list[str]:
    """The preflight's table: one row per node, its GPUs, bandwidth and problems."""
    if not preflight:
        return []
    head = ("<tr><th>node</th><th>ranks</th><th>GPUs</th><th>matmul TFLOP/s</th>"
            "<th>all-reduce in node (GB/s)</th><th>expected</th><th>verdict</th></tr>")
    rows = "".join(
        f"<tr><td>{_esc(n['node_name'])}</td><td>{n['ranks']}</td>"
        f"<td>{_esc(', '.join(n['gpus']))}</td>"
        f"<td>{_esc(', '.join(f'{t:.3g}' for t in n['matmul_tflops']))}</td>"
        f"<td>{_fmt(n['intra_busbw_gbps'], '.1f')}</td>"
        f"<td>{_fmt(n['expected_intra_gbps'], '.0f')}</td>"
        f"<td>{'ok' if n['ok'] else _esc('; '.join(n['problems']))}</td></tr>"
        for n in preflight["nodes"])
    across = (f"<p>all-reduce across nodes: {_fmt(preflight['inter_busbw_gbps'], '.1f')} GB/s "
              f"bus bandwidth (expected {_fmt(preflight['expected_inter_gbps'], '.0f')}); "
              f"{preflight['message_mib']:g} MiB messages, {_esc(preflight['backend'])}</p>")
    problems = "".join(f"<p class=\"warn\">{_esc(p)}</p>" for p in preflight["problems"])
    return ["<h2>Preflight</h2>", f"<table>{head}{rows}</table>", across, problems]


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


def _rank_times_html(ranks: dict | None) -> list[str]:
    if not ranks:
        return []
    flagged = {s["rank"] for s in ranks["stragglers"]}
    rows = [(f"rank {rank}" + (" (straggler)" if rank in flagged else ""), _fmt(t, ".3g", " s"))
            for rank, t in enumerate(ranks["median_step_time_s"])]
    return [f"<h2>Per-rank step time (median; stragglers: > {ranks['threshold']:.0%} slower)</h2>",
            _table(rows, "no per-rank step times")]


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

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 70rem; color: #222; }
h1 .status { font-size: 0.6em; padding: 0.2em 0.6em; border-radius: 0.3em; color: #fff; }
.status-success { background: #2e7d32; } .status-failed { background: #c62828; }
.error { border-left: 4px solid #c62828; padding: 0 1rem; background: #fdecea; }
.error pre { white-space: pre-wrap; }
.figures { display: flex; flex-wrap: wrap; gap: 1rem; margin: 1rem 0; }
.figure { border: 1px solid #ddd; border-radius: 0.4rem; padding: 0.6rem 1rem; min-width: 9rem; }
.figure .label { font-size: 0.8em; color: #666; } .figure .value { font-size: 1.4em; }
.charts svg { border: 1px solid #eee; margin: 0.5rem 0.5rem 0 0; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 0.2rem 0.6rem; }
td { font-family: ui-monospace, monospace; vertical-align: top; white-space: pre-wrap; }
.muted { color: #666; }
.missing { background: #fff8e1; border-left: 4px solid #f9a825; padding: 0.5rem 1rem; }
.xid { background: #ffebee; border-left: 6px solid #c62828; padding: 0.5rem 1rem;
       color: #b71c1c; font-weight: bold; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


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


def _table(rows: list[tuple[str, str]], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{_esc(empty)}</p>'
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f"<table><tr><th>key</th><th>value</th></tr>{body}</table>"


def _points(records: list[dict], x_key: str, y_key: str) -> list[tuple[float, float]]:
    return [(r[x_key], r[y_key]) for r in records if r.get(y_key) is not None]


MAX_ERROR_CHARS = 2000


def _error_html(error: dict | None) -> str:
    if not error:
        return ""
    where = f"stage {error['stage']}" + (f", rank {error['rank']}" if error.get("rank") is not
                                          None else "")
    return (f'<section class="error"><h2>Why it failed</h2><p>{_esc(where)}: '
            f"<b>{_esc(error['type'])}</b></p><pre>{_esc(error['message'])}</pre></section>")


def render_html(report: dict) -> str:
    """The report dict -> one self-contained HTML page (inline CSS and SVG, no scripts)."""
    train, evals = report["series"]["train"], report["series"]["eval"]
    charts = [
        svg_line_chart(
            {
                "train loss": _points(train, "step", "loss"),
                "eval loss": _points(evals, "step", "eval_loss"),
            },
            "Loss",
            "step",
            "loss",
        ),
        svg_line_chart(
            {"tokens/s": _points(train, "step", "tokens_per_s")}, "Throughput", "step", "tokens/s"
        ),
        svg_line_chart({"lr": _points(train, "step", "lr")}, "Learning rate", "step", "lr"),
    ]
    if any(r.get("reward_accuracy") is not None for r in train):  # a dpo run
        charts.append(svg_line_chart(
            {"reward accuracy": _points(train, "step", "reward_accuracy"),
             "reward margin": _points(train, "step", "reward_margin")},
            "Preference rewards (DPO)", "step", "value"))
    figures = "".join(
        f'<div class="figure"><div class="label">{_esc(label)}</div>'
        f'<div class="value">{_esc(value)}</div></div>'
        for label, value in _headline_figures(report["metrics"])
        + _gpu_headlines(report.get("gpu"))
    )
    warnings = report["warnings"]
    warning_list = (
        "<ul>" + "".join(f"<li>{_esc(w)}</li>" for w in warnings) + "</ul>"
        if warnings
        else '<p class="muted">none</p>'
    )
    artifacts = [(k, "n/a" if v is None else v) for k, v in report["artifacts"].items()]
    run_id, status = _esc(report["run_id"]), _esc(report["status"])
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Run {run_id}: {status}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1>Run {run_id} <span class="status status-{status}">{status}</span></h1>',
        f'<p class="muted">generated {_esc(report["generated_at"])}</p>',
        _error_html(report.get("error")),
        f'<section class="figures">{figures}</section>',
        f'<section class="charts">{"".join(charts)}</section>',
        "<h2>Config</h2>",
        _table(_flatten(report["config"]), "no config"),
    ]
    parts += _evaluation_html(report.get("evaluation"), report.get("promotion"),
                              report.get("tracking"))
    parts += _gpu_html(report.get("gpu"), report.get("cost"))
    parts += _plan_html(report.get("plan"))
    parts += _host_html(report.get("host"))
    parts += _rank_times_html(report.get("rank_step_times"))
    parts += _preflight_html(report.get("preflight"))
    if report["stages"]:
        parts += ["<h2>Stages</h2>", _table(_flatten(report["stages"]), "no stages")]
    parts += [
        "<h2>Artifacts</h2>",
        _table(artifacts, "no artifacts"),
        "<h2>Warnings</h2>",
        warning_list,
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _plan_html(plan: dict | None) -> list[str]:
    if not plan:
        return []
    rows = [(key, f"{_fmt(row['estimate'], '.4g')} estimated, {_fmt(row['measured'], '.4g')} "
                  f"measured" + (f" ({row['error']:+.1%})" if row["error"] is not None else ""))
            for key, row in plan["compared"].items()]
    notes = "".join(f'<p class="muted">{_esc(n)}</p>' for n in plan.get("notes") or [])
    return ["<h2>Plan against measurement</h2>", _table(rows, "no plan"), notes]


def _evaluation_html(evaluation: dict | None, promotion: dict | None,
                     tracking: dict | None) -> list[str]:
    if not evaluation:
        return []
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
    parts = ["<h2>Evaluation</h2>", _table(rows, "no evaluation")]
    if promotion:
        parts.append(f'<p>promotion: <b>{_esc(promotion.get("decision"))}</b> on '
                     f'{_esc(promotion.get("metric"))}: challenger '
                     f'{_fmt(promotion.get("challenger"), ".4f")}, champion '
                     f'{_fmt(promotion.get("champion"), ".4f")}, margin '
                     f'{_fmt(promotion.get("margin"), "g")}. {_esc(promotion.get("reason", ""))}'
                     "</p>")
    if tracking and tracking.get("run_id"):
        parts.append(f'<p class="muted">MLflow: experiment {_esc(tracking.get("experiment_id"))}'
                     f', run {_esc(tracking["run_id"])} at {_esc(tracking.get("uri"))}</p>')
    samples = evaluation.get("samples") or []
    if samples:
        body = "".join(f"<tr><td>{_esc(s.get('prompt'))}</td><td>{_esc(s.get('reference'))}"
                       f"</td><td>{_esc(s.get('output'))}</td></tr>" for s in samples)
        parts += ["<h3>Samples (greedy)</h3>", "<table><tr><th>prompt</th><th>reference</th>"
                  f"<th>model</th></tr>{body}</table>"]
    return parts


# GPU metrics: the table's columns and the plots, (key, label, unit).
_GPU_COLUMNS = (("gpu_util_pct", "GPU util", "%"), ("mem_copy_util_pct", "mem copy util", "%"),
                ("sm_clock_mhz", "SM clock", "MHz"), ("fb_used_mib", "FB used", "MiB"),
                ("power_w", "power", "W"), ("temperature_c", "temperature", "°C"))
_GPU_PLOTS = (("gpu_util_pct", "GPU utilisation", "%"), ("fb_used_mib", "GPU memory used", "MiB"),
              ("power_w", "GPU power", "W"), ("temperature_c", "GPU temperature", "°C"))
_MAX_PLOTTED_GPUS = 32


def _gpu_table(rows: list[dict], key_cols: tuple[str, ...]) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in key_cols) + "".join(
        f"<th>{_esc(label)} mean / max ({_esc(unit)})</th>" for _, label, unit in _GPU_COLUMNS)
    body = []
    for row in rows:
        cells = "".join(f"<td>{_esc(row.get(c))}</td>" for c in key_cols)
        for key, _, _ in _GPU_COLUMNS:
            stat = row["metrics"].get(key) or {}
            cells += f"<td>{_fmt(stat.get('mean'), ',.1f')} / {_fmt(stat.get('max'), ',.1f')}</td>"
        body.append(f"<tr>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _gpu_html(gpu: dict | None, cost: dict | None) -> list[str]:
    parts = ["<h2>GPUs</h2>"]
    if cost:
        parts.append(
            f'<p class="muted">cost estimate: {cost["nodes"]} node(s) x '
            f'{cost["node_hourly_price_usd"]:g} USD/h x {cost["hours"]:.2f} h = '
            f'{cost["usd"]:,.2f} USD</p>')
    if not gpu:
        return parts + ['<p class="missing">GPU metrics missing: none were collected (a CPU '
                        "run has none)</p>"]
    for entry in gpu.get("xid_errors") or []:
        parts.append(f'<p class="xid">XID ERROR on {_esc(entry["node"])} GPU '
                     f'{_esc(entry["gpu"])} (pods {_esc(", ".join(entry["pods"]) or "n/a")}): '
                     f'XID {_esc(", ".join(str(c) for c in entry["codes"]))}</p>')
    if not gpu.get("available"):
        return parts + [f'<p class="missing">{_esc(gpu.get("missing") or "GPU metrics missing")}'
                        "</p>"]
    query = gpu.get("query") or {}
    parts.append(f'<p class="muted">source: {_esc(gpu["source"])}'
                 + (f' {_esc(query["url"])}, {_esc(query["selector"])}, '
                    f'{_esc(query["start"])} to {_esc(query["end"])}' if "url" in query else "")
                 + "</p>")
    parts.append("<h3>Per node</h3>")
    parts.append(_gpu_table(gpu["nodes"], ("node", "gpus")))
    parts.append("<h3>Per GPU</h3>")
    parts.append(_gpu_table(gpu["gpus"], ("node", "gpu", "model")))
    t0 = min((p[0] for per_gpu in gpu["series"].values() for points in per_gpu.values()
              for p in points[:1]), default=0)
    charts = []
    for key, title, unit in _GPU_PLOTS:
        per_gpu = dict(list((gpu["series"].get(key) or {}).items())[:_MAX_PLOTTED_GPUS])
        charts.append(svg_line_chart(
            {name: [(t - t0, v) for t, v in points] for name, points in per_gpu.items()},
            f"{title} per GPU", "seconds", unit))
    parts.append(f'<section class="charts">{"".join(charts)}</section>')
    if len(gpu["gpus"]) > _MAX_PLOTTED_GPUS:
        parts.append(f'<p class="muted">plots show the first {_MAX_PLOTTED_GPUS} of '
                     f'{len(gpu["gpus"])} GPUs; the tables show all</p>')
    return parts


def _host_html(host: dict | None) -> list[str]:
    if not host:
        return []
    cpu, mem = host["metrics"]["cpu_percent"], host["metrics"]["memory_used_bytes"]
    series = host["series"]
    t0 = min((s[0][0] for s in series.values() if s), default=0)
    return [
        "<h2>Host</h2>",
        f'<p class="muted">{host["samples"]} samples; CPU mean {_fmt(cpu["mean"], ".1f", "%")}'
        f', max {_fmt(cpu["max"], ".1f", "%")}; memory used max {_fmt_bytes(mem["max"])} of '
        f'{_fmt_bytes(host.get("memory_total_bytes"))}</p>',
        '<section class="charts">'
        + svg_line_chart({"CPU %": [(t - t0, v) for t, v in series["cpu_percent"]]},
                         "Host CPU", "seconds", "%")
        + svg_line_chart({"memory used (GiB)": [(t - t0, v / GIB)
                                                for t, v in series["memory_used_bytes"]]},
                         "Host memory", "seconds", "GiB")
        + "</section>",
    ]


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
) -> str:
    """Inline SVG line chart of named (x, y) series; None/NaN points are skipped."""
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
    out = [
        (
            f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
            f'aria-label="{_esc(title)}" font-family="sans-serif" font-size="11">'
        ),
        f"<title>{_esc(title)}</title>",
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{_esc(title)}</text>',
        f'<text x="{(left + right) / 2}" y="{h - 6}" text-anchor="middle">{_esc(x_label)}</text>',
        (
            f'<text x="14" y="{(top + bottom) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 14 {(top + bottom) / 2})">{_esc(y_label)}</text>'
        ),
        (
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
            f'fill="none" stroke="#999"/>'
        ),
    ]
    all_points = [p for points in clean.values() for p in points]
    if not all_points:
        out.append(
            f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" text-anchor="middle" '
            f'fill="#999" font-size="14">no data</text></svg>'
        )
        return "".join(out)

    x_lo, x_hi = _padded_range([x for x, _ in all_points])
    y_lo, y_hi = _padded_range([y for _, y in all_points])

    def sx(x: float) -> float:
        return round(left + (x - x_lo) / (x_hi - x_lo) * (right - left), 2)

    def sy(y: float) -> float:
        return round(bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top), 2)

    for tick in _nice_ticks(x_lo, x_hi):
        x = sx(tick)
        out.append(
            f'<line x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 4}" stroke="#999"/>'
            f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{_fmt_tick(tick)}</text>'
        )
    for tick in _nice_ticks(y_lo, y_hi):
        y = sy(tick)
        out.append(
            f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{_fmt_tick(tick)}</text>'
        )

    for i, points in enumerate(clean.values()):
        color = _COLORS[i % len(_COLORS)]
        if len(points) > 1:
            coords = " ".join(f"{sx(x)},{sy(y)}" for x, y in points)
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>'
            )
        # sparse series (eval loss, a single point) would be invisible as a bare line
        if len(points) <= _MAX_MARKED_POINTS:
            out.extend(
                f'<circle cx="{sx(x)}" cy="{sy(y)}" r="2.5" fill="{color}"/>' for x, y in points
            )
    # legend sits in the top margin, laid out right to left, so it never hides a line
    legend_x = right
    for i, name in reversed(list(enumerate(clean))):
        color = _COLORS[i % len(_COLORS)]
        text_x = legend_x - _LEGEND_CHAR_WIDTH * len(name)
        if text_x - 22 < left:  # many series (GPUs): the legend shows those that fit
            break
        out.append(
            f'<line x1="{text_x - 22}" y1="14" x2="{text_x - 4}" y2="14" '
            f'stroke="{color}" stroke-width="2"/>'
            f'<text x="{text_x}" y="18">{_esc(name)}</text>'
        )
        legend_x = text_x - 34
    out.append("</svg>")
    return "".join(out)
