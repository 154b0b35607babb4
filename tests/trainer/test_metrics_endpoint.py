"""Rank 0's Prometheus endpoint: a scrape sees the last step's metrics and the eval loss."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from finetune.etcd import free_port
from trainer.config import TrainConfig
from trainer.metrics import MetricsLog
from trainer.metrics_endpoint import EVAL_GAUGE, TRAIN_GAUGES


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples}


def step_record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-4 * step, "grad_norm": 0.5 + step,
            "tokens": 4096, "tokens_per_s": 8192.0 * step, "tflops_per_device": 1.5 * step,
            "mfu": 0.01 * step, "step_time_s": 0.5, "peak_memory_bytes": 2**30 + step}


def test_a_scrape_of_rank_0_sees_the_last_step_and_eval_loss(tmp_path):
    port = free_port()
    log = MetricsLog(str(tmp_path), rank=0, max_steps=10, log_interval=100, metrics_port=port)
    try:
        log.log_train(**step_record(1, 2.5))
        log.log_train(**step_record(2, 2.25))
        log.log_eval(2, 2.125)
        scraped = scrape(port)
        last = step_record(2, 2.25)
        for key, (name, _) in TRAIN_GAUGES.items():
            assert scraped[name] == pytest.approx(last[key]), name
        assert scraped[EVAL_GAUGE[0]] == 2.125
        assert scraped["finetune_max_steps"] == 10
        log.log_train(**step_record(3, float("nan")))  # a diverged loss shows as NaN
        assert math.isnan(scrape(port)["finetune_train_loss"])
        assert scrape(port)["finetune_step"] == 3
    finally:
        log.endpoint.close()


def test_other_ranks_and_port_0_serve_nothing(tmp_path):
    port = free_port()
    assert MetricsLog(str(tmp_path), rank=1, max_steps=10, log_interval=1,
                      metrics_port=port).endpoint is None
    with pytest.raises(OSError):
        scrape(port)
    assert MetricsLog(str(tmp_path), rank=0, max_steps=10, log_interval=1).endpoint is None


def test_metrics_port_out_of_range_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="- metrics_port: must be <= 65535, got 70000"):
        TrainConfig(metrics_port=70000)


def test_a_scrape_sees_the_usable_rows_and_the_skipped_rows_by_reason(tmp_path):
    port = free_port()
    log = MetricsLog(str(tmp_path), rank=0, max_steps=10, log_interval=100, metrics_port=port)
    try:
        log.log_data(57, 3, {"too_long": 2, "malformed": 1}, resumed=False)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {(s.name, tuple(s.labels.items())): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("finetune_dataset_rows", (("split", "train"),))] == 57
        assert samples[("finetune_dataset_rows", (("split", "eval"),))] == 3
        assert samples[("finetune_skipped_rows", (("reason", "too_long"),))] == 2
        assert samples[("finetune_skipped_rows", (("reason", "malformed"),))] == 1
    finally:
        log.endpoint.close()


def test_a_dpo_steps_rewards_are_gauges():
    from finetune_contract.fields import DPO_METRICS
    from trainer.metrics_endpoint import DPO_GAUGES

    assert set(DPO_GAUGES) == set(DPO_METRICS)  # every metric a dpo step logs is served
