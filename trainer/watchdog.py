"""Hang detection: a watchdog thread per rank ends a rank that made no progress (a step, an
eval, a checkpoint) for hang_timeout_s, after writing down why, so that torchrun restarts the
workers from the newest checkpoint (its max_restarts) instead of the job idling until its
deadline.

Every rank keeps `heartbeats/rank_<N>.json` in the run's local output dir (the staging dir of an
s3:// output, so ranks see the peers of their node; all of them on a shared file system): its
last progress (step, time) and a beat its watchdog thread writes every few seconds. A rank
blocked in a collective still beats (collectives release the GIL); a stopped or frozen process
does not. When a rank's own progress is older than hang_timeout_s, its watchdog
- appends to `hangs/rank_<N>.txt` what it saw: the heartbeats of the ranks it can see and every
  thread's Python stack (faulthandler), and writes `hangs/rank_<N>.fr.json`: torch's flight
  recorder of this rank's recent collectives (gloo on CPU, NCCL on GPUs; sized by
  TORCH_FR_BUFFER_SIZE, default 2000 entries), where this torch has it;
- records the root cause (`errors/rank_<N>.json`, type TrainingHang) naming the rank that
  stopped beating or fell behind, when the heartbeats tell;
- ends the process (os._exit: its main thread is stuck) with HANG_EXIT_CODE.
A rank that is stopped cannot run its own watchdog: its peers, waiting for it in a collective,
are the ones that fire, and name it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import write_root_cause
from trainer.storage import S3Prefix, is_s3

HEARTBEATS_DIR = "heartbeats"
HANGS_DIR = "hangs"
HANG_EXIT_CODE = 75
# A hung rank that cannot even write its record is ended this long after its watchdog fired.
FIRE_DEADLINE_S = 120


class TrainingHang(RuntimeError):
    """No progress for hang_timeout_s: the type of the error record a hang leaves."""


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    pid: int
    host: str
    restart: int  # torchrun's TORCHELASTIC_RESTART_COUNT: beats of an earlier round are old
    step: int
    progress_time: float
    beat_time: float

    @classmethod
    def read(cls, path: Path) -> Heartbeat | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # not written yet, or a peer of another torch version


def hang_message(
    rank: int, idle_s: float, step: int, beats: list[Heartbeat], now: float, stale_after_s: float
) -> str:
    """The TrainingHang message: this rank's wait, and the rank it waits for when the peers'
    heartbeats tell (one that stopped beating, else one behind this rank's step)."""
    peers = [b for b in beats if b.rank != rank]
    frozen = [b for b in peers if now - b.beat_time > stale_after_s]
    behind = [b for b in peers if b not in frozen and b.step < step]
    if frozen:
        cause = "; ".join(
            f"rank {b.rank} (pid {b.pid} on {b.host}) stopped responding: no heartbeat for "
            f"{now - b.beat_time:.0f} s, last progress at step {b.step}"
            for b in frozen
        )
    elif behind:
        cause = "; ".join(
            f"rank {b.rank} (pid {b.pid} on {b.host}) is behind, at step {b.step}" for b in behind
        )
    else:
        seen = ", ".join(str(b.rank) for b in sorted(beats, key=lambda b: b.rank)) or "none"
        cause = (
            f"no rank it can see (ranks {seen}) stopped or fell behind: a collective that "
            f"never completes, or a rank on another node; see {HANGS_DIR}/"
        )
    return (
        f"training hang: rank {rank} made no progress for {idle_s:.0f} s after step {step} "
        f"(hang_timeout_s); {cause}"
    )


class HangWatchdog:
    """This rank's heartbeat and watchdog thread; `progress(step)` is what resets it."""

    def __init__(self, output_dir: str, local_dir: Path, rank: int, timeout_s: float):
        self.output_dir, self.local_dir = output_dir, Path(local_dir)
        self.rank, self.timeout_s = rank, timeout_s
        self.beat_interval_s = min(10.0, max(0.5, timeout_s / 10))
        self.stale_after_s = 3 * self.beat_interval_s
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.step, self.progress_time = 0, time.time()
        self.heartbeat = self.local_dir / HEARTBEATS_DIR / f"rank_{rank}.json"
        self._stop = threading.Event()
        self._writing = threading.Lock()  # the main thread and the watchdog both beat
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
        self._beat()
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """The training moved on (a step, an eval, a save); called from the main thread."""
        self.step, self.progress_time = step, time.time()
        self._beat()  # peers see the step a rank stopped at, not the one of its last beat

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_interval_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_interval_s):
            self._beat()
            idle = time.time() - self.progress_time
            if idle > self.timeout_s:
                self._fire(idle)

    def _beat(self) -> None:
        beat = Heartbeat(
            rank=self.rank,
            pid=os.getpid(),
            host=socket.gethostname(),
            restart=self.restart,
            step=self.step,
            progress_time=self.progress_time,
            beat_time=time.time(),
        )
        tmp = self.heartbeat.with_suffix(".tmp")
        try:
            with self._writing:
                tmp.write_text(json.dumps(beat.__dict__) + "\n")
                tmp.replace(self.heartbeat)  # peers never read a torn beat
        except OSError as exc:  # a full disk must not end the training; the watchdog goes on
            print(f"rank {self.rank}: heartbeat not written: {exc}", file=sys.stderr, flush=True)

    def peers(self) -> list[Heartbeat]:
        """The heartbeats of this torchrun round that this rank can see, its own included."""
        beats = [Heartbeat.read(p) for p in sorted(self.heartbeat.parent.glob("rank_*.json"))]
        return [b for b in beats if b is not None and b.restart == self.restart]

    def _fire(self, idle_s: float) -> None:
        # Whatever blocks below (a hung upload), the rank still ends.
        deadline = threading.Timer(FIRE_DEADLINE_S, os._exit, (HANG_EXIT_CODE,))
        deadline.daemon = True
        deadline.start()
        now, beats = time.time(), self.peers()
        message = hang_message(self.rank, idle_s, self.step, beats, now, self.stale_after_s)
        print(message, file=sys.stderr, flush=True)
        try:
            for name in self.write_dump(message, beats):
                self._upload(name)
        except Exception as exc:  # the record and the exit matter more than the dump
            print(f"rank {self.rank}: hang dump failed: {exc!r}", file=sys.stderr, flush=True)
        try:
            write_root_cause(self.output_dir, TrainingHang(message), self.rank)
        except Exception as exc:
            print(f"rank {self.rank}: hang not recorded: {exc!r}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def write_dump(self, message: str, beats: list[Heartbeat]) -> list[str]:
        """hangs/rank_<N>.txt (appended: the heartbeats, every thread's stack) and, where torch
        has a flight recorder, hangs/rank_<N>.fr.json; their names relative to the output."""
        hangs = self.local_dir / HANGS_DIR
        hangs.mkdir(parents=True, exist_ok=True)
        stacks = f"{HANGS_DIR}/rank_{self.rank}.txt"
        with open(self.local_dir / stacks, "a") as f:
            f.write(
                f"=== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
                f"restart {self.restart}, pid {os.getpid()}\n{message}\n\nheartbeats:\n"
            )
            for beat in beats:
                f.write(json.dumps(beat.__dict__) + "\n")
            f.write("\nPython stacks of every thread (the main thread's shows where it waits):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n")
        names = [stacks]
        trace = flight_recorder_trace()
        if trace is not None:
            names.append(f"{HANGS_DIR}/rank_{self.rank}.fr.json")
            (self.local_dir / names[-1]).write_bytes(trace)
        return names

    def _upload(self, name: str) -> None:
        if is_s3(self.output_dir):
            S3Prefix(self.output_dir).upload_file(self.local_dir / name, name)


def flight_recorder_trace() -> bytes | None:
    """torch's flight recorder of this process's collectives as JSON (NCCL's where this build
    has NCCL, else the generic one gloo records to); None where this torch has neither."""
    from torch._C import _distributed_c10d as c10d

    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is not None:
            try:
                return dump(True, False)  # every collective recorded, not only the active ones
            except Exception as exc:  # e.g. NCCL's recorder with no NCCL group: try the next
                print(f"{name}: {exc!r}", file=sys.stderr, flush=True)
    return None


def watchdog_env_defaults(output_dir: str, cuda: bool) -> dict[str, str]:
    """Environment for NCCL's own watchdog (set before the process group starts): keep a flight
    recorder and dump it into hangs/ when a collective times out. Values already set are kept."""
    defaults = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if cuda and not is_s3(output_dir):  # NCCL writes a local file; an s3:// output's stay ours
        hangs = Path(output_dir) / HANGS_DIR
        hangs.mkdir(parents=True, exist_ok=True)
        defaults["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(hangs / "nccl_trace_rank_")
    return {key: value for key, value in defaults.items() if key not in os.environ}
