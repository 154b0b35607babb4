"""FLOPs per token (finetune_contract.families), the GPUs' peaks, and a run's throughput from
its per-step train records (metrics.jsonl): the one definition the trainer's summary.json, the
run report, the runs page, experiment tracking and the planner (finetune_contract.planner) all use.

tokens/s is the run's total tokens over its total step time, not the mean of per-step rates: a
mean of rates weighs a 0.05 s step like a 7 s stall and overstates a run on a loaded machine
many times over. TFLOPs per device and MFU are weighted by step time the same way (total FLOPs
over total time). The first step pays for warm-up and is left out when there are others.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# The architecture table's (one definition per family), re-exported for their callers.
from finetune_contract.families import flops_per_token as flops_per_token
from finetune_contract.families import parameter_count as parameter_count

# Dense bf16 peak per device (no sparsity), by a substring of the CUDA device name.
PEAK_FLOPS_BY_DEVICE = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# HBM bandwidth per device, bytes per second, by a substring of the name (the more specific
# first): what memory-bound kernels (elementwise, casts, the optimizer) run at. NVIDIA's
# published figures for the SXM parts the instance types carry.
MEMORY_BANDWIDTH_BY_DEVICE = {"H200": 4.8e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
                              "A100": 1.555e12}
# The chunked loss's logits per chunk (trainer/loss.py): 2**29 elements is 4k tokens of a 128k
# vocabulary, 1 GB in bf16; the planner counts its memory. Offloaded blocks (the lean mode, whose
# peak is the loss's chunk or a block's backward, whichever is larger) take a quarter: 1k tokens.
LOGITS_PER_CHUNK = 1 << 29
OFFLOADED_LOGITS_PER_CHUNK = 1 << 27
THROUGHPUT_KEYS = ("tokens_per_s", "tflops_per_device", "mfu", "median_step_time_s",
                   "median_step_tokens_per_s", "timed_steps", "timed_tokens", "timed_time_s")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def mfu(tflops_per_device: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation; None without a trusted peak, or when the rate exceeds the
    peak (then the peak is not one, and no figure beats a wrong one)."""
    if not peak_flops:
        return None
    ratio = tflops_per_device * 1e12 / peak_flops
    return ratio if 0 <= ratio <= 1 else None


def run_throughput(train: Sequence[dict[str, Any]]) -> dict[str, float | int | None]:
    """{tokens_per_s, tflops_per_device, mfu, median_step_time_s, median_step_tokens_per_s,
    timed_steps, timed_tokens, timed_time_s} over the train records after the first.

    A record counts when its step_time_s is a positive number; its tokens are `tokens`, or
    tokens_per_s x step_time_s for a record without them. Values are None when no record counts.
    """
    steady = list(train[1:]) or list(train)
    timed = []
    for record in steady:
        seconds = _number(record.get("step_time_s"))
        if seconds is None or seconds <= 0:
            continue
        tokens = _number(record.get("tokens"))
        rate = _number(record.get("tokens_per_s"))
        if tokens is None and rate is not None:
            tokens = rate * seconds
        timed.append((record, seconds, tokens))
    counted = [(seconds, tokens) for _, seconds, tokens in timed if tokens is not None]
    total_time = sum(seconds for seconds, _ in counted)
    total_tokens = sum(tokens for _, tokens in counted)

    def time_weighted(key: str) -> float | None:
        pairs = [(_number(r.get(key)), s) for r, s, _ in timed]
        pairs = [(v, s) for v, s in pairs if v is not None]
        weight = sum(s for _, s in pairs)
        return sum(v * s for v, s in pairs) / weight if weight else None

    return {
        "tokens_per_s": total_tokens / total_time if total_time else None,
        "tflops_per_device": time_weighted("tflops_per_device"),
        "mfu": time_weighted("mfu"),
        "median_step_time_s": statistics.median(s for _, s, _ in timed) if timed else None,
        "median_step_tokens_per_s": (statistics.median(t / s for s, t in counted)
                                     if counted else None),
        "timed_steps": len(counted),
        "timed_tokens": int(total_tokens) if counted else None,
        "timed_time_s": total_time if counted else None,
    }
