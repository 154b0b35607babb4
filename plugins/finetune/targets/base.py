"""What every target is: the `Target` interface, a stage's `Wait`, and what every target gives
torchrun (`TORCHRUN_ENV`). Targets import this module; `finetune.targets` finds them by name.
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from finetune.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger

    from finetune.run_plan import RunPlan

# torchrun's environment on every target. The etcd-v2 and c10d rendezvous otherwise hand every
# restart round's workers the same TCPStore (the agent's, since torch 2.5), where the restarted
# workers read the previous round's keys: their peers' dead gloo/NCCL addresses (pytorch#135712).
# With it each round's rank-0 worker hosts a new store on a new port (as before torch 2.5).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Stage(enum.StrEnum):
    """The long stages the one deferrable operator runs (finetune.operators.StageOperator); the
    others are tasks of their own in finetune.pipeline."""

    PREPARE_DATA = "prepare_data"
    SCALE_UP = "scale_up"
    BUILD_IMAGE = "build_image"
    PREFLIGHT = "preflight"
    TRAIN = "train"
    EVALUATE = "evaluate"


def resumes(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a target's method as one a deferred stage resumes with, `method(cfg, event,
    state)`: a Wait may name it, and only such a method is called back (Target.resumer)."""
    method.__resumes__ = True
    return method


@dataclasses.dataclass(frozen=True)
class Wait:
    """A stage that is not done yet: defer on `trigger`, then call `resume` (a target's method
    marked @resumes) as `resume(cfg, event, state)`; it returns the stage's result or another
    Wait. The deferred task stores its name, and the target finds it again by that name.

    `state` is JSON-able (it is stored with the deferred task); `deadline` (epoch seconds, the
    trigger's own) lets the operator give the framework a timeout too.
    """

    trigger: BaseTrigger
    resume: Callable[..., Outcome]
    state: dict[str, Any]
    deadline: float | None = None

    def __post_init__(self) -> None:
        if not getattr(self.resume, "__resumes__", False):
            raise TypeError(f"{self.resume!r} is not a method marked @resumes")

    @property
    def resume_name(self) -> str:
        return self.resume.__name__


Outcome = dict | Wait


class StageFailed(RuntimeError):
    """A stage's definite verdict on the run: what is wrong does not fix itself in the minutes
    Airflow's retries take (capacity that did not come, a device plugin missing, pods that
    cannot be scheduled, a node group or image that is not what the run needs, a training that
    failed). The task fails at once, without a retry, which would only keep the nodes up to
    find the same again; teardown gives them back now. The message names what is wrong.
    Retries are for a try lost with its worker or scheduler, and for errors that may pass (a
    throttled or unreachable API): those are raised as anything else."""


class TrainingFailed(StageFailed):
    """The training itself failed (a worker's error, its deadline, a Failed job)."""


# What fails a stage without a retry: its verdicts, and run parameters refused (ConfigError).
VERDICTS: tuple[type[Exception], ...] = (StageFailed, ConfigError)


class Target(ABC):
    name: str
    # The methods a deferred stage may resume with (@resumes), by name: each class's own.
    RESUMERS: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.RESUMERS = frozenset(name for klass in cls.__mro__ for name, member in
                                 vars(klass).items() if getattr(member, "__resumes__", False))

    def run_stage(self, stage: Stage, cfg: RunConfig, **inputs: Any) -> Outcome:
        """The stage's method with the results of the tasks it follows."""
        method = {Stage.PREPARE_DATA: self.prepare_data, Stage.SCALE_UP: self.scale_up,
                  Stage.BUILD_IMAGE: self.build_image, Stage.PREFLIGHT: self.preflight,
                  Stage.TRAIN: self.train, Stage.EVALUATE: self.evaluate}[stage]
        return method(cfg, **inputs)

    def resumer(self, name: str) -> Callable[..., Outcome]:
        """The @resumes method a deferred stage named; ValueError for any other name (a task
        deferred by a version of the target that had a method this one has not)."""
        if name not in self.RESUMERS:
            raise ValueError(f"target {self.name} has no stage to resume named {name!r}; "
                             f"it resumes with: {', '.join(sorted(self.RESUMERS))}")
        return getattr(self, name)
    # Whether this machine (the Airflow worker) sees the paths the trainer reads, so validate
    # can read the model, tokenizer and data: yes locally; on a cluster absolute paths are the
    # pods' (mounted volumes).
    paths_are_local: bool = True
    # The `launcher` values this target runs; the default one (pytorchjob) is ignored by a
    # target that launches torchrun itself.
    launchers: tuple[str, ...] = ("pytorchjob",)

    @abstractmethod
    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        """Validate-time checks of this target's constraints: (field, message) per problem."""

    def plan_problems(self, cfg: RunConfig, plan: RunPlan) -> list[tuple[str, str]]:
        """Validate-time: what this target cannot give the run as planned (finetune.run_plan),
        such as its pods' grace on a notice; (field, message) per problem."""
        return []

    def prepare_data(self, cfg: RunConfig) -> Outcome:
        """Encode the run's data set once before any node is up (or reuse an identical one):
        here, on the Airflow worker (finetune.prepare_stage). Returns the later stages' run
        config (prepared_data and the counted split sizes set)."""
        from finetune.prepare_stage import prepare_run_data, stage_result

        cfg, record = prepare_run_data(cfg, s3_client=lambda: self.s3_client(cfg))
        return stage_result(cfg, record)

    def s3_client(self, cfg: RunConfig) -> Any:
        """S3 through the run's AWS connection (an s3:// output_dir's prepared set and record)."""
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=cfg.aws_conn_id).get_conn()

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
    def rendezvous(self, cfg: RunConfig) -> dict:
        """Give the run a clean rendezvous: its endpoint, backend and id."""

    @abstractmethod
    def preflight(self, cfg: RunConfig, image: dict, rendezvous: dict) -> Outcome:
        """Check every node of the run (GPU health, bus bandwidth) before it trains; a bad
        node is named (and on a cluster cordoned or replaced), and the stage fails."""

    @abstractmethod
    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> Outcome:
        """Run the trainer on every node; fail with the reason when it fails."""

    @abstractmethod
    def evaluate(self, cfg: RunConfig, trained: dict, image: dict, champion: dict) -> Outcome:
        """Run trainer.evaluate where the training ran, on the trained model (and on the
        `champion`'s, finetune.tracking.champion, when there is one); return what it wrote
        (evaluation.json beside the model)."""

    @abstractmethod
    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """Write report.json and report.html beside the model; return a small summary."""

    @abstractmethod
    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Stop and delete what the run started, give the nodes back. Runs after any failure."""

    @abstractmethod
    def release(self, cfg: RunConfig) -> dict:
        """What teardown does for the run itself, the nodes aside: stop and delete what it
        started (its processes or jobs, its rendezvous) and, when it failed before its report,
        leave a failed one. A sweep's teardown releases each trial, then gives the sweep's
        nodes back once."""
