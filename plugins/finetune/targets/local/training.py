"""The local training's torchrun agents, one per node, as the train stage starts, follows and
restarts them.

Each agent runs in a session of its own with its output in logs/torchrun-node-<n>.log, so the
training outlives the task that started it (a lost Airflow worker) and a retry reattaches to it;
`state/train.json` records what was started and which try follows it. The agents' new lines are
copied into the task log and train.log once each, also across tries. A job that loses a node is
started again whole, as the training operator restarts a job's pods; an elastic one (min_nodes)
goes on with the nodes it has. A notice (SIGTERM to an agent) ends the round with every rank's
step saved, or at once before its first step (exit PREEMPTED_EXIT_CODE either way): it is
started again whole, up to max_preemptions times, without counting as a restart.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from finetune import REPO_ROOT
from finetune.config import RunConfig
from finetune.etcd import delete_rendezvous_keys
from finetune.report.run_files import load_history
from finetune.targets.local.machine import torchrun_env
from finetune.targets.local.processes import (
    is_alive,
    kill_process,
    start_time,
    stop_processes,
    trainer_processes,
)
from finetune.targets.local.state import read_state, write_state
from finetune_contract.errors import NODE_NAME_ENV
from finetune_contract.parallel_dims import is_elastic
from finetune_contract.run_history import PREEMPTED_EXIT_CODE, preemptions

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40


class Agent:
    """One node's torchrun agent: started by this task (proc) or by an earlier try (pid only)."""

    def __init__(self, node: int, proc: subprocess.Popen | None = None, pid: int = 0):
        self.node, self.proc, self.restarts = node, proc, 0
        self.pid = proc.pid if proc is not None else pid
        self.gone = False  # an elastic run's lost node: the training goes on without it

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else is_alive(self.pid)


def agent_log(cfg: RunConfig, node: int) -> Path:
    """Where node `node`'s torchrun agent writes its output (and its workers')."""
    path = Path(cfg.run_dir) / "logs" / f"torchrun-node-{node}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def start_agent(cfg: RunConfig, node: int, res: dict, rendezvous: dict,
                config_path: Path) -> subprocess.Popen:
    """Node `node`'s torchrun agent, running the trainer with `config_path`."""
    nnodes = f"{cfg.min_nodes}:{cfg.nodes}" if is_elastic(cfg) else str(cfg.nodes)
    cmd = [
        sys.executable, "-m", "trainer.launch",  # torchrun, recording ranks killed
        "--nnodes", nnodes, "--nproc-per-node", str(cfg.procs_per_node),
        "--rdzv-backend", rendezvous["backend"], "--rdzv-endpoint", rendezvous["endpoint"],
        "--rdzv-id", rendezvous["rdzv_id"], "--max-restarts", str(cfg.max_restarts),
        *(["--rdzv-conf", f"last_call_timeout={cfg.node_wait_s}"] if is_elastic(cfg) else []),
        "-m", "trainer.train", "--config", str(config_path),
    ]
    first = node * cfg.procs_per_node
    env = torchrun_env(cfg, res, range(first, first + cfg.procs_per_node))
    env[NODE_NAME_ENV] = f"{node} ({socket.gethostname()})"
    log.info("starting torchrun agent %d: %s", node, " ".join(cmd))
    # Output to a file and a session of its own: the training outlives this task's process
    # (a lost Airflow worker), and the retry reattaches to it.
    with agent_log(cfg, node).open("ab") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def write_train_state(cfg: RunConfig, agents: list[Agent], started: float,
                      config_path: Path) -> None:
    """What was started (the agents, when, with which config) and which try follows it."""
    write_state(cfg, "train", {"agents": [a.pid for a in agents], "started": started,
                               "config": str(config_path),
                               "task": {"pid": os.getpid(),
                                        "start_time": start_time(os.getpid())}})


