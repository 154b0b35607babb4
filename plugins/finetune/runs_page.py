"""The "Fine-tuning runs" page: every run directory under the output dirs (local directories or
s3:// prefixes, as eks runs write them), with its status and headline figures from report.json
(a mixture's sources with their shares and eval losses among them), and a link to its
report.html.

Pure functions (list_runs, render_runs_page) plus the FastAPI app the Airflow plugin mounts
(plugins/finetune_runs_plugin.py). No torch: the standard library, Jinja2 for the page
(finetune.pages, templates/runs.html.j2), FastAPI and Airflow's auth for the app, boto3 (through
the Airflow AWS connection) for s3:// run directories.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from finetune.pages import render
from finetune.report.formats import fmt, fmt_duration, mfu_text
from finetune.report.run_files import (
    METRICS_FILE,
    REPORT_HTML,
    REPORT_JSON,
    SUMMARY_FILE,
    parse_metrics,
)
from finetune_contract.fields import RESOLVED_CONFIG_FILE
from finetune_contract.throughput import run_throughput

URL_PREFIX = "/finetune-runs"
# Comma-separated directories or s3:// prefixes that hold run directories; default: the
# default output_dir. S3 is read with the AWS connection [finetune] aws_conn_id.
RUNS_DIRS_ENV = "AIRFLOW__FINETUNE__RUNS_DIRS"
AWS_CONN_ENV = "AIRFLOW__FINETUNE__AWS_CONN_ID"
# The page fetches its table again this often (milliseconds), so running runs move on their own.
REFRESH_MS = 5000
# Steps the ETA of a running run is estimated from: recent enough to follow a change of pace.
ETA_WINDOW = 20
# A running run with no new record for this long is marked as possibly stalled.
STALE_S = 300

RunsDir = Path | str  # a local directory, or an s3:// prefix


def _setting(env: str, key: str) -> str:
    value = os.environ.get(env, "")
    if not value:
        try:
            from airflow.configuration import conf

            value = conf.get("finetune", key, fallback="") or ""
        except ImportError:
            value = ""
    return value


def runs_dirs() -> list[RunsDir]:
    """Where to look for runs: [finetune] runs_dirs in Airflow's config, else `runs/`."""
    from finetune.config import resolve_path
    from finetune_contract.parameters import BY_NAME

    names = [d.strip() for d in _setting(RUNS_DIRS_ENV, "runs_dirs").split(",") if d.strip()] or [
        BY_NAME["output_dir"].default]
    return [name.rstrip("/") if name.startswith("s3://") else resolve_path(name)
            for name in names]


def s3_client() -> Any:
    from finetune.targets.eks.clients import aws_session

    return aws_session(_setting(AWS_CONN_ENV, "aws_conn_id") or "aws_default").client("s3")


def _read_report(path: Path) -> dict | None:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) else None


def _row(name: str, run_dir: str, report: dict | None, has_report: bool, mtime: float,
         status: str = "running") -> dict[str, Any]:
    if report is None:
        return {"name": name, "run_id": name, "dir": run_dir, "status": status,
                "generated_at": None, "metrics": {}, "config": {}, "gpu": None,
                "has_report": False, "mtime": mtime, "progress": None}
    return {"name": name, "run_id": report.get("run_id", name), "dir": run_dir,
            "status": report.get("status", "unknown"),
            "generated_at": report.get("generated_at"),
            "metrics": report.get("metrics") or {}, "config": report.get("config") or {},
            "gpu": report.get("gpu"), "has_report": has_report, "mtime": mtime,
            "error": report.get("error"), "progress": None,
            "tracking": report.get("tracking"), "promotion": report.get("promotion"),
            "data": report.get("data"), "eval_loss_by_source": report.get("eval_loss_by_source")}


