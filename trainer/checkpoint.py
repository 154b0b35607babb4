"""Sharded checkpoints with torch.distributed.checkpoint: atomic, pruned, resumed automatically.

Layout: `{output_dir}/checkpoints/step_{N:08d}/` holds the DCP shards of model and optimizer and
`trainer_state.json` (step, sampler position, lr scheduler, ...), written last: a checkpoint
without it is incomplete and never resumed from.

- A local or shared file system output: a save goes into `... .tmp` first and is renamed by
  rank 0 once every rank has finished, so a directory without the suffix is always complete.
  Every rank must see the same directory (one host, or a shared file system).
- An s3:// output: each rank writes its shards to its own staging directory and uploads them to
  `checkpoints/step_N/`; rank 0 uploads trainer_state.json once every rank's upload is done.
  Resuming downloads the newest complete checkpoint (once per node) and loads it from there.

With `async_save`, a save copies the state to CPU memory and returns; DCP writes (and the ranks
upload) in the background, and the save is made complete (rename or trainer_state.json) and old
checkpoints are pruned when it has finished: before the next save starts, or at `wait()`.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from trainer.storage import RunOutput

TRAINER_STATE_FILE = "trainer_state.json"
CHECKPOINTS_DIR = "checkpoints"
_PREFIX, _TMP_SUFFIX = "step_", ".tmp"


def _options(model: torch.nn.Module) -> StateDictOptions | None:
    """LoRA's and QLoRA's checkpoints leave out the frozen base: it is made again from the
    model's source at start, the same numbers (the 4-bit base too, trainer/qlora.py), so a save
    writes the adapters and their optimizer state alone (an 8B base's 16 to 32 GB less to write
    within a notice). A full fine-tune keeps everything."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _step_of(name: str) -> int | None:
    digits = name[len(_PREFIX) :]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


@dataclass
class _PendingSave:
    """A save whose shards are still being written (and uploaded) in the background."""

    step: int
    trainer_state: str  # JSON, taken when the save started
    writes: Future  # this rank's DCP write (and upload) is done