def stop_earlier_try(state: dict) -> None:
    """An earlier try's task process that outlived its supervisor (Airflow stopped as a whole:
    the task runs in a process group of its own) would follow the training beside this try:
    Airflow runs one try at a time, so it is stopped."""
    task = state.get("task") or {}
    pid, started = task.get("pid"), task.get("start_time")
    if not pid or pid == os.getpid() or started is None or start_time(pid) != started:
        return
    log.warning("stopping the task process of an earlier try (pid %d) that outlived its "
                "supervisor", pid)
    # SIGKILL: a task process takes SIGTERM as on_kill, and lives on.
    kill_process(pid, started)


def clear_earlier_training(state: dict, rendezvous: dict) -> None:
    """Before starting again: what is left of the earlier training (processes the record
    missed) stopped, its closed rendezvous deleted (else RendezvousClosedError)."""
    stop_processes(trainer_processes(state["config"]))
    if rendezvous["backend"] == "etcd-v2":
        delete_rendezvous_keys(rendezvous["endpoint"], rendezvous["rdzv_id"])


def training_finished(run_dir: Path, started: float) -> bool:
    """The training started at `started` wrote its complete summary.json (rank 0 writes it
    last, before it exits; it is not written atomically, so it must parse)."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < started:
            return False
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and {"steps", "final_eval_loss"} <= summary.keys()


def follow_agents(cfg: RunConfig, agents: list[Agent], follower: LogFollower, res: dict,
                  rendezvous: dict, config_path: Path, started: float,
                  stop: Callable[[], object] | None = None) -> tuple[int, str] | None:
    """Follow the agents to the end: (node, reason) of a failure, or None.

    `stop` (a sweep trial's early-stopping rule, finetune.sweep.early_stop) is asked at each
    look; once it answers, every agent gets a notice (SIGTERM: each rank saves the step it is
    in and exits) and the training ends there: None, nothing started again.

    When a node's agent is killed (a lost node), the job is started again, up to
    max_restarts times, as the training operator restarts a job's pods: every agent
    stopped, the rendezvous cleared, all nodes started, the trainer resumes from the newest
    checkpoint. (A lone new agent does not get the survivors of a round that lost a node
    to rendezvous again.) An elastic run instead goes on with the nodes left, as long as
    there are min_nodes: their torchrun restarts its workers in a smaller world. When every
    agent has exited with PREEMPTED_EXIT_CODE (a notice, the step saved), all are started
    again, up to max_preemptions times in the run.
    """
    restarts, stopping = 0, False
    while True:
        follower.copy_new_lines()
        if stop is not None and not stopping and stop():
            stopping = True
            notify_agents(agents)
        if stopping:  # no restart, no failure: each rank saves its step and exits
            if any(a.alive() for a in agents if not a.gone):
                time.sleep(0.5)
                continue
            return None
        if cfg.active_deadline_s and time.time() - started > cfg.active_deadline_s:
            # The cost guard the eks job's activeDeadlineSeconds is; the caller stops all.
            return 0, (f"was stopped: the training ran past active_deadline_s "
                       f"({cfg.active_deadline_s} s)")
        lost = [a for a in agents if not a.gone and (a.exit_code() or 0) < 0]
        left = sum(not a.gone for a in agents) - len(lost)
        if lost and is_elastic(cfg) and left >= cfg.min_nodes:
            for agent in lost:
                agent.gone = True
            log.warning("torchrun agent of node %s was killed: the training goes on with %d "
                        "of %d nodes (min_nodes %d) once node_wait_s (%d s) has passed without "
                        "it", ", ".join(str(a.node) for a in lost), left, cfg.nodes,
                        cfg.min_nodes, cfg.node_wait_s)
        elif lost and restarts < cfg.max_restarts:
            restarts += 1
            log.warning("torchrun agent of node %d was killed (signal %d): restarting all "
                        "%d node(s) (restart %d of %d)", lost[0].node, -lost[0].exit_code(),
                        len(agents), restarts, cfg.max_restarts)
            start_again(cfg, agents, follower, res, rendezvous, config_path, started)
        codes = [a.exit_code() for a in agents if not a.gone]
        if codes and all(code == PREEMPTED_EXIT_CODE for code in codes):
            noticed = len(preemptions(read_history(cfg)))
            if noticed > cfg.max_preemptions:
                return 0, (f"was preempted {noticed} times, more than max_preemptions "
                           f"({cfg.max_preemptions}): each notice's step was saved; the run "
                           "stops here")
            log.warning("every node's training saved its step after a notice (preemption %d "
                        "of at most %d): starting all %d node(s) again from it", noticed,
                        cfg.max_preemptions, len(agents))
            start_again(cfg, agents, follower, res, rendezvous, config_path, started)
        agents_left = [a for a in agents if not a.gone]
        if any(a.proc is None for a in agents):  # reattached: no exit codes to read
            if any(a.alive() for a in agents):
                time.sleep(0.5)
                continue
            if training_finished(Path(cfg.run_dir), started):
                return None
            return 0, "ended without writing summary.json (its exit code is unknown)"
        codes = [a.exit_code() for a in agents_left]
        if all(c == 0 for c in codes):
            return None
        for agent, code in zip(agents_left, codes, strict=True):
            if code == PREEMPTED_EXIT_CODE:
                continue  # the others are still saving the same step
            if code not in (None, 0) and not (code < 0 and restarts < cfg.max_restarts):
                return agent.node, f"exited with code {code}"
        time.sleep(0.5)


def notify_agents(agents: list[Agent]) -> None:
    """A notice to every node's agent (SIGTERM, as Kubernetes sends one): trainer.launch marks
    it for its workers, which save the step they are in and exit PREEMPTED_EXIT_CODE."""
    for agent in agents:
        if agent.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGTERM)


def start_again(cfg: RunConfig, agents: list[Agent], follower: LogFollower, res: dict,
                rendezvous: dict, config_path: Path, started: float) -> None:
    """Every node's agent stopped and started again on a cleared rendezvous: the trainer
    resumes from the newest checkpoint."""
    stop_processes([a.pid for a in agents if a.alive()])
    stop_processes(trainer_processes(str(config_path)))
    follower.copy_new_lines()
    if rendezvous["backend"] == "etcd-v2":
        delete_rendezvous_keys(rendezvous["endpoint"], rendezvous["rdzv_id"])
    for agent in agents:
        agent.proc = start_agent(cfg, agent.node, res, rendezvous, config_path)
        agent.pid, agent.restarts, agent.gone = agent.proc.pid, agent.restarts + 1, False
    write_train_state(cfg, agents, started, config_path)


def read_history(cfg: RunConfig) -> list[dict]:
    """The trainer's history of the run (finetune_contract.run_history), as far as written: its
    notices before a round's first step included, which every node records itself."""
    return load_history(Path(cfg.run_dir))


class LogFollower:
    """Copies the agents' new output lines into the task log and train.log, once each.

    How far each node's log was copied is kept in the run's state, so a retry that reattaches
    continues where the lost try stopped.
    """

    def __init__(self, cfg: RunConfig, agents: list[Agent]):
        self.cfg, self.agents = cfg, agents
        self.log_path = Path(cfg.run_dir) / "train.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.offsets = {int(k): v for k, v in
                        (read_state(cfg, "train_log") or {}).get("offsets", {}).items()}

    def copy_new_lines(self) -> None:
        copied = False
        with self.log_path.open("a") as train_log:
            for agent in self.agents:
                path = agent_log(self.cfg, agent.node)
                with path.open("rb") as f:
                    f.seek(self.offsets.get(agent.node, 0))
                    data = f.read()
                end = data.rfind(b"\n") + 1  # whole lines only; the rest comes next time
                if not end:
                    continue
                self.offsets[agent.node] = self.offsets.get(agent.node, 0) + end
                prefix = f"[node {agent.node}] " if len(self.agents) > 1 else ""
                for raw in data[:end].decode("utf-8", errors="replace").splitlines():
                    line = prefix + raw
                    log.info("%s", line)
                    train_log.write(line + "\n")
                    self.tail.append(line)
                copied = True
        if copied:
            write_state(self.cfg, "train_log", {"offsets": self.offsets})
