"""MLflow tracking and registry, and promotion: the Airflow side's only MLflow calls.

Every run is an MLflow run in the experiment named after its DAG: the validated config as
params, the per-step metrics, the evaluation, the report and the model's URI; a mixture's sources
as params (mixture/<name>), what each gave as metrics (data/<name>/...) and its eval loss per
source (eval_loss/<name>, per step). The champion is the
version of the registered model named after the DAG that the alias `champion` points at; a run
whose model beats it on `promotion_metric` by more than `promotion_margin` (both measured on this
run's eval set) becomes a new version and gets the alias.

The tracking URI: the Airflow connection `mlflow_default` (http(s), with basic-auth login and
password), else `[finetune] mlflow_tracking_uri`, else on the local target a SQLite store in the
checkout (`make mlflow` shows it). A server that cannot be reached does not fail the run: the
report warns, and without a champion to compare with nothing is promoted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.config import RunConfig
from finetune.report import REPORT_HTML, REPORT_JSON
from finetune_contract.fields import EVALUATION_FILE, LOWER_IS_BETTER
from finetune_contract.parameters import without_secrets

log = logging.getLogger(__name__)

MLFLOW_CONN_ID = "mlflow_default"
CONF_SECTION, CONF_KEY = "finetune", "mlflow_tracking_uri"
# The local target's embedded store: `make mlflow` serves the same two paths.
LOCAL_STORE = REPO_ROOT / "mlflow.db"
LOCAL_ARTIFACTS = REPO_ROOT / "mlartifacts"
CHAMPION_ALIAS = "champion"
DECISIONS = ("promoted", "rejected", "first")
# Where `make mlflow` serves the embedded store, for the runs page's links.
LOCAL_UI = "http://127.0.0.1:5000"
REACH_TIMEOUT_S = 5.0
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")


# --- the decision ----------------------------------------------------------------------------


def decide(challenger: float | None, champion: float | None, margin: float,
           higher_is_better: bool) -> str:
    """promoted when the challenger beats the champion by more than `margin`, first when there
    is no champion, else rejected (also when the challenger has no value)."""
    if challenger is None:
        return "rejected"
    if champion is None:
        return "first"
    gain = challenger - champion if higher_is_better else champion - challenger
    return "promoted" if gain > margin else "rejected"


def metric_of(measured: dict | None, metric: str) -> tuple[float | None, bool]:
    """(value, higher is better) of `promotion_metric` in an evaluation (or its champion part):
    eval_loss, perplexity, or <task>.<metric>."""
    if not measured:
        return None, metric not in LOWER_IS_BETTER
    if metric in LOWER_IS_BETTER:
        return measured.get("loss" if metric == "eval_loss" else "perplexity"), False
    task, _, name = metric.partition(".")
    value = ((measured.get("tasks") or {}).get(task) or {}).get(name)
    better = ((measured.get("higher_is_better") or {}).get(task) or {}).get(name, True)
    return value, bool(better)


# --- where MLflow is -------------------------------------------------------------------------


def tracking_uri(cfg: RunConfig) -> str | None:
    """The connection's URI, else the Airflow config's, else the local target's SQLite store;
    None when none applies (a cluster run with nothing configured)."""
    from airflow.configuration import conf

    conn = _connection()
    if conn is not None:
        host = conn.host or ""
        if "://" not in host:
            host = f"{conn.schema or 'http'}://{host}"
        uri = host.rstrip("/") + (f":{conn.port}" if conn.port else "")
        if conn.login:  # basic auth, as MLflow's client reads it; never part of the URI
            os.environ["MLFLOW_TRACKING_USERNAME"] = conn.login
            os.environ["MLFLOW_TRACKING_PASSWORD"] = conn.password or ""
        return uri
    configured = conf.get(CONF_SECTION, CONF_KEY, fallback="") or ""
    if configured.strip():
        return configured.strip()
    return f"sqlite:///{LOCAL_STORE}" if cfg.target == "local" else None


def _connection() -> Any:
    from airflow.sdk import Connection

    try:
        return Connection.get(MLFLOW_CONN_ID)
    except Exception:  # AirflowNotFoundException (its module moved between versions)
        return None


def shown_uri(uri: str | None) -> str | None:
    """The URI as reports and logs may show it: no user or password."""
    if not uri:
        return uri
    parts = urllib.parse.urlsplit(uri)
    if parts.username or parts.password:
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return uri


def unreachable(uri: str) -> str | None:
    """Why the tracking server cannot be used now, or None (a SQLite file always can)."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 else f"HTTP {exc.code} from {shown_uri(uri)}"
    except OSError as exc:
        return f"{shown_uri(uri)} cannot be reached ({getattr(exc, 'reason', exc)})"


