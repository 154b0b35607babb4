"""Sharded checkpoints with torch.distributed.checkpoint: atomic, pruned, resumed automatically.

Layout: `{output_dir}/checkpoints/step_{N:08d}/` holds the DCP shards of model and optimizer and
`trainer_state.json` (step, sampler position, lr scheduler, ...). A save goes into `... .tmp`
first and is renamed by rank 0 once every rank has finished, so a directory without the suffix
is always complete. Every rank must see the same directory (one host, or a shared file system).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAINER_STATE_FILE = "trainer_state.json"
_PREFIX, _TMP_SUFFIX = "step_", ".tmp"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


class Checkpointer:
    def __init__(self, output_dir: str, keep: int, rank: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep, self.rank = keep, rank

    def complete(self) -> list[Path]:
        """Finished checkpoints, oldest first; interrupted saves (`.tmp`) are not among them."""
        if not self.root.is_dir():
            return []
        found = [
            path
            for path in self.root.iterdir()
            if path.is_dir()
            and path.name.startswith(_PREFIX)
            and path.name[len(_PREFIX) :].isdigit()
            and (path / TRAINER_STATE_FILE).is_file()
        ]
        return sorted(found, key=lambda path: int(path.name[len(_PREFIX) :]))

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path:
        final = self.root / checkpoint_name(step)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-save
            tmp.mkdir(parents=True)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        if self.rank == 0:
            (tmp / TRAINER_STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old)
        dist.barrier()
        return final

    def load(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load model and optimizer shards in place; return the trainer state saved with them."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        return json.loads((path / TRAINER_STATE_FILE).read_text())