def run_progress(metrics_lines: list[str], finished_training: bool,
                 now: float | None = None) -> dict[str, Any]:
    """A run in progress, from its metrics.jsonl (and whether summary.json is there yet):
    stage, step of max_steps, last loss, tokens/s so far (total tokens over total step time),
    the ETA from the last steps' pace, the eval losses, seconds since the last record."""
    train, evals, _, data = parse_metrics(metrics_lines)
    now = time.time() if now is None else now
    max_steps = (data or {}).get("max_steps")
    step = train[-1]["step"] if train else 0
    if finished_training:
        stage = "writing the report"
    elif not train and not evals:
        stage = "starting (before the first step)"
    elif isinstance(max_steps, int) and step >= max_steps:
        stage = "final eval and model export"
    else:
        stage = "training"
    recent = run_throughput(train[-ETA_WINDOW:])
    seconds_per_step = (recent["timed_time_s"] / recent["timed_steps"]
                        if recent["timed_steps"] else None)
    eta = (max(0, max_steps - step) * seconds_per_step
           if seconds_per_step is not None and isinstance(max_steps, int) else None)
    times = [r["time"] for r in [*train, *evals, *([data] if data else [])]
             if isinstance(r.get("time"), (int, float))]
    throughput = run_throughput(train)
    return {
        "stage": stage, "step": step,
        "max_steps": max_steps if isinstance(max_steps, int) else None,
        "loss": train[-1].get("loss") if train else None,
        "tokens_per_s": throughput["tokens_per_s"],
        "tflops_per_device": throughput["tflops_per_device"], "mfu": throughput["mfu"],
        "eta_s": eta,
        "initial_eval_loss": evals[0].get("eval_loss") if evals else None,
        "eval_loss": evals[-1].get("eval_loss") if evals else None,
        "elapsed_s": now - min(times) if times else None,
        "since_last_record_s": now - max(times) if times else None,
    }


def _trainer_model(text: str | None) -> dict[str, Any]:
    """{"model": ...} from the trainer's resolved config, what a running run's row can show."""
    try:
        resolved = json.loads(text or "")
    except ValueError:
        return {}
    model = resolved.get("model") if isinstance(resolved, dict) else None
    return {"model": model} if isinstance(model, str) else {}


def _local_progress(run_dir: Path) -> dict[str, Any]:
    try:
        lines = (run_dir / METRICS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        lines = ""
    return run_progress(lines.splitlines(), (run_dir / SUMMARY_FILE).is_file())


def _error_view(error: dict | None) -> dict | None:
    """A failed run's cause under its status: stage and type, the message cut short."""
    if not error:
        return None
    message = str(error.get("message") or "")
    short = message if len(message) <= 160 else message[:160] + "..."
    return {"message": message, "short": short, "stage": str(error.get("stage")),
            "type": str(error.get("type"))}


def _s3_runs(uri: str, s3: Any) -> list[dict[str, Any]]:
    """The run prefixes under `uri`: with a report.json, or in progress (metrics.jsonl only)."""
    from finetune.outputs import _not_found, split_s3

    bucket, prefix = split_s3(uri)
    base = f"{prefix}/" if prefix else ""
    rows = []
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base,
                                                          Delimiter="/")
    for page in pages:
        for common in page.get("CommonPrefixes") or []:
            key = common["Prefix"].rstrip("/")
            name, run_dir = key.rsplit("/", 1)[-1], f"s3://{bucket}/{key}"
            keys = {obj["Key"].rsplit("/", 1)[-1]: obj for obj in s3.list_objects_v2(
                Bucket=bucket, Prefix=key + "/", Delimiter="/").get("Contents") or []}
            if REPORT_JSON in keys:
                try:
                    body = s3.get_object(Bucket=bucket, Key=f"{key}/{REPORT_JSON}")["Body"]
                    report = json.loads(body.read())
                except Exception as error:
                    if not (_not_found(error) or isinstance(error, ValueError)):
                        raise
                    report = None
                mtime = keys[REPORT_JSON]["LastModified"].timestamp()
                if isinstance(report, dict):
                    rows.append(_row(name, run_dir, report, REPORT_HTML in keys, mtime))
                else:
                    rows.append(_row(name, run_dir, None, False, mtime, status="unreadable"))
            elif METRICS_FILE in keys:
                row = _row(name, run_dir, None, False,
                           keys[METRICS_FILE]["LastModified"].timestamp())
                try:
                    body = s3.get_object(Bucket=bucket, Key=f"{key}/{METRICS_FILE}")["Body"]
                    lines = body.read().decode("utf-8", errors="replace").splitlines()
                except Exception as error:
                    if not _not_found(error):
                        raise
                    lines = []  # replaced between the listing and the read
                row["progress"] = run_progress(lines, SUMMARY_FILE in keys)
                if RESOLVED_CONFIG_FILE in keys:
                    body = s3.get_object(Bucket=bucket, Key=f"{key}/{RESOLVED_CONFIG_FILE}")
                    row["config"] = _trainer_model(body["Body"].read().decode())
                rows.append(row)
    return rows


