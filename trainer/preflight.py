"""Preflight: before a run trains, check every node it got. Run by torchrun on all nodes, as the
training is, with the same image and devices:

python -m torch.distributed.run ... -m trainer.preflight --out RUN_DIR

Each rank checks its GPU through NVML (ECC errors, retired or remapped memory, clocks, their
throttle reasons, temperature) and times a matmul; then all ranks time NCCL all-reduces (gloo
on CPU) within each node and across all nodes and compute the bus bandwidth as nccl-tests
does (busbw = bytes / time x 2(n-1)/n). Rank 0 prints one line `PREFLIGHT {json}` and writes
`preflight_measured.json` in --out when that is a local directory. Judging the figures (against
the instance type's profile) is the Airflow side's (plugins/finetune/preflight.py): this
program only measures, and exits 0 whenever it could measure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from finetune_contract.preflight_result import MEASURED_FILE, RESULT_PREFIX


def gpu_health(index: int) -> dict[str, Any]:
    """NVML's view of one GPU; {"nvml": False} where NVML cannot be read (no driver here)."""
    try:
        import pynvml
    except ImportError:
        return {"nvml": False, "why": "nvidia-ml-py is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"nvml": False, "why": str(exc)}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        health: dict[str, Any] = {"nvml": True, "name": _text(pynvml.nvmlDeviceGetName(handle)),
                                  "uuid": _text(pynvml.nvmlDeviceGetUUID(handle))}
        health["temperature_c"] = pynvml.nvmlDeviceGetTemperature(
            handle, pynvml.NVML_TEMPERATURE_GPU)
        health["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        health["sm_clock_max_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(handle,
                                                                      pynvml.NVML_CLOCK_SM)
        health["throttle"] = _throttle_reasons(pynvml, handle)
        health["ecc_uncorrected_volatile"] = _optional(
            pynvml, lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
        health["ecc_uncorrected_aggregate"] = _optional(
            pynvml, lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC))
        # A100 and later remap rows instead of retiring pages: pending or failed is a bad GPU.
        rows = _optional(pynvml, lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
        if rows is not None:
            _corrected, _uncorrected, pending, failure = rows
            health["row_remap_pending"], health["row_remap_failure"] = bool(pending), \
                bool(failure)
        pending_pages = _optional(pynvml, lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(
            handle))
        if pending_pages is not None:
            health["retired_pages_pending"] = bool(pending_pages)
        return health
    finally:
        pynvml.nvmlShutdown()


def nvml_index(cuda_index: int) -> int:
    """NVML counts every GPU of the machine; CUDA only the visible ones, in their order."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if cuda_index < len(visible) and visible[cuda_index].isdigit():
        return int(visible[cuda_index])
    return cuda_index


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(pynvml: Any, read: Any) -> Any:
    """NVML's answer, or None where the GPU does not support the query."""
    try:
        return read()
    except pynvml.NVMLError:
        return None


# Throttle reasons that mean the GPU is unwell (not idle, not a user's power cap).
BAD_THROTTLE = {
    "HW_SLOWDOWN": 0x8,
    "SW_THERMAL_SLOWDOWN": 0x20,
    "HW_THERMAL_SLOWDOWN": 0x40,
    "HW_POWER_BRAKE_SLOWDOWN": 0x80,
}


def _throttle_reasons(pynvml: Any, handle: Any) -> list[str]:
    mask = _optional(pynvml, lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    if mask is None:
        mask = _optional(pynvml, lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    return [name for name, bit in BAD_THROTTLE.items() if mask and mask & bit]


def matmul_tflops(device: torch.device, seconds: float = 1.0) -> float:
    """Dense matmul throughput of this device, TFLOP/s (bf16 on a GPU, fp32 on the CPU)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    _sync(device)
    a @ b  # warm-up
    _sync(device)
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        count += 4
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * count / elapsed / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_busbw(group: Any, size: int, numel: int, device: torch.device, iters: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of `numel` floats in `group`, GB/s: the
    slowest rank's mean time sets it (dist's collectives end together)."""
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    for _ in range(3):  # warm-up: connections, buffers
        dist.all_reduce(tensor, group=group)
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    algbw = numel * 4 / elapsed.item() / 1e9
    return algbw * 2 * (size - 1) / size


def measure(message_mib: float, iters: int, procs_per_node: int) -> dict[str, Any] | None:
    """Every rank's checks and the bus bandwidths; the whole result on rank 0, else None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank % procs_per_node))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5),
                            **({"device_id": device} if cuda else {}))
    node = rank // procs_per_node
    nodes = world // procs_per_node
    mine: dict[str, Any] = {
        "rank": rank, "node": node, "hostname": socket.gethostname(),
        # the pod's node (the downward API's spec.nodeName), where Kubernetes runs it
        "node_name": os.environ.get("NODE_NAME") or socket.gethostname(),
        "device": str(device), "local_rank": local_rank,
        "health": gpu_health(nvml_index(local_rank)) if cuda else
        {"nvml": False, "why": "no GPU (CPU run)"},
        "matmul_tflops": round(matmul_tflops(device), 2),
    }
    # Every rank creates every group (dist.new_group is collective over the world).
    groups = [dist.new_group(list(range(n * procs_per_node, (n + 1) * procs_per_node)))
              for n in range(nodes)]
    numel = int(message_mib * 2**20 / 4)
    intra = None
    if procs_per_node > 1:
        intra = allreduce_busbw(groups[node], procs_per_node, numel, device, iters)
    inter = allreduce_busbw(None, world, numel, device, iters) if nodes > 1 else None
    mine["intra_busbw_gbps"] = None if intra is None else round(intra, 2)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"backend": "nccl" if cuda else "gloo", "world_size": world, "nodes": nodes,
            "procs_per_node": procs_per_node, "message_mib": message_mib, "iters": iters,
            "inter_busbw_gbps": None if inter is None else round(inter, 2),
            "ranks": gathered,
            "matmul_median_tflops": round(statistics.median(
                r["matmul_tflops"] for r in gathered), 2)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="where rank 0 writes " + MEASURED_FILE)
    parser.add_argument("--message-mib", type=float, default=0.0,
                        help="all-reduce size, MiB (default: 256 on GPUs, 16 on CPUs)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--procs-per-node", type=int,
                        default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    args = parser.parse_args(argv)
    size = args.message_mib or (256.0 if torch.cuda.is_available() else 16.0)
    result = measure(size, args.iters, args.procs_per_node)
    if result is not None:
        print(RESULT_PREFIX + json.dumps(result, sort_keys=True), flush=True)
        if args.out and "://" not in args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / MEASURED_FILE).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
