"""Throughput accounting (FLOPs per token, peak FLOPs, MFU) and the rank-0 metrics log."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from finetune_contract.throughput import PEAK_FLOPS_BY_DEVICE, run_throughput

METRICS_FILE = "metrics.jsonl"


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, n: int = 4096, bursts: int = 5,
    seconds: float = 0.1,
) -> float:
    """FLOP/s of an n x n matmul: the best of `bursts` runs of about `seconds` each, so one
    burst slowed by other work on the device does not set the peak."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm up kernels and caches
    best = 0.0
    for _ in range(bursts):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        iterations, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, b)
            iterations += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * iterations / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it comes from), the same on every rank.

    Known GPUs use their datasheet number; other GPUs the best of several bursts of a large
    matmul in `dtype`. CPUs get none: their rate depends on what else runs on the host (a
    matmul measured at start under one load and steps run under another gave MFUs above
    100%), so a CPU run reports TFLOPs per device and no MFU.
    """
    if device.type != "cuda":
        return None, "none: CPUs have no trusted peak (their rate depends on the host's load)"
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS_BY_DEVICE.items():
        if key in name:
            return flops, f"spec:{key}"
    measured = torch.tensor(measure_matmul_flops(device, dtype), dtype=torch.float64, device=device)
    # Every rank has the same GPU model; the slowest measurement is the one to doubt.
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return measured.item(), f"measured:{name}-{str(dtype).removeprefix('torch.')}-matmul"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class MetricsLog:
    """Rank 0 appends one JSON line per train step and per eval to `metrics.jsonl`."""

    def __init__(
        self,
        output_dir: str,
        rank: int,
        max_steps: int,
        log_interval: int,
        resumed_from_step: int | None = None,
        metrics_port: int = 0,
    ):
        self.path = Path(output_dir) / METRICS_FILE
        self.rank, self.max_steps, self.log_interval = rank, max_steps, log_interval
        self.step_times: list[float] = []
        self.train: list[dict[str, Any]] = []
        self.endpoint = None
        # train records of steps after the checkpoint resumed from: the round before trained
        # them, this one trains them again (rank 0's)
        self.dropped: list[dict[str, Any]] = []
        if rank == 0:
            self._keep_history_until(resumed_from_step)
            if metrics_port:
                from trainer.metrics_endpoint import MetricsEndpoint

                self.endpoint = MetricsEndpoint(metrics_port, max_steps)
                print(f"metrics for Prometheus on port {self.endpoint.port}", flush=True)

    def _keep_history_until(self, step: int | None) -> None:
        """A fresh run starts an empty log; a resumed one drops what came after its checkpoint.

        So the log holds each step once, as if the run had not been interrupted.
        """
        kept = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                    if step is not None and record["step"] <= step:
                        kept.append(line + "\n")
                    elif record["type"] == "train":
                        self.dropped.append(record)
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line torn by the crash that caused the restart
        self.path.write_text("".join(kept))

    def _write(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def log_train(self, **record: Any) -> None:
        record = {"type": "train", **record, "time": time.time()}
        self.train.append(record)
        self.step_times.append(record["step_time_s"])
        self._write(record)
        if self.endpoint is not None:
            self.endpoint.update_train(record)
        step = record["step"]
        if self.rank == 0 and (step % self.log_interval == 0 or step == self.max_steps):
            recent = self.step_times[-self.log_interval :]
            eta = (self.max_steps - step) * sum(recent) / len(recent)
            mfu = record.get("mfu")
            # What a reader looks for first (step, ETA, loss) leads: log views cut long lines.
            print(
                f"step {step}/{self.max_steps} eta {format_duration(eta)} "
                f"loss {record['loss']:.4f} | tokens/s {record['tokens_per_s']:.0f} "
                f"step {record['step_time_s']:.2f}s lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} "
                f"tflops/device {record['tflops_per_device']:.3f}"
                + (f" mfu {mfu:.1%}" if mfu is not None else ""),
                flush=True,
            )

    def log_data(self, train_rows: int, eval_rows: int, skipped: dict[str, int],
                 resumed: bool) -> None:
        """The data set's usable rows and its skipped ones by reason (a resumed run has them)."""
        if not resumed:
            # max_steps: what a progress view (the runs page) counts the steps against
            self._write({"type": "data", "step": 0, "max_steps": self.max_steps,
                         "train_rows": train_rows,
                         "eval_rows": eval_rows, "skipped_rows": sum(skipped.values()),
                         "skipped_rows_by_reason": skipped, "time": time.time()})
        if self.endpoint is not None:
            self.endpoint.update_data(train_rows, eval_rows, skipped)

    def log_eval(self, step: int, eval_loss: float,
                 by_source: dict[str, float] | None = None) -> None:
        """The eval loss at `step`; a mixture's per source too (eval_loss_by_source)."""
        sources = {"eval_loss_by_source": by_source} if by_source else {}
        self._write({"type": "eval", "step": step, "eval_loss": eval_loss, **sources,
                     "time": time.time()})
        if self.endpoint is not None:
            self.endpoint.update_eval(eval_loss)
        if self.rank == 0:
            print(f"step {step}/{self.max_steps} eval_loss {eval_loss:.4f}" + "".join(
                f" | {name} {loss:.4f}" for name, loss in (by_source or {}).items()), flush=True)

    def throughput_summary(self) -> dict[str, float | int | None]:
        """This run's throughput (finetune_contract.throughput: total tokens over total step
        time, steps after the first)."""
        return run_throughput(self.train)
