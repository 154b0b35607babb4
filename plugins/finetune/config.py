"""The run config: `RunConfig`, one typed, immutable record of a run's parameters and of what
the run derives from them (its names and directory, counts, the prepared data set).

Its parameter fields are views of the contract's table (finetune_contract.parameters): each
parameter's type and default, nothing declared here again. `finetune.validate` makes one from
a DAG run's params, or raises `ConfigError` naming every bad field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune_contract.parallel_dims import ParallelDims
from finetune_contract.parameters import PARAMETERS


class ConfigError(ValueError):
    """Invalid run parameters; `errors` holds (field, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        lines = "\n".join(f"- {field}: {message}" for field, message in errors)
        super().__init__(f"invalid run parameters ({len(errors)}):\n{lines}")


class _RunConfig:
    """Everything a run needs, typed and checked: one field per parameter of the contract's
    table, and the run's own (below). Stages receive it through XCom as a dict."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def parallel_dims(self) -> ParallelDims:
        """The parallel layout of the planned world (the trainer makes its own from the world
        it starts in)."""
        return ParallelDims.of(self, world_size=self.world_size, procs_per_node=self.procs_per_node)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        # A field the dict lacks (one added since the run was validated) takes its default.
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


# What the run derives from its parameters; validate and the stages set them.
_RUN_FIELDS: tuple[tuple[str, type, dataclasses.Field], ...] = (
    ("run_id", str, dataclasses.field()),
    ("run_name", str, dataclasses.field()),  # file-system-safe run id
    ("rdzv_id", str, dataclasses.field()),  # DNS-safe, unique per DAG run
    ("run_dir", str, dataclasses.field()),  # absolute: <output_dir>/<run_name>
    ("preset_version", int, dataclasses.field(default=0)),  # the preset's; 0 without one
    # Counted by validate where it can read the data set (0: not counted): the training split's
    # rows (packed: about how many sequences) and micro-batches per data-parallel rank per epoch.
    ("counted_train_rows", int, dataclasses.field(default=0)),
    ("counted_batches_per_epoch", int, dataclasses.field(default=0)),
    # A sweep's trial (finetune.sweep): the sweep's directory (its rung records, its trials'
    # records) and the trial's index there; "" and -1 for a run of its own.
    ("sweep_dir", str, dataclasses.field(default="")),
    ("sweep_trial", int, dataclasses.field(default=-1)),
    # The rendezvous id whose node reservation holds the run's nodes (a sweep's, for its
    # trials); "": the run's own.
    ("node_reservation", str, dataclasses.field(default="")),
)
RunConfig = dataclasses.make_dataclass(
    "RunConfig", [*_RUN_FIELDS, *((p.name, p.type, dataclasses.field(default=p.default))
                                  for p in PARAMETERS)],
    bases=(_RunConfig,), frozen=True, kw_only=True,
    namespace={"__module__": __name__, "__doc__": _RunConfig.__doc__})


def resolve_path(path: str) -> Path:
    """User paths: `~` expanded, relative ones taken from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def run_output_dir(output_dir: str, run_name: str, target: str) -> str:
    """<output_dir>/<run name>: on this machine (local), or as the trainer's pod sees it."""
    if target == "local":
        return str(resolve_path(output_dir) / run_name)
    return f"{output_dir.rstrip('/')}/{run_name}"
