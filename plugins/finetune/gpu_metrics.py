"""GPU metrics for the report: DCGM exporter series from Prometheus (eks), or samples taken on
this machine during training (local: host CPU and memory, NVML where a GPU and pynvml exist).

Both sources end in the same `gpu` section of report.json (`gpu_section`): per GPU and per node
mean and max of each series, XID errors flagged, and per-GPU time series for the plots.
It runs in the Airflow worker: the standard library, psutil, and pynvml where a GPU is.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from finetune.names import DNS_LABEL

log = logging.getLogger(__name__)

# DCGM exporter series -> the name the report uses (unit in the name).
DCGM_SERIES: dict[str, str] = {
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util_pct",
    "DCGM_FI_MEM_COPY_UTIL": "mem_copy_util_pct",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_FB_USED": "fb_used_mib",
    "DCGM_FI_DEV_XID_ERRORS": "xid_errors",
}
XID_SERIES = "DCGM_FI_DEV_XID_ERRORS"
GPU_METRICS = tuple(DCGM_SERIES.values())
# The series the report plots over time, per GPU.
PLOTTED = ("gpu_util_pct", "fb_used_mib", "power_w", "temperature_c")
# Points per plotted series: Prometheus allows 11,000; a report page needs a few hundred.
MAX_POINTS = 300
HOST_SAMPLES_FILE = "resource_samples.jsonl"



class PrometheusError(RuntimeError):
    """Prometheus did not answer, or answered with an error."""


# --- selectors -------------------------------------------------------------------------------


def _promql_string(value: str) -> str:
    """A PromQL double-quoted string literal holding `value` exactly."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def job_pod_regex(job_name: str) -> str:
    """RE2 regex (Prometheus anchors it) for the pods of a PyTorchJob: <job>-master|worker-N."""
    literal = re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", job_name)
    return literal + "-(master|worker)-[0-9]+"


def pod_selector(namespace: str, pod_regex: str) -> str:
    """`{namespace="...",pod=~"..."}`: the DCGM exporter's pod labels of the job's GPUs."""
    if not DNS_LABEL.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a Kubernetes namespace name")
    try:
        re.compile(pod_regex)
    except re.error as exc:
        raise ValueError(f"pod_regex {pod_regex!r} is not a regular expression: {exc}") from None
    return f"{{namespace={_promql_string(namespace)},pod=~{_promql_string(pod_regex)}}}"


