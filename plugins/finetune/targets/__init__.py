"""Targets: where a run's stages happen. The DAG calls one interface; each target is one class.

A stage returns its result, a small JSON-able dict that travels between tasks through XCom, or
a `Wait`: a trigger to defer on, the target's method to resume with and the state to hand it.
The one deferrable operator (finetune.operators.StageOperator) runs every long stage that way;
a target that never waits (local) returns results at once. No code outside `targets/` asks
which target it has.
"""

from __future__ import annotations

from typing import Any

from finetune.config import RunConfig
from finetune.targets.base import Target


def get_target(name: str, **options: Any) -> Target:
    """The target called `name`; `options` are its constructor's (poll intervals, timeouts)."""
    if name == "local":
        from finetune.targets.local.target import LocalTarget

        return LocalTarget(**options)
    if name == "eks":
        from finetune.targets.eks.target import EksTarget

        return EksTarget(**options)
    raise ValueError(f"unknown target {name!r}")


def run_target(run_config: dict[str, Any], **options: Any) -> tuple[Target, RunConfig]:
    """The validated run config (as XCom carries it) and the target it names."""
    cfg = RunConfig.from_dict(run_config)
    return get_target(cfg.target, **options), cfg
