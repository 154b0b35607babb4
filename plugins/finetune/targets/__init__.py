"""Targets: where a run's stages happen. The DAG calls one interface; each target is one class.

Stage results are small JSON-able dicts: they travel between tasks through XCom.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from finetune.config import RunConfig


class Target(ABC):
    name: str

    @abstractmethod
    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        """Validate-time checks of this target's constraints: (field, message) per problem."""

    @abstractmethod
    def snapshot(self, cfg: RunConfig) -> dict:
        """Setup: record what teardown must restore. Must not fail in practice."""

    @abstractmethod
    def scale_up(self, cfg: RunConfig) -> dict:
        """Make the run's nodes available."""

    @abstractmethod
    def build_image(self, cfg: RunConfig) -> dict:
        """Provide the trainer image (or environment) the run uses."""

    @abstractmethod
    def reset_etcd(self, cfg: RunConfig) -> dict:
        """Give the run a clean rendezvous: its endpoint, backend and id."""

    @abstractmethod
    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> dict:
        """Run the trainer on every node; fail with the reason when it fails."""

    @abstractmethod
    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """Write report.json and report.html beside the model; return a small summary."""

    @abstractmethod
    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Stop and delete what the run started, give the nodes back. Runs after any failure."""


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


def get_target(name: str) -> Target:
    if name == "local":
        from finetune.targets.local import LocalTarget

        return LocalTarget()
    if name == "eks":
        from finetune.targets.eks import EksTarget

        return EksTarget()
    raise ValueError(f"unknown target {name!r}")


def run_target(run_config: dict[str, Any]) -> tuple[Target, RunConfig]:
    """The validated run config (as XCom carries it) and the target it names."""
    cfg = RunConfig.from_dict(run_config)
    return get_target(cfg.target), cfg