def list_runs(dirs: list[RunsDir], s3: Any = None) -> list[dict[str, Any]]:
    """One row per run directory (newest first): status and headline figures.

    A directory with a state/ (local) or a metrics.jsonl (S3) but no report yet is a run in
    progress. `s3`: the client for s3:// entries (default: [finetune] aws_conn_id's).
    """
    rows = []
    for base in dirs:
        if isinstance(base, str) and base.startswith("s3://"):
            rows += _s3_runs(base, s3 if s3 is not None else s3_client())
            continue
        base = Path(base)
        if not base.is_dir():
            continue
        for run_dir in base.iterdir():
            report_path = run_dir / REPORT_JSON
            if not run_dir.is_dir() or not (report_path.is_file() or (run_dir / "state").is_dir()):
                continue
            report = _read_report(report_path) if report_path.is_file() else None
            if report is None:
                running = not report_path.exists()
                row = _row(run_dir.name, str(run_dir), None, False, run_dir.stat().st_mtime,
                           "running" if running else "unreadable")
                if running:
                    row["progress"] = _local_progress(run_dir)
                    resolved = run_dir / RESOLVED_CONFIG_FILE
                    row["config"] = _trainer_model(
                        resolved.read_text() if resolved.is_file() else None)
                rows.append(row)
                continue
            rows.append(_row(run_dir.name, str(run_dir), report,
                             (run_dir / REPORT_HTML).is_file(), report_path.stat().st_mtime))
    rows.sort(key=lambda r: r["mtime"], reverse=True)
    return rows


def find_run(dirs: list[RunsDir], name: str, s3: Any = None) -> str | None:
    """The run directory called `name`, only if it is a listed run (no path from the URL)."""
    for row in list_runs(dirs, s3):
        if row["name"] == name:
            return row["dir"]
    return None


def report_html(run_dir: str, s3: Any = None) -> bytes | None:
    """The run's report.html, from its directory or its S3 prefix; None when there is none."""
    if not run_dir.startswith("s3://"):
        path = Path(run_dir) / REPORT_HTML
        return path.read_bytes() if path.is_file() else None
    from finetune.outputs import _not_found, split_s3

    bucket, prefix = split_s3(run_dir)
    try:
        client = s3 if s3 is not None else s3_client()
        return client.get_object(Bucket=bucket, Key=f"{prefix}/{REPORT_HTML}")["Body"].read()
    except Exception as error:
        if _not_found(error):
            return None
        raise


def _gpu_util(gpu: dict | None) -> float | None:
    if not gpu or not gpu.get("available"):
        return None
    means = [(g["metrics"].get("gpu_util_pct") or {}).get("mean") for g in gpu["gpus"]]
    means = [m for m in means if m is not None]
    return sum(means) / len(means) if means else None


_HEADINGS = ("run", "status", "progress", "where", "data", "tokens/s",
             "TFLOPs/device", "MFU", "wall time", "goodput", "eval loss", "GPU util",
             "XID errors", "cost")


def _goodput_text(metrics: dict) -> str:
    """The share of the paid node time that trained, and the notices that interrupted it."""
    if metrics.get("goodput") is None:
        return "n/a"
    notices = metrics.get("preemptions") or 0
    return fmt(100 * metrics["goodput"], ".1f", "%") + (
        f" ({notices} preemption{'s' if notices != 1 else ''})" if notices else "")


def _progress_view(progress: dict) -> dict:
    """A running run's stage, step of total with a bar, loss, ETA, and how long it is quiet."""
    step, total = progress["step"], progress["max_steps"]
    quiet = progress["since_last_record_s"]
    return {
        "stage": progress["stage"], "step": step, "total": total,
        "percent": f"{min(100.0, 100 * step / total):.1f}" if total else None,
        "steps": f"{step:,}/{total:,}" if total else None,
        "eta": fmt_duration(progress["eta_s"]).replace(" ", "\u00a0"),  # kept on one line
        "loss": fmt(progress["loss"], ".4f") if progress["loss"] is not None else None,
        "quiet": fmt_duration(quiet) if quiet is not None and quiet > STALE_S
        and progress["stage"] == "training" else None,
    }


def _data_view(data: dict | None, eval_by_source: dict | None = None) -> dict | None:
    """The prepare_data stage's figures: rows kept of read, skipped, its time and cache hit; a
    mixture's sources, each with its share of the training examples and its eval loss."""
    if not data:
        return None
    how = "cache hit" if data.get("cache_hit") else "prepared"
    losses = eval_by_source or {}
    return {"rows": f'{fmt(data.get("rows_kept"), ",.0f")} of '
                    f'{fmt(data.get("rows_read"), ",.0f")} rows',
            "how": f'{fmt(data.get("skipped_rows"), ",.0f")} skipped; {how} in '
                   f'{fmt_duration(data.get("seconds"))}',
            "sources": [
                f'{s["name"]}: {s["share"]:.0%} of training, {fmt(s["skipped_rows"], ",.0f")} '
                f'skipped, eval loss {fmt((losses.get(s["name"]) or {}).get("initial"), ".3f")}'
                f' → {fmt((losses.get(s["name"]) or {}).get("final"), ".3f")}'
                for s in data.get("sources") or []]}


