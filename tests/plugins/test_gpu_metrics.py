"""gpu_metrics.py against a real Prometheus: it scrapes a test exporter that serves DCGM series
with pod labels for a known number of scrapes; the report's per-GPU and per-node figures must
equal what the exporter served."""

from __future__ import annotations

import json
import time

import pytest

from finetune.etcd import free_port
from finetune.gpu_metrics import (
    DCGM_SERIES,
    job_pod_regex,
    pod_selector,
    prometheus_gpu_metrics,
    redact_url,
    sampled_gpu_metrics,
    xid_codes_by_node,
)
from finetune.report import write_report
from tests.support.prometheus import TextExporter, start_prometheus

NAMESPACE = "ml"
JOB = "llm-finetune-run1"
SCRAPES = 5  # the job's series are served this many times, then disappear
# (namespace, pod, node, gpu): the job's four GPUs on two nodes, and two GPUs that are not the
# job's (another job in the namespace; a pod of the same name in another namespace).
JOB_GPUS = [(NAMESPACE, f"{JOB}-master-0", "node-a", "0"), (NAMESPACE, f"{JOB}-master-0",
            "node-a", "1"), (NAMESPACE, f"{JOB}-worker-0", "node-b", "0"),
            (NAMESPACE, f"{JOB}-worker-0", "node-b", "1")]
OTHER_GPUS = [(NAMESPACE, "other-job-worker-0", "node-c", "0"),
              ("team-b", f"{JOB}-master-0", "node-c", "1")]
XID_GPU = ("node-b", "1")
XID_CODE = 79


def served_value(series: str, index: int, node: str, gpu: str, scrape: int) -> float:
    """What the exporter serves: a different sequence per series, GPU and scrape."""
    if series == "DCGM_FI_DEV_XID_ERRORS":
        return XID_CODE if (node, gpu) == XID_GPU and scrape >= 2 else 0
    if index >= len(JOB_GPUS):
        return 999.0  # a GPU that is not the job's: would show up in any max
    return 10.0 * (list(DCGM_SERIES).index(series) + 1) + 7 * index + 3 * (scrape % 3) + 0.5


class DcgmExporter(TextExporter):
    """Serves DCGM-format text; records every value it served, per (series, node, gpu)."""

    def __init__(self) -> None:
        super().__init__(self.dcgm_text)
        self.served: dict[tuple[str, str, str], list[float]] = {}

    def dcgm_text(self, scrape: int) -> str:
        lines = []
        if scrape < SCRAPES:
            for series in DCGM_SERIES:
                lines.append(f"# TYPE {series} gauge")
                for index, (ns, pod, node, gpu) in enumerate(JOB_GPUS + OTHER_GPUS):
                    value = served_value(series, index, node, gpu, scrape)
                    if index < len(JOB_GPUS):
                        self.served.setdefault((series, node, gpu), []).append(value)
                    lines.append(
                        f'{series}{{gpu="{gpu}",UUID="GPU-{node}-{gpu}",device="nvidia{gpu}",'
                        f'modelName="NVIDIA H100 80GB HBM3",Hostname="{node}",'
                        f'container="trainer",namespace="{ns}",pod="{pod}"}} {value}')
        lines.append("exporter_up 1")
        return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """Prometheus after it scraped the exporter SCRAPES times (and once more without the job's
    series); yields (url, exporter, start, end) with the job's window."""
    tmp = tmp_path_factory.mktemp("prometheus")
    exporter = DcgmExporter()
    target = exporter.start()
    start = time.time()
    proc, url = start_prometheus(tmp, [target])
    try:
        deadline = time.monotonic() + 60
        while exporter.scrapes <= SCRAPES and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exporter.scrapes > SCRAPES, "Prometheus did not scrape the exporter"
        time.sleep(0.5)  # the last scrape's samples appended
        yield url, exporter, start, time.time()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        exporter.shutdown()