@contextlib.contextmanager
def _client(uri: str) -> Iterator[Any]:
    """An MlflowClient that gives up in seconds, not MLflow's minutes of retries.

    A SQLite store is used by one process at a time (a lock file beside it): two tasks that
    first touch a new store would both create its tables, and one fails ("duplicate column").
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow import MlflowClient

    with contextlib.ExitStack() as stack:
        if uri.startswith("sqlite:///"):
            store = Path(uri.removeprefix("sqlite:///"))
            store.parent.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(f"{store}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield MlflowClient(tracking_uri=uri, registry_uri=uri)


def ui_link(uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI's page of a run: the server's, or `make mlflow`'s for the SQLite store."""
    if not (uri and experiment_id and run_id):
        return None
    base = shown_uri(uri) if uri.startswith(("http://", "https://")) else LOCAL_UI
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


# --- the champion ----------------------------------------------------------------------------


def champion(cfg: RunConfig, model_name: str) -> dict[str, Any]:
    """The registered model's champion: version, run, model URI and its logged metrics; {} when
    there is none; {"unavailable": why} when the registry cannot be read."""
    uri = tracking_uri(cfg)
    if uri is None:
        return {"unavailable": "no MLflow tracking URI is configured"}
    problem = unreachable(uri)
    if problem:
        return {"unavailable": problem}
    from mlflow.exceptions import MlflowException

    with _client(uri) as client:
        try:
            version = client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE",
                                  "NOT_FOUND"):
                return {}
            return {"unavailable": f"MLflow registry: {exc.message}"}
        metrics = client.get_run(version.run_id).data.metrics if version.run_id else {}
    return {"version": version.version, "run_id": version.run_id,
            "model_uri": version.tags.get("model_uri") or version.source,
            "metrics": dict(metrics)}


# --- tracking and promotion ------------------------------------------------------------------


def promote_run(cfg: RunConfig, model_name: str, summary: dict, champion_found: dict,
                model_uri: str, s3_client: Callable[[], Any],
                mlflow_run: dict | None = None) -> dict[str, Any]:
    """Track the run in MLflow, decide the promotion, register and alias a promoted model, and
    add `promotion` and `tracking` to the report; returns both sections. mlflow_run: an MLflow
    run that already holds the run's params and steps ({"run_id": ...}: a sweep's trial's
    child run, `track_sweep`), tracked into instead of a new one."""
    from finetune.outputs import add_report_sections, read_output

    report = json.loads(read_output(cfg.run_dir, REPORT_JSON, s3_client) or "{}")
    evaluation = report.get("evaluation") or {}
    value, higher = metric_of(evaluation, cfg.promotion_metric)
    warnings: list[str] = []
    champion_value, reason = _champion_value(cfg, evaluation, champion_found)
    if "unavailable" in champion_found:
        decision = "rejected"
        reason = (f"the champion could not be read ({champion_found['unavailable']}): nothing "
                  "is promoted without a comparison")
        warnings.append(f"MLflow: {champion_found['unavailable']}; the run is not tracked and "
                        "its model not promoted")
    else:
        decision = decide(value, champion_value, cfg.promotion_margin, higher)
    promotion = {"decision": decision, "metric": cfg.promotion_metric, "challenger": value,
                 "champion": champion_value, "margin": cfg.promotion_margin,
                 "champion_version": champion_found.get("version"), "reason": reason,
                 "version": None}
    uri = tracking_uri(cfg)
    tracking: dict[str, Any] = {"uri": shown_uri(uri), "experiment_id": None, "run_id": None}
    problem = "unavailable" in champion_found and champion_found["unavailable"]
    if uri and not problem:
        try:
            tracking, promotion["version"] = _track(uri, cfg, model_name, report, evaluation,
                                                    promotion, model_uri, s3_client, mlflow_run)
        except Exception as exc:  # the run's outcome stands without its tracking
            log.warning("MLflow tracking failed: %s", exc)
            warnings.append(f"MLflow tracking at {shown_uri(uri)} failed: {exc}")
            if decision != "rejected":
                promotion.update(decision="rejected", reason="the model could not be "
                                 f"registered in MLflow ({exc})")
    tracking["url"] = ui_link(uri, tracking.get("experiment_id"), tracking.get("run_id"))
    add_report_sections(cfg.run_dir, s3_client, promotion=promotion, tracking=tracking,
                        warnings=warnings)
    if tracking.get("run_id"):  # the final report, with its promotion, beside the run
        with _client(uri) as client, tempfile.TemporaryDirectory() as tmp:
            _log_files(client, tracking["run_id"], cfg.run_dir, (REPORT_JSON, REPORT_HTML),
                       Path(tmp), s3_client)
            client.set_terminated(tracking["run_id"])
    log.info("promotion: %s (%s %s vs champion %s, margin %s)%s", decision,
             cfg.promotion_metric, value, champion_value, cfg.promotion_margin,
             f"; MLflow run {tracking['run_id']}" if tracking.get("run_id") else "")
    return {"promotion": promotion, "tracking": tracking}


