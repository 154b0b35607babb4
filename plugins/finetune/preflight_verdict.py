"""Judge what the preflight measured (trainer/preflight.py) on every node before a run trains:
a node is bad when a GPU is unwell (uncorrected ECC errors, pending or failed row remaps or
retired pages, hardware or thermal slowdown, XID errors), when one of its GPUs is much slower
than the others, or when its all-reduce bus bandwidth is far below what its instance type
should reach (the instance profile's figure x BUSBW_FLOOR). The verdict is `preflight.json`
in the run directory; the report shows it as a table.
"""

from __future__ import annotations

from typing import Any

from finetune.targets.base import TrainingFailed
from finetune_contract.instance_types import BUSBW_FLOOR, InstanceProfile
from finetune_contract.preflight_result import PREFLIGHT_FILE, result_line  # noqa: F401 (re-exported)

# A GPU this much slower at a matmul than the run's median is flagged.
SLOW_GPU_FRACTION = 0.5
HOT_GPU_C = 90
# XIDs DCGM reported this recently make a node bad at preflight.
XID_WINDOW_S = 3600
# Replacing bad nodes: at most this many preflights per run (the first and two after
# replacements), so a cluster that keeps failing fails the run instead of looping.
PREFLIGHT_TRIES = 3


class PreflightFailed(TrainingFailed):
    """The run's nodes are not fit to train: the message names each bad node and why. Not
    retried: a retry would find the same nodes."""


def _gpu_problems(health: dict[str, Any]) -> list[str]:
    problems = []
    if health.get("ecc_uncorrected_volatile"):
        problems.append(f"{health['ecc_uncorrected_volatile']} uncorrected ECC error(s) since "
                        "the driver loaded")
    if health.get("row_remap_failure"):
        problems.append("a row remap failed (the GPU's memory cannot be repaired)")
    if health.get("row_remap_pending"):
        problems.append("row remap pending (needs a GPU reset)")
    if health.get("retired_pages_pending"):
        problems.append("retired pages pending (needs a GPU reset)")
    if health.get("throttle"):
        problems.append("clocks slowed down: " + ", ".join(health["throttle"]))
    if (health.get("temperature_c") or 0) >= HOT_GPU_C:
        problems.append(f"{health['temperature_c']} C")
    return problems


def judge(measured: dict[str, Any], profile: InstanceProfile | None,
          xids: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The verdict on what trainer/preflight.py measured: one row per node, its problems, and
    whether the run may train. `profile`: the instance type's (None on the local target: no
    bandwidth to expect); `xids`: XID codes per node name (DCGM, through Prometheus)."""
    xids = xids or {}
    gpu = measured["backend"] == "nccl"
    median = measured.get("matmul_median_tflops") or 0.0
    by_node: dict[int, list[dict[str, Any]]] = {}
    for rank in measured["ranks"]:
        by_node.setdefault(rank["node"], []).append(rank)
    expected_intra = profile.busbw_intra_gbps if profile and gpu else None
    expected_inter = profile.busbw_inter_gbps if profile and gpu else None
    rows = []
    for node, ranks in sorted(by_node.items()):
        name = ranks[0]["node_name"]
        problems = []
        for rank in sorted(ranks, key=lambda r: r["local_rank"]):
            where = f"GPU {rank['local_rank']}" if gpu else f"rank {rank['rank']}"
            problems += [f"{where}: {p}" for p in _gpu_problems(rank.get("health") or {})]
            if gpu and median and rank["matmul_tflops"] < SLOW_GPU_FRACTION * median:
                problems.append(f"{where}: matmul at {rank['matmul_tflops']:.0f} TFLOP/s, the "
                                f"run's median is {median:.0f}")
        if xids.get(name):
            problems.append("XID error(s) " + ", ".join(str(c) for c in sorted(set(xids[name])))
                            + " (DCGM)")
        intra = ranks[0].get("intra_busbw_gbps")
        if expected_intra and intra is not None and intra < BUSBW_FLOOR * expected_intra:
            problems.append(f"all-reduce within the node at {intra:.1f} GB/s bus bandwidth, "
                            f"below {BUSBW_FLOOR:.0%} of the {expected_intra:.0f} GB/s "
                            f"{profile.name if profile else ''} should reach")
        rows.append({"node": node, "node_name": name, "ranks": len(ranks),
                     "gpus": sorted({(r.get("health") or {}).get("name") or r["device"]
                                     for r in ranks}),
                     "matmul_tflops": [r["matmul_tflops"] for r in ranks],
                     "intra_busbw_gbps": intra, "expected_intra_gbps": expected_intra,
                     "xids": sorted(set(xids.get(name, []))), "problems": problems,
                     "ok": not problems})
    run_problems = []
    inter = measured.get("inter_busbw_gbps")
    if expected_inter and inter is not None and inter < BUSBW_FLOOR * expected_inter:
        run_problems.append(
            f"all-reduce across the {measured['nodes']} nodes at {inter:.1f} GB/s bus "
            f"bandwidth, below {BUSBW_FLOOR:.0%} of the {expected_inter:.0f} GB/s "
            f"{profile.name if profile else ''} should reach over EFA (is EFA in use? "
            "NCCL_DEBUG=INFO names the transport)")
    bad = [row["node_name"] for row in rows if not row["ok"]]
    return {"ok": not bad and not run_problems, "backend": measured["backend"],
            "instance_type": profile.name if profile else None,
            "message_mib": measured["message_mib"], "nodes": rows,
            "inter_busbw_gbps": inter, "expected_inter_gbps": expected_inter,
            "problems": run_problems, "bad_nodes": bad}


def failure_message(verdict: dict[str, Any], action: str) -> str:
    """Why the preflight failed, node by node; `action`: what was done about the bad nodes."""
    lines = [f"preflight failed: {action}"]
    for row in verdict["nodes"]:
        if not row["ok"]:
            lines.append(f"node {row['node_name']}: " + "; ".join(row["problems"]))
    lines += verdict["problems"]
    return "\n".join(lines)


def summary_line(verdict: dict[str, Any]) -> str:
    intra = [r["intra_busbw_gbps"] for r in verdict["nodes"] if r["intra_busbw_gbps"]]
    parts = [f"{len(verdict['nodes'])} node(s) checked ({verdict['backend']})"]
    if intra:
        parts.append(f"all-reduce within a node {min(intra):.1f}-{max(intra):.1f} GB/s")
    if verdict["inter_busbw_gbps"] is not None:
        parts.append(f"across nodes {verdict['inter_busbw_gbps']:.1f} GB/s")
    parts.append("all healthy" if verdict["ok"] else f"bad: {', '.join(verdict['bad_nodes'])}")
    return "; ".join(parts)