@pytest.mark.slow
def test_per_gpu_and_per_node_figures_equal_what_the_exporter_served(scraped):
    url, exporter, start, end = scraped
    section = prometheus_gpu_metrics(url, namespace=NAMESPACE, pod_regex=job_pod_regex(JOB),
                                     start=start, end=end)
    assert section["available"] and section["missing"] is None
    assert [(g["node"], g["gpu"]) for g in section["gpus"]] == [
        (node, gpu) for _, _, node, gpu in JOB_GPUS]  # the other job's GPUs are filtered out
    for gpu in section["gpus"]:
        assert gpu["pods"] == [next(p for _, p, n, g in JOB_GPUS
                                    if (n, g) == (gpu["node"], gpu["gpu"]))]
        assert gpu["model"] == "NVIDIA H100 80GB HBM3"
        for series, name in DCGM_SERIES.items():
            served = exporter.served[(series, gpu["node"], gpu["gpu"])]
            assert len(served) == SCRAPES
            assert gpu["metrics"][name]["mean"] == pytest.approx(sum(served) / len(served))
            assert gpu["metrics"][name]["max"] == max(served)
    for node in section["nodes"]:
        assert node["gpus"] == 2
        for series, name in DCGM_SERIES.items():
            served = [v for (s, n, _), values in exporter.served.items()
                      if s == series and n == node["node"] for v in values]
            assert node["metrics"][name]["mean"] == pytest.approx(sum(served) / len(served))
            assert node["metrics"][name]["max"] == max(served)
    # the plotted series come from query_range: per GPU, within the window, values served
    util = section["series"]["gpu_util_pct"]
    assert sorted(util) == ["node-a/gpu0", "node-a/gpu1", "node-b/gpu0", "node-b/gpu1"]
    served_util = set(exporter.served[("DCGM_FI_DEV_GPU_UTIL", "node-a", "0")])
    assert util["node-a/gpu0"] and {v for _, v in util["node-a/gpu0"]} <= served_util
    assert all(start - 1 <= t <= end + 1 for t, _ in util["node-a/gpu0"])


@pytest.mark.slow
def test_an_xid_error_is_flagged_on_its_gpu_and_in_the_report(scraped, tmp_path):
    url, _, start, end = scraped
    section = prometheus_gpu_metrics(url, namespace=NAMESPACE, pod_regex=job_pod_regex(JOB),
                                     start=start, end=end)
    assert section["xid_errors"] == [{"node": "node-b", "gpu": "1",
                                      "pods": [f"{JOB}-worker-0"], "codes": [XID_CODE]}]
    assert any("XID ERROR on node-b GPU 1: XID 79" in w for w in section["warnings"])
    report = write_report(tmp_path, run_id="r1", status="success", config={}, gpu=section)
    assert any("XID ERROR" in w for w in report["warnings"])
    page = (tmp_path / "report.html").read_text()
    assert 'class="xid"' in page and "XID 79" in page


@pytest.mark.slow
def test_xid_codes_are_found_per_node_over_a_window_and_only_for_the_nodes_asked(scraped):
    url, _, start, end = scraped
    window = end - start + 5
    assert xid_codes_by_node(url, None, ["node-a", "node-b"], end, window) == {
        "node-b": [XID_CODE]}
    assert xid_codes_by_node(url, None, ["node-a", "node-c"], end, window) == {}
    assert xid_codes_by_node(url, None, ["node-b"], start - 60, 30) == {}  # before it


@pytest.mark.slow
def test_a_window_without_the_jobs_series_says_metrics_are_missing(scraped):
    url, _, start, end = scraped
    section = prometheus_gpu_metrics(url, namespace=NAMESPACE,
                                     pod_regex=job_pod_regex("no-such-job"), start=start, end=end)
    assert not section["available"]
    assert "no DCGM series" in section["missing"] and "no-such-job" in section["missing"]


def test_a_prometheus_that_does_not_answer_gives_a_report_that_says_metrics_are_missing(
        tmp_path):
    url = f"http://127.0.0.1:{free_port()}/"
    section = prometheus_gpu_metrics(url, namespace=NAMESPACE, pod_regex=job_pod_regex(JOB),
                                     start=time.time() - 60, end=time.time(), timeout=2,
                                     auth=("user", "s3cret"))
    assert not section["available"]
    assert section["missing"].startswith("GPU metrics missing: Prometheus at http://127.0.0.1:")
    assert "s3cret" not in json.dumps(section)
    report = write_report(tmp_path, run_id="r1", status="success", config={}, gpu=section)
    assert report["status"] == "success"
    assert report["gpu"]["missing"] == section["missing"]
    page = (tmp_path / "report.html").read_text()
    assert "GPU metrics missing" in page and "s3cret" not in page