def _when(row: dict[str, Any]) -> str:
    if not row["has_report"]:
        return "report when it ends"
    generated = str(row["generated_at"] or "n/a")
    # ISO 8601 UTC as the report writes it -> "2026-01-02 03:04 UTC"
    return (f"report {generated[:10]} {generated[11:16]} UTC" if generated.endswith("+00:00")
            else f"report {generated}")


def _row_view(row: dict[str, Any]) -> dict[str, Any]:
    """One run's cells as text: run (a link to its report when it has one, its MLflow run and
    promotion decision), status and cause, progress, where, and the figures."""
    cfg, progress, gpu = row["config"], row.get("progress"), row["gpu"]
    # a running run's figures so far, from its metrics.jsonl
    m = row["metrics"] if progress is None else {
        "tokens_per_s": progress["tokens_per_s"], "mfu": progress["mfu"],
        "tflops_per_device": progress["tflops_per_device"],
        "wall_time_s": progress["elapsed_s"],
        "initial_eval_loss": progress["initial_eval_loss"],
        "final_eval_loss": progress["eval_loss"]}
    tracking, promotion = row.get("tracking") or {}, row.get("promotion") or {}
    steps = row["metrics"].get("steps")
    return {
        "run_id": str(row["run_id"]),
        "report_href": f"runs/{quote(row['name'])}/{REPORT_HTML}" if row["has_report"] else None,
        "when": _when(row),
        "mlflow_url": tracking.get("url"),
        "decision": str(promotion["decision"]) if promotion.get("decision") else None,
        "status": row["status"],
        "error": _error_view(row.get("error")),
        "progress": _progress_view(progress) if progress is not None else None,
        "steps": fmt(steps, ",.0f") if steps else None,
        "what": " · ".join(str(cfg[k]) for k in ("target", "model") if cfg.get(k)) or "n/a",
        "size": (f"{cfg['nodes']} x {cfg['procs_per_node']} procs"
                 if "nodes" in cfg and "procs_per_node" in cfg else ""),
        "data": _data_view(row.get("data"), row.get("eval_loss_by_source")),
        "figures": [
            fmt(m.get("tokens_per_s"), ",.0f"), fmt(m.get("tflops_per_device"), ".4g"),
            mfu_text(m), fmt_duration(m.get("wall_time_s")), _goodput_text(m),
            f"{fmt(m.get('initial_eval_loss'), '.3f')} → {fmt(m.get('final_eval_loss'), '.3f')}",
            fmt(_gpu_util(gpu), ".1f", "%")],
        # XID errors of the run's GPUs; None (n/a) where none were collected (a CPU run)
        "xids": len(gpu.get("xid_errors") or []) if gpu and gpu.get("available") else None,
        "cost": fmt(m.get("cost_usd"), ",.2f", " USD"),
    }


def render_runs_table(rows: list[dict[str, Any]]) -> str:
    """The runs table (the part of the page that refreshes): templates/runs_table.html.j2."""
    return render("runs_table.html.j2", rows=[_row_view(r) for r in rows], headings=_HEADINGS)


def render_runs_page(rows: list[dict[str, Any]], dirs: list[RunsDir]) -> str:
    """The runs table as one HTML page that refreshes its table in place (templates/
    runs.html.j2); links are relative (the page sits under a prefix)."""
    return render("runs.html.j2", rows=[_row_view(r) for r in rows], headings=_HEADINGS,
                  dirs=[str(d) for d in dirs], refresh_ms=REFRESH_MS)


def create_app() -> Any:
    """The FastAPI app: the page, its data as JSON, and each run's report.html.

    Every route needs a user who may read DAG runs (Airflow's auth manager, as the REST API).
    """
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="Fine-tuning runs",
                  dependencies=[Depends(requires_access_dag("GET", DagAccessEntity.RUN))])

    @app.get("/", response_class=HTMLResponse)
    def runs_page() -> str:
        dirs = runs_dirs()
        return render_runs_page(list_runs(dirs), dirs)

    @app.get("/table", response_class=HTMLResponse)
    def runs_table() -> str:
        return render_runs_table(list_runs(runs_dirs()))

    @app.get("/api/runs")
    def runs_json() -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k not in ("gpu", "mtime")}
                | {"gpu_util_pct": _gpu_util(row["gpu"])} for row in list_runs(runs_dirs())]

    @app.get("/runs/{name}/report.html")
    def report_page(name: str) -> HTMLResponse:
        run_dir = find_run(runs_dirs(), name)
        page = report_html(run_dir) if run_dir is not None else None
        if page is None:
            raise HTTPException(status_code=404, detail=f"no report for run {name!r}")
        return HTMLResponse(page)

    return app
