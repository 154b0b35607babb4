"""torchrun, recording each rank that dies without a record of its own.

`python -m trainer.launch <torchrun arguments>` runs torchrun (torch.distributed.run) as is.
When its workers fail, torchrun's elastic agent raises ChildFailedError with a failure per rank
(exit code, pid, error file, the moment it saw it). A rank that raised has recorded its error
itself (trainer/errors.py); one killed by a signal (SIGKILL from the kernel's OOM killer) or
that exited with a code could not: this writes its record (finetune_contract.errors.death_record)
into errors/rank_<N>.json under the run directory (FINETUNE_ERROR_DIR), so the first failure by
time is that rank, not the collective errors of the ranks that survived it.

A SIGTERM to this process is a notice (trainer/preemption.py): it marks it for its workers
before torchrun's agent passes the signal on (torchrun sends its workers SIGTERM for its own
restarts too, which are not notices). After a notice whose step the workers saved, it exits with
PREEMPTED_EXIT_CODE (138), whichever way torchrun ended (its agent stopped by the signal, or its
workers' exits): the code the job's restart policy retries without counting a failure. A notice
that came before the round's first step is recorded here first, in the trainer's output location
(a path or s3://; finetune_contract.run_history's start-up notices): rank 0, which writes the
history, had not begun the round and may be on another node. So is one its workers could not
take (still importing, or stopped after torchrun's shutdown timeout). A notice after every
worker of the node finished the training (each marks itself done) ends the node with exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune_contract.errors import ERROR_DIR_ENV, NODE_NAME_ENV, death_record, error_file
from finetune_contract.run_history import (
    PREEMPTED_EXIT_CODE,
    startup_notice,
    startup_notice_file,
)
from trainer.history import process_started
from trainer.preemption import (
    DONE_MARKER_ENV,
    NOTICE_MARKER_ENV,
    SAVED_MARKER_ENV,
    all_done,
    read_mark,
)
from trainer.storage import S3Prefix, is_s3

# The agent polls its workers this often (torchrun's --monitor-interval default, 0.1 s) and its
# failure times are whole seconds: a death is at most this long before the agent's time.
DETECTION_SLACK_S = 1.1


def record_deaths(run_dir: Path, failures: dict, node: str) -> list[int]:
    """A record for each failed rank that wrote none; the ranks recorded."""
    recorded = []
    for rank, failure in sorted(failures.items()):
        path = run_dir / error_file(rank)
        if path.exists() or failure.exitcode == 0:
            continue  # the rank recorded its own error
        record = death_record(rank, failure.exitcode, node, failure.timestamp - DETECTION_SLACK_S)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record) + "\n")
        recorded.append(rank)
    return recorded


def write_startup_notice(run_dir: str, mark: dict[str, Any], node: str) -> str:
    """This node's record of a notice that came before its round's first step (what its
    workers marked), written in the run directory (a path or an s3:// prefix); where."""
    record = startup_notice(node, mark.get("notice") or time.time(), mark.get("started"),
                            time.time())
    name, text = startup_notice_file(record), json.dumps(record) + "\n"
    if is_s3(run_dir):
        S3Prefix(run_dir).put_text(name, text)
        return f"{run_dir.rstrip('/')}/{name}"
    path = Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def trainer_output_dir(argv: list[str]) -> str | None:
    """The trainer's output location, as the trainer reads it from the arguments torchrun
    passes it (its config and overrides; on eks nothing else names it); else the run
    directory the environment names."""
    from torch.distributed.run import parse_args as torchrun_args

    from trainer.config import parse_args

    try:
        return parse_args(torchrun_args(argv).training_script_args).output_dir
    except (Exception, SystemExit):  # argparse exits on what it cannot parse
        return os.environ.get(ERROR_DIR_ENV)


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def record_startup_notice(argv: list[str], mark: dict[str, Any]) -> None:
    """The notice the workers marked as before their first step, recorded in the trainer's
    output location; one that cannot be recorded is told, and the exit stays a preemption's."""
    run_dir = trainer_output_dir(argv)
    try:
        if not run_dir:
            raise ValueError(f"neither the trainer's arguments nor {ERROR_DIR_ENV} name it")
        where = write_startup_notice(run_dir, mark, node_name())
        print(f"a notice came before the first step (nothing trained to save), recorded in "
              f"{where}: exit {PREEMPTED_EXIT_CODE} (retried as a preemption, not counted as a "
              "failure)", file=sys.stderr, flush=True)
    except Exception as exc:  # the exit code matters more
        print(f"a notice came before the first step; it could not be recorded in the run "
              f"directory {run_dir}: {exc!r}; exit {PREEMPTED_EXIT_CODE}", file=sys.stderr,
              flush=True)


def mark_notices(path: Path) -> None:
    """torchrun's agent raises on SIGTERM from the handler it installs when it starts its
    workers (torch.distributed.elastic.multiprocessing.api._terminate_process_handler, looked
    up when installed): that handler, wrapped, marks the notice first."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler

    def marked(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            path.touch()
        raise_signal(signum, frame)

    api._terminate_process_handler = marked


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    marker = Path(tempfile.gettempdir()) / f"finetune-preempted-{os.getpid()}"
    notice = Path(tempfile.gettempdir()) / f"finetune-notice-{os.getpid()}"
    done = Path(tempfile.gettempdir()) / f"finetune-done-{os.getpid()}"
    for path in (marker, notice, *done.parent.glob(done.name + ".*")):
        path.unlink(missing_ok=True)
    os.environ[SAVED_MARKER_ENV] = str(marker)  # the workers inherit them
    os.environ[NOTICE_MARKER_ENV] = str(notice)
    os.environ[DONE_MARKER_ENV] = str(done)
    mark_notices(notice)
    try:
        torchrun(argv)
    except (SignalException, ChildFailedError) as ended:
        noticed = notice.stat().st_mtime if notice.exists() else None
        notice.unlink(missing_ok=True)
        if isinstance(ended, SignalException) and all_done(done):
            # After the last step no step tells the ranks of a notice: the run asks before its
            # final eval and export (Trainer.finish); one later lets them finish, in torchrun's
            # shutdown timeout. Finished, the node is done: nothing to start again.
            print("a notice came after this node's workers finished the training: exit 0",
                  file=sys.stderr, flush=True)
            sys.exit(0)
        if marker.exists():
            mark = read_mark(marker)
            marker.unlink()
            if mark.get("step_saved", True):
                print(f"the workers saved their step after a notice: exit "
                      f"{PREEMPTED_EXIT_CODE} (retried without counting a failure)",
                      file=sys.stderr, flush=True)
            else:
                record_startup_notice(argv, mark)
            sys.exit(PREEMPTED_EXIT_CODE)
        if isinstance(ended, SignalException) and noticed is not None:
            # A notice the workers did not take: they were still importing (before theirs was
            # heard), in the rendezvous, or were stopped after torchrun's shutdown timeout
            # during the export. Nothing was saved for it; the run goes on from its checkpoint,
            # and the notice is recorded as one before a first step.
            # Its nodes' records are one notice when their starts came before it: this
            # launcher's start stands for its workers'.
            record_startup_notice(argv, {"step_saved": False, "notice": noticed,
                                         "started": process_started()})
            sys.exit(PREEMPTED_EXIT_CODE)
        if isinstance(ended, SignalException):
            raise
        failed = ended
        run_dir = os.environ.get(ERROR_DIR_ENV)
        if run_dir and not run_dir.startswith("s3://"):
            try:
                record_deaths(Path(run_dir), failed.failures, node_name())
            except OSError as exc:  # the failure itself matters more
                print(f"could not record the failed ranks in {run_dir}: {exc}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
