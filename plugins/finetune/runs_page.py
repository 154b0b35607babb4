"""The "Fine-tuning runs" page: every run directory under the output dirs (local directories or
s3:// prefixes, as eks runs write them), with its status and headline figures from report.json,
and a link to its report.html.

Pure functions (list_runs, render_runs_page) plus the FastAPI app the Airflow plugin mounts
(plugins/finetune_runs_plugin.py); standard library and FastAPI only.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from finetune.report import REPORT_HTML, REPORT_JSON, _fmt, _fmt_duration

URL_PREFIX = "/finetune-runs"
# Comma-separated directories or s3:// prefixes that hold run directories; default: the
# default output_dir. S3 is read with the AWS connection [finetune] aws_conn_id.
RUNS_DIRS_ENV = "AIRFLOW__FINETUNE__RUNS_DIRS"
AWS_CONN_ENV = "AIRFLOW__FINETUNE__AWS_CONN_ID"
METRICS_JSONL = "metrics.jsonl"

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
    from finetune.config import SPECS_BY_NAME, resolve_path

    names = [d.strip() for d in _setting(RUNS_DIRS_ENV, "runs_dirs").split(",") if d.strip()] or [
        SPECS_BY_NAME["output_dir"].default]
    return [name.rstrip("/") if name.startswith("s3://") else resolve_path(name)
            for name in names]


def s3_client() -> Any:
    from finetune.kube import aws_session

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
                "has_report": False, "mtime": mtime}
    return {"name": name, "run_id": report.get("run_id", name), "dir": run_dir,
            "status": report.get("status", "unknown"),
            "generated_at": report.get("generated_at"),
            "metrics": report.get("metrics") or {}, "config": report.get("config") or {},
            "gpu": report.get("gpu"), "has_report": has_report, "mtime": mtime,
            "error": report.get("error")}


def _error_cell(error: dict | None) -> str:
    """A failed run's cause under its status: stage and type, the message cut short."""
    if not error:
        return ""
    message = str(error.get("message") or "")
    short = message if len(message) <= 160 else message[:160] + "..."
    esc = html.escape
    return (f'<div class="error" title="{esc(message)}">{esc(str(error.get("stage")))}: '
            f'{esc(str(error.get("type")))}: {esc(short)}</div>')


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
            elif METRICS_JSONL in keys:
                rows.append(_row(name, run_dir, None, False,
                                 keys[METRICS_JSONL]["LastModified"].timestamp()))
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
                rows.append(_row(run_dir.name, str(run_dir), None, False,
                                 run_dir.stat().st_mtime,
                                 "running" if not report_path.exists() else "unreadable"))
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


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 0.3rem 0.6rem; }
th { background: #f5f5f5; text-align: left; } td.num { text-align: right; }
.status { padding: 0.1em 0.5em; border-radius: 0.3em; color: #fff; background: #757575; }
.status-success { background: #2e7d32; } .status-failed { background: #c62828; }
.status-running { background: #1565c0; } .xid { color: #c62828; font-weight: bold; }
.error { color: #c62828; font-size: 0.85em; max-width: 28em; }
.muted { color: #666; }
"""


def render_runs_page(rows: list[dict[str, Any]], dirs: list[RunsDir]) -> str:
    """The runs table as one HTML page; links are relative (the page sits under a prefix)."""
    esc = html.escape
    body = []
    for row in rows:
        m, cfg = row["metrics"], row["config"]
        mfu = m.get("mfu")
        xids = len((row["gpu"] or {}).get("xid_errors") or [])
        link = (f'<a href="runs/{esc(quote(row["name"]))}/{REPORT_HTML}">report</a>'
                if row["has_report"] else '<span class="muted">no report yet</span>')
        loss = (f"{_fmt(m.get('initial_eval_loss'), '.3f')} → "
                f"{_fmt(m.get('final_eval_loss'), '.3f')}")
        size = (f"{cfg['nodes']} x {cfg['procs_per_node']}"
                if "nodes" in cfg and "procs_per_node" in cfg else "n/a")
        cells = [
            f'<td>{esc(str(row["run_id"]))}</td>',
            f'<td><span class="status status-{esc(row["status"])}">{esc(row["status"])}'
            f"</span>{_error_cell(row.get('error'))}</td>",
            f'<td>{esc(str(row["generated_at"] or "n/a"))}</td>',
            f'<td>{esc(str(cfg.get("target", "n/a")))}</td>',
            f'<td>{esc(str(cfg.get("model", "n/a")))}</td>',
            f"<td>{esc(size)}</td>",
            f'<td class="num">{_fmt(m.get("tokens_per_s"), ",.0f")}</td>',
            f'<td class="num">{_fmt(m.get("tflops_per_device"), ".4g")}</td>',
            f'<td class="num">{_fmt(mfu * 100 if mfu is not None else None, ".1f", "%")}</td>',
            f'<td class="num">{_fmt_duration(m.get("wall_time_s"))}</td>',
            f"<td>{esc(loss)}</td>",
            f'<td class="num">{_fmt(_gpu_util(row["gpu"]), ".1f", "%")}</td>',
            f'<td class="num{" xid" if xids else ""}">{xids}</td>',
            f'<td class="num">{_fmt(m.get("cost_usd"), ",.2f", " USD")}</td>',
            f"<td>{link}</td>",
        ]
        body.append(f'<tr class="run">{"".join(cells)}</tr>')
    head = "".join(f"<th>{h}</th>" for h in (
        "run", "status", "report time", "target", "model", "nodes x procs", "tokens/s",
        "TFLOPs/device", "MFU", "wall time", "eval loss", "GPU util", "XID errors", "cost",
        ""))
    table = (f"<table><tr>{head}</tr>{''.join(body)}</table>" if rows
             else '<p class="muted">no runs yet</p>')
    where = ", ".join(esc(str(d)) for d in dirs)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>Fine-tuning runs</title><style>{_CSS}</style></head><body>"
            f"<h1>Fine-tuning runs</h1><p class=\"muted\">{len(rows)} run(s) in {where}</p>"
            f"{table}</body></html>\n")


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
