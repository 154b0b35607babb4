"""Rank 0's Prometheus endpoint: the last step's metrics as gauges, so a Prometheus that scrapes
the trainer's pods sees the run live (containers/observability/ scrapes and plots them)."""

from __future__ import annotations

from typing import Any

# metrics.jsonl key -> (Prometheus series, help). The Grafana dashboard's queries name these.
TRAIN_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("finetune_step", "Optimizer steps done"),
    "loss": ("finetune_train_loss", "Training loss of the last step"),
    "lr": ("finetune_learning_rate", "Learning rate of the last step"),
    "grad_norm": ("finetune_grad_norm", "Gradient norm before clipping, last step"),
    "tokens_per_s": ("finetune_tokens_per_second", "Training tokens per second, all ranks"),
    "tflops_per_device": ("finetune_tflops_per_device", "Model TFLOP/s per device"),
    "mfu": ("finetune_mfu_ratio", "Model FLOPs utilisation (0..1)"),
    "step_time_s": ("finetune_step_time_seconds", "Wall time of the last step"),
    "peak_memory_bytes": ("finetune_peak_memory_bytes", "Peak memory of rank 0's device"),
}
# Method dpo's step metrics (DPO_METRICS); an SFT run leaves them at 0.
DPO_GAUGES: dict[str, tuple[str, str]] = {
    "rewards_chosen": ("finetune_dpo_rewards_chosen", "Mean reward of the chosen responses"),
    "rewards_rejected": ("finetune_dpo_rewards_rejected", "Mean reward of the rejected responses"),
    "reward_accuracy": ("finetune_dpo_reward_accuracy", "Share of pairs ranked right (0..1)"),
    "reward_margin": ("finetune_dpo_reward_margin", "Mean chosen minus rejected reward"),
}
EVAL_GAUGE = ("finetune_eval_loss", "Eval loss at the last evaluation")
MAX_STEPS_GAUGE = ("finetune_max_steps", "Optimizer steps the run will take")
ROWS_GAUGE = ("finetune_dataset_rows", "Usable data set rows, by split", ["split"])
SKIPPED_GAUGE = ("finetune_skipped_rows", "Bad data set rows skipped, by reason", ["reason"])


class MetricsEndpoint:
    """An HTTP server (prometheus_client, own registry) with one gauge per metric."""

    def __init__(self, port: int, max_steps: int, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.train = {key: Gauge(name, text, registry=self.registry)
                      for key, (name, text) in {**TRAIN_GAUGES, **DPO_GAUGES}.items()}
        self.eval = Gauge(*EVAL_GAUGE, registry=self.registry)
        Gauge(*MAX_STEPS_GAUGE, registry=self.registry).set(max_steps)
        self.rows = Gauge(*ROWS_GAUGE, registry=self.registry)
        self.skipped = Gauge(*SKIPPED_GAUGE, registry=self.registry)
        self.server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_address[1]

    def update_train(self, record: dict[str, Any]) -> None:
        for key, gauge in self.train.items():
            value = record.get(key)
            # a non-finite loss still shows: Prometheus has NaN and Inf
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)

    def update_data(self, train_rows: int, eval_rows: int, skipped: dict[str, int]) -> None:
        self.rows.labels(split="train").set(train_rows)
        self.rows.labels(split="eval").set(eval_rows)
        for reason, count in skipped.items():
            self.skipped.labels(reason=reason).set(count)

    def update_eval(self, eval_loss: float) -> None:
        self.eval.set(eval_loss)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