def _champion_value(cfg: RunConfig, evaluation: dict,
                    champion_found: dict) -> tuple[float | None, str]:
    """The champion's metric: measured on this run's eval set by the evaluate stage, else (a
    champion whose model could not be measured) its own logged value."""
    if not champion_found.get("version"):
        return None, "no champion yet"
    measured = evaluation.get("champion")
    if measured:
        return metric_of(measured, cfg.promotion_metric)[0], \
            f"champion version {champion_found['version']} measured on this run's eval set"
    logged = (champion_found.get("metrics") or {}).get(_metric_key(cfg.promotion_metric))
    return logged, (f"champion version {champion_found['version']}'s logged value (its model "
                    "was not measured here)")


def goodput_metrics(goodput: dict | None) -> dict[str, float]:
    """The run's goodput as MLflow metrics: the share that trained, the paid node-seconds and
    where each went (goodput/<category>_node_s), the preemptions and their cost."""
    if not goodput:
        return {}
    metrics = {"goodput": goodput["goodput"], "goodput/paid_node_s": goodput["paid_node_s"],
               "goodput/preemptions": goodput["preemptions"],
               "goodput/interruptions": len(goodput["interruptions"])}
    metrics |= {f"goodput/{name}_node_s": value for name, value in goodput["node_s"].items()}
    if goodput.get("cost_usd"):
        metrics |= {f"goodput/{name}_usd": value for name, value in goodput["cost_usd"].items()}
    return {key: value for key, value in metrics.items() if value is not None}


def source_params(data: dict | None) -> dict[str, str]:
    """A mixture's sources as MLflow params: mixture/<name> -> its data set and weight or rows."""
    return {f"mixture/{s['name']}": f"{s['dataset']} ("
            + (f"weight {s['weight']:g}" if s.get("weight") is not None else f"rows {s['rows']}")
            + ")" for s in (data or {}).get("sources") or []}


def source_metrics(data: dict | None, evaluation: dict | None) -> dict[str, float]:
    """What each source of a mixture gave, as MLflow metrics: data/<name>/<figure> (rows read,
    kept and skipped, training examples and their share, held-out examples), and the evaluate
    stage's loss on its held-out rows (eval/loss/<name>)."""
    out: dict[str, float] = {}
    for s in (data or {}).get("sources") or []:
        out |= {f"data/{s['name']}/{key}": s[key] for key in (
            "rows_read", "rows_kept", "skipped_rows", "train_examples", "share",
            "eval_examples") if isinstance(s.get(key), int | float)}
    out |= {f"eval/loss/{name}": loss for name, loss in
            ((evaluation or {}).get("loss_by_source") or {}).items()
            if isinstance(loss, int | float)}
    return out


def _metric_key(metric: str) -> str:
    return f"eval/{'loss' if metric == 'eval_loss' else metric}"


