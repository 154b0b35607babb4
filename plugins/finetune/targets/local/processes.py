"""The local training's processes, through psutil: finding the torchrun agents and workers by
the run's trainer config on their command lines, telling one process from a later one that
reuses its pid (its start time), whether one still runs (a zombie does not), and stopping them.

The training runs in sessions of its own so that it outlives the task that started it (a lost
Airflow worker); a later try, or teardown, finds its processes again here.
"""

from __future__ import annotations

import contextlib
import os

import psutil

from finetune.polling import until_true


def trainer_processes(config_path: str) -> list[int]:
    """Pids of processes (agents and workers) running with this run's trainer config."""
    own = os.getpid()
    # process_iter skips processes that end meanwhile; a zombie's or an unreadable command
    # line is None
    return [proc.pid for proc in psutil.process_iter(["cmdline"])
            if proc.pid != own and config_path in " ".join(proc.info["cmdline"] or ())]


def start_time(pid: int) -> float | None:
    """When the process started (seconds since the epoch): with the pid, it names one process
    even after the pid is reused; None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None


def is_alive(pid: int) -> bool:
    """`pid` runs and is not a zombie (a child of this process that ended is reaped)."""
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def command_line(pid: int) -> str | None:
    """The process's arguments joined by spaces ("" while it execs); None when it has ended or
    is not ours to read."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # gone, a zombie, or not ours to read
        return None


def is_agent(pid: int, config_path: str) -> bool:
    """`pid` runs (not a zombie) with this run's trainer config: an agent it started (a pid
    reused by another program has another command line; one read while it execs is empty)."""
    cmdline = command_line(pid)
    return cmdline is not None and (not cmdline or config_path in cmdline) and is_alive(pid)


def stop_processes(pids: list[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM, wait, then SIGKILL what is left; returns the pids that were running."""
    stopping = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.terminate()
        except psutil.NoSuchProcess:
            continue
        stopping.append(proc)
    until_true(timeout, 0.2)(lambda: not any(_running(p) for p in stopping))
    for proc in stopping:
        if _running(proc):
            with contextlib.suppress(psutil.NoSuchProcess):  # psutil: never a reused pid
                proc.kill()
    return [proc.pid for proc in stopping]


def kill_process(pid: int, started: float) -> None:
    """SIGKILL the process `pid` that started at `started` (start_time's), unless it has ended
    or the pid is another process's now."""
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        if proc.create_time() == started:
            proc.kill()


def _running(proc: psutil.Process) -> bool:
    """Not ended: a zombie has (and one that is a child of this process is reaped)."""
    # A zombie that is not this process's child is not waited for: its parent reaps it.
    with contextlib.suppress(psutil.TimeoutExpired):
        proc.wait(timeout=0)
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