def test_selectors_escape_what_they_are_given():
    assert pod_selector("ml", job_pod_regex("a.b")) == \
        '{namespace="ml",pod=~"a\\\\.b-(master|worker)-[0-9]+"}'
    assert pod_selector("ml", 'x"} or vector(1) #') == \
        '{namespace="ml",pod=~"x\\"} or vector(1) #"}'
    with pytest.raises(ValueError, match="namespace"):
        pod_selector('ml"}', ".*")
    with pytest.raises(ValueError, match="pod_regex"):
        pod_selector("ml", "(")
    assert redact_url("https://u:p@prom.example:9090/prom?token=x") == \
        "https://prom.example:9090/prom"


def test_nvml_samples_summarise_per_gpu_like_prometheus_does():
    samples = [{"time": 100.0 + i, "gpus": [
        {"gpu": 0, "uuid": "GPU-0", "model": "H100", "gpu_util_pct": 50 + i, "power_w": 300.0,
         "fb_used_mib": 1000 * i, "temperature_c": 60, "sm_clock_mhz": 1980,
         "mem_copy_util_pct": 20}]} for i in range(4)]
    section = sampled_gpu_metrics(samples, node="laptop")
    assert section["source"] == "nvml" and section["available"]
    gpu = section["gpus"][0]
    assert gpu["metrics"]["gpu_util_pct"] == {"mean": 51.5, "max": 53}
    assert section["nodes"][0]["metrics"]["fb_used_mib"] == {"mean": 1500.0, "max": 3000}
    assert section["series"]["gpu_util_pct"]["laptop/gpu0"][0] == [100.0, 50]
    assert not sampled_gpu_metrics([{"time": 1.0, "cpu_percent": 5}], node="x")["available"]


def test_the_resource_sampler_records_host_cpu_and_memory_while_it_runs(tmp_path):
    from finetune.gpu_metrics import HOST_SAMPLES_FILE, ResourceSampler, host_section, load_samples

    with ResourceSampler(tmp_path, interval=0.1):
        deadline = time.monotonic() + 10
        while len(load_samples(tmp_path / HOST_SAMPLES_FILE)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    samples = load_samples(tmp_path / HOST_SAMPLES_FILE)
    assert len(samples) >= 3
    host = host_section(samples)
    assert 0 <= host["metrics"]["cpu_percent"]["max"] <= 100
    assert 0 < host["metrics"]["memory_used_bytes"]["max"] <= host["memory_total_bytes"]
    assert [t for t, _ in host["series"]["cpu_percent"]] == sorted(r["time"] for r in samples)


@pytest.mark.slow
def test_eks_collect_metrics_queries_the_jobs_pods_over_the_train_window(scraped):
    import dataclasses

    from finetune.targets.eks.target import EksTarget
    from finetune.validate import validate_params

    url, exporter, start, end = scraped
    cfg = dataclasses.replace(validate_params({}, run_id="r"), namespace=NAMESPACE,
                              prometheus_url=url)
    section = EksTarget().gpu_metrics(cfg, {"job": JOB, "started": start, "finished": end,
                                            "wall_time_s": end - start})
    assert [g["metrics"]["power_w"]["max"] for g in section["gpus"]] == [
        max(exporter.served[("DCGM_FI_DEV_POWER_USAGE", n, g)]) for _, _, n, g in JOB_GPUS]
    assert section["xid_errors"][0]["codes"] == [XID_CODE]
    no_url = EksTarget().gpu_metrics(dataclasses.replace(cfg, prometheus_url=""), {"job": JOB})
    assert not no_url["available"] and "no prometheus_url" in no_url["missing"]


def test_prometheus_credentials_come_from_an_airflow_connection_and_travel_in_a_header(
        monkeypatch):
    from finetune.gpu_metrics import PrometheusClient, prometheus_endpoint

    monkeypatch.setenv("AIRFLOW_CONN_PROM_TEST", "http://grafana:hunter2@prom.example:9090")
    url, auth = prometheus_endpoint("", "prom_test")
    assert url == "http://prom.example:9090" and auth == ("grafana", "hunter2")
    assert prometheus_endpoint("https://other:9090", "prom_test")[0] == "https://other:9090"
    assert prometheus_endpoint("http://p:9090", "") == ("http://p:9090", None)
    client = PrometheusClient(url, auth=auth)
    assert "hunter2" not in client.url
    assert client.headers["Authorization"] == "Basic Z3JhZmFuYTpodW50ZXIy"
