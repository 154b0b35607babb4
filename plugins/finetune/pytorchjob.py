"""Reading a PyTorchJob and its pods (as JSON dicts): pure functions, shared by the eks target's
polling wait and a deferrable trigger."""

from __future__ import annotations

from typing import Any

TERMINAL = ("Succeeded", "Failed")
# Waiting reasons that mean the container will not start by itself.
STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
                 "CreateContainerConfigError", "CreateContainerError")


def job_state(job: dict[str, Any]) -> tuple[str, str]:
    """(state, message): Succeeded or Failed once finished, else the newest true condition."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if c.get("status") == "True"]
    for terminal in TERMINAL:
        for c in true:
            if c.get("type") == terminal:
                return terminal, c.get("message") or c.get("reason") or ""
    if true:
        return true[-1].get("type", "Unknown"), true[-1].get("message") or ""
    return "Pending", ""


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why a pod failed or cannot run (OOMKilled, exit code, image pull...), or None."""
    status = pod.get("status") or {}
    reasons = []
    if status.get("reason"):  # for example Evicted
        reasons.append(f"{status['reason']}: {status.get('message', '')}".rstrip(": "))
    for cs in status.get("containerStatuses") or []:
        for which in ("state", "lastState"):
            state = cs.get(which) or {}
            term = state.get("terminated")
            if term and term.get("exitCode", 0) != 0:
                what = term.get("reason") or "Error"
                reasons.append(f"container {cs.get('name')} {what} (exit code "
                               f"{term.get('exitCode')})" + (
                                   f": {term['message']}" if term.get("message") else ""))
                break
            wait = state.get("waiting")
            if wait and wait.get("reason") in STUCK_REASONS:
                reasons.append(f"container {cs.get('name')} {wait['reason']}"
                               + (f": {wait['message']}" if wait.get("message") else ""))
                break
    if not reasons and status.get("phase") == "Failed":
        reasons.append("Failed")
    return "; ".join(reasons) or None


def split_log(text: str, after: str) -> tuple[list[str], str]:
    """Lines of a `timestamps=true` pod log newer than timestamp `after`; and the newest one.

    Kubernetes prefixes each line with an RFC 3339 timestamp of fixed width, so timestamps
    compare as strings.
    """
    lines, newest = [], after
    for raw in text.splitlines():
        ts, _, line = raw.partition(" ")
        if ts > after:
            lines.append(line)
            newest = max(newest, ts)
    return lines, newest
