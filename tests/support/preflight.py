"""What trainer/preflight.py measures, made to order (`measured`): healthy nodes at a chosen bus
bandwidth, with the problems a test puts on chosen GPUs."""

from __future__ import annotations

from typing import Any

HEALTHY = {"nvml": True, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0",
           "temperature_c": 41, "sm_clock_mhz": 1410, "sm_clock_max_mhz": 1410,
           "throttle": [], "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
           "row_remap_pending": False, "row_remap_failure": False}


def measured(nodes: int = 2, procs_per_node: int = 8, *, backend: str = "nccl",
             intra: float | None = 220.0, inter: float | None = 38.0,
             node_names: list[str] | None = None,
             health: dict[tuple[int, int], dict[str, Any]] | None = None,
             matmul: dict[tuple[int, int], float] | None = None) -> dict[str, Any]:
    """The result rank 0 prints; `health`/`matmul`: changes for (node, local rank)."""
    names = node_names or [f"ip-10-0-0-{n}" for n in range(nodes)]
    ranks = []
    for node in range(nodes):
        for local in range(procs_per_node):
            gpu = backend == "nccl"
            ranks.append({
                "rank": node * procs_per_node + local, "node": node, "local_rank": local,
                "hostname": f"pod-{node}", "node_name": names[node],
                "device": f"cuda:{local}" if gpu else "cpu",
                "health": {**HEALTHY, **(health or {}).get((node, local), {})} if gpu
                else {"nvml": False, "why": "no GPU (CPU run)"},
                "matmul_tflops": (matmul or {}).get((node, local), 250.0 if gpu else 0.05),
                "intra_busbw_gbps": intra if procs_per_node > 1 else None})
    values = sorted(r["matmul_tflops"] for r in ranks)
    return {"backend": backend, "world_size": len(ranks), "nodes": nodes,
            "procs_per_node": procs_per_node, "message_mib": 256.0, "iters": 20,
            "inter_busbw_gbps": inter if nodes > 1 else None, "ranks": ranks,
            "matmul_median_tflops": values[len(values) // 2]}
