"""Targets: where a run's stages happen. The DAG calls one interface; each target is one class.

A stage returns its result, a small JSON-able dict that travels between tasks through XCom, or
a `Wait`: a trigger to defer on, the target's method to resume with and the state to hand it.
The one deferrable operator (finetune.operators.StageOperator) runs every long stage that way;
a target that never waits (local) returns results at once. No code outside `targets/` asks
which target it has.

Also here: what every target gives torchrun (`TORCHRUN_ENV`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from finetune.config import RunConfig

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger

# torchrun's environment on every target. The etcd-v2 and c10d rendezvous otherwise hand every
# restart round's workers the same TCPStore (the agent's, since torch 2.5), where the restarted
# workers read the previous round's keys: their peers' dead gloo/NCCL addresses (pytorch#135712).
# With it each round's rank-0 worker hosts a new store on a new port (as before torch 2.5).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclasses.dataclass(frozen=True)
class Wait:
    """A stage that is not done yet: defer on `trigger`, then call the target's method named
    `resume` as `resume(cfg, event, state)`; it returns the stage's result or another Wait.

    `state` is JSON-able (it is stored with the deferred task); `deadline` (epoch seconds, the
    trigger's own) lets the operator give the framework a timeout too.
    """

    trigger: BaseTrigger
    resume: str
    state: dict[str, Any]
    deadline: float | None = None


Outcome = dict | Wait


class TrainingFailed(RuntimeError):
    """The training itself failed (a worker's error, its deadline): the stage fails without a
    retry, which would only spend the nodes' time again; a lost try is retried instead."""


class Target(ABC):
    name: str

    @abstractmethod
    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        """Validate-time checks of this target's constraints: (field, message) per problem."""

    @abstractmethod
    def snapshot(self, cfg: RunConfig) -> dict:
        """Setup: record what teardown must restore. Must not fail in practice."""

    @abstractmethod
    def scale_up(self, cfg: RunConfig) -> Outcome:
        """Make the run's nodes available."""

    @abstractmethod
    def build_image(self, cfg: RunConfig) -> Outcome:
        """Provide the trainer image (or environment) the run uses."""

    @abstractmethod
    def reset_etcd(self, cfg: RunConfig) -> dict:
        """Give the run a clean rendezvous: its endpoint, backend and id."""

    @abstractmethod
    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> Outcome:
        """Run the trainer on every node; fail with the reason when it fails."""

    @abstractmethod
    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """Write report.json and report.html beside the model; return a small summary."""

    @abstractmethod
    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Stop and delete what the run started, give the nodes back. Runs after any failure."""

    def cancel(self, cfg: RunConfig, state: dict) -> None:  # noqa: B027 (most have nothing)
        """The task of a stage was killed on a worker: stop what the stage started (`state`
        is the last Wait's). The trigger's on_kill does it while the task is deferred."""


class UnavailableTarget(Target):
    """A target listed in the form whose implementation is not in this version."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        return [("target", f"{self.name!r} is not available: {self.reason}")]

    def _unavailable(self, *args: Any) -> dict:
        raise RuntimeError(f"target {self.name!r} is not available: {self.reason}")

    snapshot = scale_up = build_image = reset_etcd = _unavailable
    train = collect_metrics = teardown = _unavailable


def get_target(name: str, **options: Any) -> Target:
    """The target called `name`; `options` are its constructor's (poll intervals, timeouts)."""
    if name == "local":
        from finetune.targets.local import LocalTarget

        return LocalTarget(**options)
    if name == "eks":
        from finetune.targets.eks.target import EksTarget

        return EksTarget(**options)
    raise ValueError(f"unknown target {name!r}")


def run_target(run_config: dict[str, Any], **options: Any) -> tuple[Target, RunConfig]:
    """The validated run config (as XCom carries it) and the target it names."""
    cfg = RunConfig.from_dict(run_config)
    return get_target(cfg.target, **options), cfg
