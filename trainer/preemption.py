"""A notice to stop (SIGTERM: Kubernetes evicting the pod, a spot reclaim's two minutes, a node
drained, torchrun passing its own on): nothing is lost but the step in progress.

A notice reaches a node's torchrun agent (trainer.launch), which marks it in a file its workers
know (NOTICE_MARKER_ENV) before passing the signal on; a SIGTERM without that mark is torchrun
stopping its workers for a restart of its own (a peer failed, a node joined), which ends the
worker at once, as before. The rank that gets a notice only notes when. Every step ends with an
all-gather the ranks make anyway (their step times): the notes travel with it, so every rank
learns of a notice at the end of the same step. Then every rank saves that step (the checkpoint
it would have written at its interval), rank 0 records the preemption in the run's history, and
each rank tells its torchrun agent to stop as for a signal (the agent restarts no worker, counts
no failure and leaves the rendezvous open for the next round) and exits with
PREEMPTED_EXIT_CODE, which the job's restart policy (or the local target) retries without
spending max_restarts.

A notice before the round's first step (while the model loads) ends the process at once:
nothing was trained to save, and the round's history has no start to add it to. The marker says
so, and trainer.launch, once its workers have exited, records the notice for the run's history
itself (finetune_contract.run_history: the nodes' start-up notices), so that it counts as a
preemption, not as a restart without one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any

from finetune_contract.run_history import PREEMPTED_EXIT_CODE
from trainer.history import process_started

# Files trainer.launch names for its workers: the agent writes the first when a notice reaches it,
# one of them the second once the notice's step is saved.
NOTICE_MARKER_ENV = "FINETUNE_NOTICE_MARKER"
SAVED_MARKER_ENV = "FINETUNE_PREEMPTED_MARKER"
# Where each worker of the node marks (by its local rank) that it finished the training, the
# export included: a notice after that ends the node as done (trainer.launch).
DONE_MARKER_ENV = "FINETUNE_DONE_MARKER"


class Preempted(SystemExit):
    """The run saved the step a notice interrupted and exits for it to be started again."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


class Notice:
    """SIGTERM, noted: `at` is when it came (0.0: none yet)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.training = False  # set once the first step starts: until then a notice ends at once

    def install(self) -> Notice:
        signal.signal(signal.SIGTERM, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.at:
            return  # the agent passing the signal on, or a second notice: noted already
        if not is_a_notice():  # torchrun stopping its workers for a restart: go now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.at = time.time()
        if not self.training:
            mark_saved(before_first_step=self.at)  # nothing trained yet: nothing to save
            stop_agent()
            raise Preempted(0)


def is_a_notice() -> bool:
    """Whether a SIGTERM here is a notice: this process's agent marked one, or there is no
    agent to tell (the trainer run alone, or by a launcher that marks nothing)."""
    marker = os.environ.get(NOTICE_MARKER_ENV)
    return marker is None or os.path.exists(marker)


def mark_saved(before_first_step: float | None = None) -> None:
    """Tell this node's launcher (trainer.launch) that its workers are done with a notice: the
    step was saved, or (`before_first_step`: when the notice came) there was none to save. It
    exits with PREEMPTED_EXIT_CODE, not as a failure, and records a notice before the first
    step in the run directory."""
    marker = os.environ.get(SAVED_MARKER_ENV)
    if not marker:
        return
    mark = {"step_saved": before_first_step is None, "notice": before_first_step,
            "started": process_started()}
    partial = f"{marker}.{os.getpid()}"  # the node's other workers write the same marker
    with open(partial, "w") as f:
        json.dump(mark, f)
    os.replace(partial, marker)


def mark_done() -> None:
    """Tell this node's launcher that this worker finished the training (its part of the final
    eval and the export): a notice that comes after is no reason to start it again."""
    marker = os.environ.get(DONE_MARKER_ENV)
    if marker:
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
        Path(f"{marker}.{os.environ.get('LOCAL_RANK', '0')}").write_text(local_world)


def all_done(marker: Path) -> bool:
    """Whether every worker of the node marked itself done (mark_done)."""
    marks = list(marker.parent.glob(marker.name + ".*"))
    try:
        return bool(marks) and len(marks) >= int(marks[0].read_text())
    except (OSError, ValueError):
        return False


def read_mark(marker: Path) -> dict[str, Any]:
    """What mark_saved wrote: `step_saved`, and for a notice before the first step when it came
    (`notice`) and when the worker started (`started`); one unreadable is a step saved."""
    try:
        mark = json.loads(marker.read_text())
    except (OSError, ValueError):
        mark = None
    return mark if isinstance(mark, dict) else {"step_saved": True}


def stop_agent() -> None:
    """Under torchrun, SIGTERM to this worker's agent (its parent): it stops its workers as for
    a signal instead of restarting them as after a failure."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.getppid() > 1:
        try:
            os.kill(os.getppid(), signal.SIGTERM)
        except ProcessLookupError:
            pass