class Checkpointer:
    def __init__(
        self,
        output: str | RunOutput,
        keep: int,
        rank: int,
        *,
        local_rank: int = 0,
        async_save: bool = False,
    ):
        self.output = output if isinstance(output, RunOutput) else RunOutput(output, rank)
        self.remote = self.output.remote
        self.root = self.output.dir / CHECKPOINTS_DIR
        self.keep, self.rank, self.local_rank = keep, rank, local_rank
        self.async_save = async_save
        self._pending: _PendingSave | None = None
        self._background: ThreadPoolExecutor | None = None
        self._group: Any = None
        if async_save:
            # DCP's collectives run in a background thread: on a group of their own, so they
            # never interleave with the training's collectives on the default group.
            self._group = dist.new_group(backend="gloo")
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

    # -- finding checkpoints ---------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Finished local checkpoints, oldest first; interrupted saves are not among them."""
        if not self.root.is_dir():
            return []
        found = [
            path
            for path in self.root.iterdir()
            if path.is_dir()
            and _step_of(path.name) is not None
            and (path / TRAINER_STATE_FILE).is_file()
        ]
        return sorted(found, key=lambda path: _step_of(path.name))

    def complete_names(self) -> list[str]:
        """Names of the finished checkpoints at the output location, oldest first."""
        if self.remote is None:
            return [path.name for path in self.complete()]
        names = [n for n in self.remote.list_dirs(CHECKPOINTS_DIR) if _step_of(n) is not None]
        done = [
            n for n in names if self.remote.exists(f"{CHECKPOINTS_DIR}/{n}/{TRAINER_STATE_FILE}")
        ]
        return sorted(done, key=_step_of)

    def latest(self) -> Path | None:
        """The newest complete checkpoint as a local directory (downloaded from S3 first).

        A collective for an S3 output: rank 0 picks the checkpoint, every node downloads it.
        """
        if self.remote is None:
            found = self.complete()
            return found[-1] if found else None
        choice = [None]
        if self.rank == 0:
            names = self.complete_names()
            choice = [names[-1] if names else None]
        dist.broadcast_object_list(choice, src=0)
        name = choice[0]
        if name is None:
            return None
        local = self.root / name
        if self.local_rank == 0:  # the staging directory is shared by a node's ranks
            self.remote.download_tree(f"{CHECKPOINTS_DIR}/{name}", local)
        dist.barrier()
        return local

    # -- saving ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path | str:
        """Save (or, async, start saving) step's checkpoint; returns where it goes: the local
        directory, or the s3:// URI. Every rank must call it; an earlier async save is finished
        first."""
        self.wait()
        name = checkpoint_name(step)
        state_json = json.dumps({"step": step, **trainer_state})
        write_dir = self._prepare(name)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
        state = {"model": model_state, "optimizer": optimizer_state}
        if self.async_save:
            assert self._background is not None
            # Returns once the state is copied to CPU memory: training may change it again.
            written = dcp.async_save(state, checkpoint_id=write_dir, process_group=self._group)
            writes = self._background.submit(self._after_write, written, write_dir, name)
            self._pending = _PendingSave(step, state_json, writes)
        else:
            dcp.save(state, checkpoint_id=write_dir)
            self._after_write(None, write_dir, name)
            self._finish(step, state_json)
        return self.root / name if self.remote is None else self.location(step)

    def location(self, step: int) -> str:
        return f"{self.output.location.rstrip('/')}/{CHECKPOINTS_DIR}/{checkpoint_name(step)}"

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank must call it; before exit too)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.writes.result()  # re-raises a failed write or upload on this rank
            self._finish(pending.step, pending.trainer_state)

    def restate(self, step: int, trainer_state: dict[str, Any]) -> None:
        """Rewrite the trainer state of step's checkpoint, complete (after wait()), in place: its
        shards stay, so a complete checkpoint is never taken away to save the same step again
        (on S3 a save first deletes what is there). Every rank must call it."""
        self.wait()
        name = checkpoint_name(step)
        state_json = json.dumps({"step": step, **trainer_state})
        if self.rank == 0:
            if self.remote is None:
                path = self.root / name / TRAINER_STATE_FILE
                partial = path.with_name(TRAINER_STATE_FILE + _TMP_SUFFIX)
                partial.write_text(state_json)
                os.replace(partial, path)
            else:
                self.remote.put_text(f"{CHECKPOINTS_DIR}/{name}/{TRAINER_STATE_FILE}", state_json)
        dist.barrier()

    def close(self) -> None:
        self.wait()
        if self._background is not None:
            self._background.shutdown()
            self._background = None

    def _tmp_dir(self, name: str) -> Path:
        return self.root / (name + _TMP_SUFFIX)

    def _prepare(self, name: str) -> Path:
        """The empty directory this rank's shards are written to."""
        tmp = self._tmp_dir(name)
        if self.remote is None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-save
                tmp.mkdir(parents=True)
            dist.barrier()
            return tmp
        # S3: the ranks of a node share the staging dir, so each writes to a directory of its own.
        write_dir = tmp / f"rank_{self.rank}"
        shutil.rmtree(write_dir, ignore_errors=True)
        write_dir.mkdir(parents=True)
        if self.rank == 0:  # objects of an interrupted save of the same step
            self.remote.delete_tree(f"{CHECKPOINTS_DIR}/{name}")
        dist.barrier()
        return write_dir

    def _after_write(self, written: Future | None, write_dir: Path, name: str) -> None:
        """Once this rank's shards are written: upload them (S3). Runs in the background when
        the save is async."""
        if written is not None:
            written.result()
        if self.remote is not None:
            self.remote.upload_tree(write_dir, f"{CHECKPOINTS_DIR}/{name}")
            shutil.rmtree(write_dir, ignore_errors=True)

    def _finish(self, step: int, state_json: str) -> None:
        """Every rank has written its shards: make the checkpoint complete, prune old ones."""
        name = checkpoint_name(step)
        dist.barrier()
        if self.rank == 0:
            if self.remote is None:
                tmp, final = self._tmp_dir(name), self.root / name
                (tmp / TRAINER_STATE_FILE).write_text(state_json)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
                for old in self.complete()[: -self.keep]:
                    shutil.rmtree(old)
            else:
                self.remote.put_text(f"{CHECKPOINTS_DIR}/{name}/{TRAINER_STATE_FILE}", state_json)
                self._prune_remote()
        if self.remote is not None and self.local_rank == 0:
            shutil.rmtree(self._tmp_dir(name), ignore_errors=True)
        dist.barrier()

    def _prune_remote(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop the rest and interrupted saves
        (none is in flight now)."""
        assert self.remote is not None
        kept = set(self.complete_names()[-self.keep :])
        for name in self.remote.list_dirs(CHECKPOINTS_DIR):
            if _step_of(name) is not None and name not in kept:
                self.remote.delete_tree(f"{CHECKPOINTS_DIR}/{name}")

    # -- loading ---------------------------------------------------------------------------------

    def load(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load model and optimizer shards in place; return the trainer state saved with them."""
        options = _options(model)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
        trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
        if self.remote is not None:  # the download from S3 is not needed any more
            dist.barrier()
            if self.local_rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        return trainer_state