def redact_url(url: str) -> str:
    """The URL without user:password@ or a query string (either may carry a secret)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# --- the Prometheus HTTP API -----------------------------------------------------------------


class PrometheusClient:
    """The two read endpoints of Prometheus's HTTP API the report needs."""

    def __init__(self, url: str, timeout: float = 10.0,
                 auth: tuple[str, str] | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"prometheus_url {redact_url(url)!r} is not an http(s) URL")
        # credentials (from an Airflow connection) travel in a header, never in a URL
        self.url, self.timeout = redact_url(url).rstrip("/"), timeout
        self.headers = {"Accept": "application/json"}
        if auth is not None:
            self.headers["Authorization"] = "Basic " + base64.b64encode(
                f"{auth[0]}:{auth[1]}".encode()).decode()

    def _get(self, path: str, params: dict[str, str]) -> dict:
        request = urllib.request.Request(
            f"{self.url}{path}?{urllib.parse.urlencode(params)}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            # Prometheus explains a bad query in a JSON body with the 400/422
            try:
                detail = json.load(exc).get("error", exc.reason)
            except (ValueError, AttributeError):
                detail = exc.reason
            raise PrometheusError(f"HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(str(getattr(exc, "reason", exc))) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else body
            raise PrometheusError(f"query failed: {error!r}")
        return body["data"]

    def query(self, promql: str, at: float) -> list[dict]:
        """Instant vector at `at` (epoch seconds): [{"metric": labels, "value": [t, "v"]}]."""
        data = self._get("/api/v1/query", {"query": promql, "time": f"{at:.3f}"})
        return data["result"] if data.get("resultType") == "vector" else []

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        """Range query: [{"metric": labels, "values": [[t, "v"], ...]}]."""
        data = self._get("/api/v1/query_range", {
            "query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
        return data["result"]


# --- accumulating per GPU --------------------------------------------------------------------


@dataclass
class _Stat:
    total: float = 0.0
    count: int = 0
    peak: float = -math.inf

    def add(self, total: float, count: int, peak: float) -> None:
        self.total, self.count = self.total + total, self.count + count
        self.peak = max(self.peak, peak)

    def summary(self) -> dict[str, float | None]:
        if not self.count:
            return {"mean": None, "max": None}
        return {"mean": self.total / self.count, "max": self.peak}


@dataclass
class _Gpu:
    node: str
    gpu: str
    uuid: str | None = None
    model: str | None = None
    pods: set[str] = field(default_factory=set)
    stats: dict[str, _Stat] = field(default_factory=dict)
    xid_codes: set[int] = field(default_factory=set)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


class _Gpus:
    """GPUs keyed by (node, gpu index); series of one GPU under several label sets merge."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], _Gpu] = {}

    def get(self, labels: dict[str, str]) -> _Gpu:
        node = labels.get("Hostname") or labels.get("node") or labels.get("instance") or "?"
        index = labels.get("gpu") or labels.get("UUID") or "?"
        gpu = self.by_key.setdefault((node, index), _Gpu(node=node, gpu=index))
        gpu.uuid = gpu.uuid or labels.get("UUID")
        gpu.model = gpu.model or labels.get("modelName")
        if labels.get("pod"):
            gpu.pods.add(labels["pod"])
        return gpu


def _float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def gpu_section(gpus: Iterable[_Gpu], *, source: str, query: dict[str, Any],
                warnings: list[str] | None = None) -> dict[str, Any]:
    """The report's `gpu` section from accumulated GPUs (either source)."""
    gpus = sorted(gpus, key=lambda g: (g.node, _natural(g.gpu)))
    nodes: dict[str, dict[str, _Stat]] = {}
    node_gpus: dict[str, int] = {}
    for gpu in gpus:
        node_gpus[gpu.node] = node_gpus.get(gpu.node, 0) + 1
        per_node = nodes.setdefault(gpu.node, {})
        for name, stat in gpu.stats.items():
            per_node.setdefault(name, _Stat()).add(stat.total, stat.count, stat.peak)
    xid = [{"node": g.node, "gpu": g.gpu, "pods": sorted(g.pods), "codes": sorted(g.xid_codes)}
           for g in gpus if g.xid_codes]
    all_warnings = list(warnings or [])
    for entry in xid:
        all_warnings.append(
            f"XID ERROR on {entry['node']} GPU {entry['gpu']}: XID "
            f"{', '.join(str(c) for c in entry['codes'])} (see NVIDIA's XID table; the GPU may "
            "need a reset or the node replacing)")
    return {
        "source": source,
        "available": bool(gpus),
        "missing": None if gpus else "no GPU samples in the run's time window",
        "query": query,
        "gpus": [{"node": g.node, "gpu": g.gpu, "uuid": g.uuid, "model": g.model,
                  "pods": sorted(g.pods),
                  "metrics": {n: g.stats[n].summary() for n in GPU_METRICS if n in g.stats}}
                 for g in gpus],
        "nodes": [{"node": node, "gpus": node_gpus[node],
                   "metrics": {n: stats[n].summary() for n in GPU_METRICS if n in stats}}
                  for node, stats in nodes.items()],
        "xid_errors": xid,
        "series": {name: {f"{g.node}/gpu{g.gpu}": [[t, v] for t, v in g.series[name]]
                          for g in gpus if g.series.get(name)} for name in PLOTTED},
        "warnings": all_warnings,
    }


def missing_section(source: str, reason: str, query: dict[str, Any]) -> dict[str, Any]:
    """A `gpu` section that says the metrics are missing, and why; the run is not failed."""
    return {"source": source, "available": False, "missing": reason, "query": query,
            "gpus": [], "nodes": [], "xid_errors": [], "series": {}, "warnings": []}


def _natural(text: str) -> tuple:
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


# --- from Prometheus (eks) -------------------------------------------------------------------


def prometheus_endpoint(url: str, conn_id: str) -> tuple[str, tuple[str, str] | None]:
    """(base URL, basic-auth credentials or None): the run's prometheus_url, with the login and
    password of the Airflow HTTP connection `conn_id` (whose host serves when url is empty)."""
    if not conn_id:
        return url, None
    from airflow.sdk import Connection

    conn = Connection.get(conn_id)
    if not url:
        scheme = conn.schema if conn.schema in ("http", "https") else "http"
        port = f":{conn.port}" if conn.port else ""
        url = f"{scheme}://{conn.host}{port}" if conn.host else ""
    auth = (conn.login, conn.password or "") if conn.login else None
    return url, auth


def prometheus_gpu_metrics(url: str, *, namespace: str, pod_regex: str, start: float,
                           end: float, timeout: float = 10.0,
                           auth: tuple[str, str] | None = None) -> dict[str, Any]:
    """The job's DCGM series over [start, end] (epoch seconds) -> the report's `gpu` section.

    Mean and max are exact over the raw samples (`sum_over_time`, `count_over_time`,
    `max_over_time` at `end`); the plotted series come from `query_range`. Prometheus not
    answering gives a section that says the metrics are missing instead of an exception.
    """
    if end <= start:
        raise ValueError(f"the time window is empty: start {start} >= end {end}")
    selector = pod_selector(namespace, pod_regex)
    window = max(1, math.ceil(end - start))
    step = max(1.0, math.ceil(window / MAX_POINTS))
    query = {"url": redact_url(url), "selector": selector, "start": _iso(start),
             "end": _iso(end), "step_s": step}
    try:
        client = PrometheusClient(url, timeout=timeout, auth=auth)
        gpus = _Gpus()
        for series, name in DCGM_SERIES.items():
            parts = {}
            for fn in ("sum_over_time", "count_over_time", "max_over_time"):
                for item in client.query(f"{fn}({series}{selector}[{window}s])", end):
                    key = tuple(sorted(item["metric"].items()))
                    parts.setdefault(key, {})[fn] = _float(item["value"][1])
            for key, values in parts.items():
                if None in (values.get("sum_over_time"), values.get("count_over_time"),
                            values.get("max_over_time")):
                    continue
                gpu = gpus.get(dict(key))
                gpu.stats.setdefault(name, _Stat()).add(
                    values["sum_over_time"], int(values["count_over_time"]),
                    values["max_over_time"])
                if series == XID_SERIES and values["max_over_time"] > 0:
                    gpu.xid_codes.add(int(values["max_over_time"]))
            if name in PLOTTED or series == XID_SERIES:
                promql = f"{series}{selector}" + (" > 0" if series == XID_SERIES else "")
                for item in client.query_range(promql, start, end, step):
                    gpu = gpus.get(item["metric"])
                    points = [(float(t), v) for t, raw in item["values"]
                              if (v := _float(raw)) is not None]
                    if series == XID_SERIES:
                        # the gauge holds the last XID code; every distinct one is reported
                        gpu.xid_codes.update(int(v) for _, v in points if v > 0)
                    else:
                        gpu.series.setdefault(name, []).extend(points)
    except (PrometheusError, ValueError) as exc:
        reason = f"GPU metrics missing: Prometheus at {redact_url(url)} did not answer ({exc})"
        log.warning("%s", reason)
        return missing_section("prometheus", reason, query)
    for gpu in gpus.by_key.values():
        for points in gpu.series.values():
            points.sort()
    section = gpu_section(gpus.by_key.values(), source="prometheus", query=query)
    if not section["available"]:
        section["missing"] = (f"GPU metrics missing: Prometheus at {redact_url(url)} has no "
                              f"DCGM series for {selector} between {query['start']} and "
                              f"{query['end']} (is the DCGM exporter scraped, with pod labels?)")
    return section


# --- sampled on this machine (local) ---------------------------------------------------------


def _nvml() -> Any:
    """pynvml (nvidia-ml-py) initialised, or None: NVML is used when present, never required."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: NVMLError and its many subclasses
        return None
    return pynvml


def _nvml_sample(nvml: Any) -> list[dict[str, Any]]:
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpus.append({
            "gpu": str(index),
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "model": _text(nvml.nvmlDeviceGetName(handle)),
            "gpu_util_pct": util.gpu,
            "mem_copy_util_pct": util.memory,
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "temperature_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "fb_used_mib": memory.used / 1024**2,
        })
    return gpus


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ResourceSampler:
    """Samples this machine (CPU %, memory used, and each GPU through NVML when available)
    every `interval` seconds into <run_dir>/resource_samples.jsonl while training runs."""

    def __init__(self, run_dir: Path, interval: float = 2.0):
        self.path = Path(run_dir) / HOST_SAMPLES_FILE
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def __enter__(self) -> ResourceSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 10)

    def _run(self) -> None:
        import psutil

        nvml = _nvml()
        psutil.cpu_percent(None)  # the first call only sets the baseline
        try:
            with self.path.open("a", encoding="utf-8") as out:
                while not self._stop.wait(self.interval):
                    memory = psutil.virtual_memory()
                    record: dict[str, Any] = {
                        "time": time.time(), "cpu_percent": psutil.cpu_percent(None),
                        "memory_used_bytes": memory.total - memory.available,
                        "memory_total_bytes": memory.total}
                    if nvml is not None:
                        try:
                            record["gpus"] = _nvml_sample(nvml)
                        except Exception as exc:  # a GPU fell off the bus: keep host samples
                            record["gpu_error"] = str(exc)
                    out.write(json.dumps(record) + "\n")
                    out.flush()
        finally:
            if nvml is not None:
                nvml.nvmlShutdown()


def load_samples(path: Path) -> list[dict]:
    """The sampler's records; torn or foreign lines are skipped."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and _float(record.get("time")) is not None:
            records.append(record)
    return records


def host_section(samples: list[dict]) -> dict[str, Any] | None:
    """CPU and memory of this machine during training: mean, max and the series."""
    if not samples:
        return None
    out: dict[str, Any] = {"samples": len(samples), "metrics": {}, "series": {}}
    for name in ("cpu_percent", "memory_used_bytes"):
        points = [(r["time"], v) for r in samples if (v := _float(r.get(name))) is not None]
        stat = _Stat()
        for _, v in points:
            stat.add(v, 1, v)
        out["metrics"][name] = stat.summary()
        out["series"][name] = [[t, v] for t, v in points]
    out["memory_total_bytes"] = _float(samples[-1].get("memory_total_bytes"))
    return out


def sampled_gpu_metrics(samples: list[dict], node: str) -> dict[str, Any]:
    """The `gpu` section from NVML samples taken on this machine (`node` names it)."""
    query = {"source": HOST_SAMPLES_FILE}
    gpus = _Gpus()
    for record in samples:
        for sample in record.get("gpus") or []:
            gpu = gpus.get({"Hostname": node, "gpu": str(sample.get("gpu")),
                            "UUID": sample.get("uuid") or "", "modelName": sample.get("model")
                            or ""})
            for name in GPU_METRICS:
                value = _float(sample.get(name))
                if value is None:
                    continue
                gpu.stats.setdefault(name, _Stat()).add(value, 1, value)
                if name in PLOTTED:
                    gpu.series.setdefault(name, []).append((record["time"], value))
    if not gpus.by_key:
        return missing_section("nvml", "no GPU samples: no GPU on this machine, or NVML "
                               "(nvidia-ml-py) is not installed", query)
    return gpu_section(gpus.by_key.values(), source="nvml", query=query)


def xid_codes_by_node(url: str, auth: tuple[str, str] | None, nodes: list[str], at: float,
                      window_s: float) -> dict[str, list[int]]:
    """XID codes DCGM reported on each of `nodes` in the `window_s` seconds before `at` (the
    gauge holds the last code; a node with none is left out). A node is the exporter's
    `Hostname` label, or the scrape's `node` (containers/observability/prometheus-scrape.yaml),
    as the report reads them."""
    if not nodes:
        return {}
    pattern = _promql_string("|".join(re.escape(n) for n in nodes))
    promql = (f"({XID_SERIES}{{Hostname=~{pattern}}} > 0) or "
              f"({XID_SERIES}{{node=~{pattern}}} > 0)")
    found: dict[str, set[int]] = {}
    step = max(1.0, window_s / 240)
    for sample in PrometheusClient(url, auth=auth).query_range(promql, at - window_s, at, step):
        node = sample["metric"].get("Hostname") or sample["metric"].get("node", "")
        found.setdefault(node, set()).update(int(float(v)) for _, v in sample["values"])
    return {node: sorted(codes) for node, codes in found.items()}