def _experiment_id(client: Any, model_name: str, uri: str) -> str:
    """The experiment named after the DAG, made when it is not there."""
    experiment = client.get_experiment_by_name(model_name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(model_name, artifact_location=_artifacts_beside(uri))


def _run_params(cfg: RunConfig, report: dict) -> list[Any]:
    """The run config as MLflow params (no secret), and a mixture's sources (mixture/<name>)."""
    from mlflow.entities import Param

    params = [Param(key, str(value)[:MAX_PARAM_CHARS])
              for key, value in sorted(without_secrets(cfg.to_dict()).items())]
    return params + [Param(key, value[:MAX_PARAM_CHARS])
                     for key, value in source_params(report.get("data")).items()]


def _step_metrics(report: dict, now: int) -> list[Any]:
    """The report's per-step series as MLflow metrics: the training's, the eval loss and a
    mixture's eval loss per source (eval_loss/<name>)."""
    from mlflow.entities import Metric

    metrics = [Metric(key, float(point[key]), now, int(point["step"]))
               for point in report.get("series", {}).get("train", [])
               for key in STEP_METRICS if point.get(key) is not None]
    metrics += [Metric("eval_loss", float(point["eval_loss"]), now, int(point["step"]))
                for point in report.get("series", {}).get("eval", [])
                if point.get("eval_loss") is not None]
    metrics += [Metric(f"eval_loss/{name}", float(loss), now, int(point["step"]))
                for point in report.get("series", {}).get("eval", [])
                for name, loss in (point.get("eval_loss_by_source") or {}).items()
                if loss is not None]
    return metrics


def _track(uri: str, cfg: RunConfig, model_name: str, report: dict, evaluation: dict,
           promotion: dict, model_uri: str, s3_client: Callable[[], Any],
           mlflow_run: dict | None = None) -> tuple[dict[str, Any], str | None]:
    from mlflow.entities import Metric, RunTag

    with _client(uri) as client, tempfile.TemporaryDirectory() as tmp:
        experiment_id = _experiment_id(client, model_name, uri)
        now = int(time.time() * 1000)
        if mlflow_run:  # its params and steps are there: what the evaluation adds
            run_id, params, metrics = mlflow_run["run_id"], [], []
            client.set_tag(run_id, "model_uri", model_uri)
        else:
            run = client.create_run(experiment_id, run_name=cfg.run_id, tags={
                "airflow.dag_id": model_name, "airflow.run_id": cfg.run_id,
                "model_uri": model_uri, "target": cfg.target})
            run_id = run.info.run_id
            params, metrics = _run_params(cfg, report), _step_metrics(report, now)
        metrics += [Metric(key, float(value), now, 0)
                    for key, value in _evaluation_metrics(evaluation).items()]
        metrics += [Metric(key, float(value), now, 0)
                    for key, value in goodput_metrics(report.get("goodput")).items()]
        metrics += [Metric(key, float(value), now, 0)
                    for key, value in source_metrics(report.get("data"), evaluation).items()]
        _log_batches(client, run_id, params, metrics)
        client.log_batch(run_id, tags=[RunTag("promotion", promotion["decision"])])
        _log_files(client, run_id, cfg.run_dir, (EVALUATION_FILE,), Path(tmp), s3_client)
        version = None
        if promotion["decision"] in ("promoted", "first"):
            source = model_uri
            if model_uri.startswith("file://"):
                # A registry takes a local model only from the run's own artifacts.
                client.log_artifacts(run_id, model_uri.removeprefix("file://"), "model")
                source = f"{client.get_run(run_id).info.artifact_uri}/model"
            with contextlib.suppress(Exception):  # it exists after the first promotion
                client.create_registered_model(model_name)
            created = client.create_model_version(
                model_name, source, run_id=run_id,
                tags={"model_uri": model_uri, "airflow.run_id": cfg.run_id})
            client.set_registered_model_alias(model_name, CHAMPION_ALIAS, created.version)
            version = created.version
    return {"uri": shown_uri(uri), "experiment_id": experiment_id, "run_id": run_id}, version


def _log_batches(client: Any, run_id: str, params: list[Any], metrics: list[Any]) -> None:
    for start in range(0, max(len(params), len(metrics)), 100):  # MLflow's batch limits
        client.log_batch(run_id, metrics=metrics[start:start + 100],
                         params=params[start:start + 100])


# --- a sweep: a parent run and a child run per trial -----------------------------------------

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a child run under its parent
# How a trial's outcome ends its child run (MLflow's run statuses).
OUTCOME_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def track_sweep(sweep: RunConfig, model_name: str, trials: list[dict[str, Any]],
                winner: int | None, settings: dict[str, Any],
                final: bool = False) -> dict[str, Any]:
    """The sweep in MLflow: a parent run (the sweep's settings, its winner) and a child run per
    trial (its params, steps, outcome and stop reason), found again by their Airflow run ids on
    a retry. `trials`: {"cfg": RunConfig, "outcome": dict, "report": report.json or None} per
    trial. Returns where they are ({"parent_run_id", "children": {trial: run id}, "url"}), or
    {"warning": why} when MLflow cannot be used; the sweep goes on either way. The winner's
    child run ends with its promotion (promote_run), or with the sweep (final)."""
    uri = tracking_uri(sweep)
    if uri is None:
        return {"warning": "no MLflow tracking URI is configured: the sweep is not tracked"}
    problem = unreachable(uri)
    if problem:
        return {"warning": f"MLflow: {problem}; the sweep is not tracked"}
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    with _client(uri) as client:
        experiment_id = _experiment_id(client, model_name, uri)
        parent = _run_of(client, experiment_id, sweep.run_id) or client.create_run(
            experiment_id, run_name=sweep.run_id, tags={
                "airflow.dag_id": model_name, "airflow.run_id": sweep.run_id,
                "target": sweep.target, "sweep": "parent"}).info.run_id
        _log_batches(client, parent, [Param(k, str(v)[:MAX_PARAM_CHARS])
                                      for k, v in sorted(settings.items())], [])
        children: dict[int, str] = {}
        for trial in trials:
            cfg, outcome = trial["cfg"], trial["outcome"]
            child = _run_of(client, experiment_id, cfg.run_id)
            if child is None:
                child = client.create_run(experiment_id, run_name=cfg.run_id, tags={
                    PARENT_TAG: parent, "airflow.dag_id": model_name,
                    "airflow.run_id": cfg.run_id, "target": cfg.target,
                    "sweep.trial": str(cfg.sweep_trial)}).info.run_id
                _log_batches(client, child, _run_params(cfg, trial.get("report") or {}),
                             _step_metrics(trial.get("report") or {}, now))
            tags = [RunTag("sweep.outcome", outcome["outcome"])]
            if outcome.get("reason"):
                tags.append(RunTag("sweep.reason", outcome["reason"][:5000]))
            client.log_batch(child, tags=tags)
            if cfg.sweep_trial != winner or final:
                client.set_terminated(child, OUTCOME_STATUS.get(outcome["outcome"], "FAILED"))
            children[cfg.sweep_trial] = child
        best = [t["outcome"].get("final_eval_loss") for t in trials
                if t["cfg"].sweep_trial == winner]
        client.log_batch(parent, tags=[RunTag("sweep.winner", str(winner))], metrics=[
            Metric("best_eval_loss", float(best[0]), now, 0)] if best and best[0] else [])
    return {"uri": shown_uri(uri), "experiment_id": experiment_id, "parent_run_id": parent,
            "children": children, "url": ui_link(uri, experiment_id, parent)}


def end_sweep_run(sweep: RunConfig, tracked: dict[str, Any], files: dict[str, str]) -> None:
    """The parent run ended, the sweep's report (`files`: name -> text) beside it."""
    uri = tracking_uri(sweep)
    if not uri or not tracked.get("parent_run_id"):
        return
    with _client(uri) as client, tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
            client.log_artifact(tracked["parent_run_id"], str(Path(tmp) / name))
        client.set_terminated(tracked["parent_run_id"])


def _run_of(client: Any, experiment_id: str, airflow_run_id: str) -> str | None:
    """The MLflow run an earlier try made for this Airflow run id, if any."""
    quoted_id = airflow_run_id.replace("'", "\\'")
    found = client.search_runs([experiment_id], max_results=1,
                               filter_string=f"tags.`airflow.run_id` = '{quoted_id}'")
    return found[0].info.run_id if found else None


def _artifacts_beside(uri: str) -> str | None:
    """A SQLite store's artifacts: the folder beside its file (a server chooses its own)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / LOCAL_ARTIFACTS.name).as_uri()


def _evaluation_metrics(evaluation: dict) -> dict[str, float]:
    """The evaluation as flat MLflow metrics: eval/loss, eval/perplexity, eval/<task>.<metric>."""
    out = {f"eval/{key}": evaluation[key] for key in ("loss", "perplexity")
           if isinstance(evaluation.get(key), int | float)}
    for task, scores in (evaluation.get("tasks") or {}).items():
        out.update({f"eval/{task}.{metric}": value for metric, value in scores.items()
                    if isinstance(value, int | float)})
    return out


def _log_files(client: Any, run_id: str, run_dir: str, names: tuple[str, ...], work: Path,
               s3_client: Callable[[], Any]) -> None:
    from finetune.outputs import read_output

    for name in names:
        text = read_output(run_dir, name, s3_client)
        if text is not None:
            (work / name).write_text(text, encoding="utf-8")
            client.log_artifact(run_id, str(work / name))
