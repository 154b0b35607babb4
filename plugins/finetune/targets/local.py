"""The `local` target: this machine is the cluster.

Nodes are torchrun agents on this machine, the rendezvous is a local etcd (or torch's c10d store
when etcd is not installed), the image is this checkout's trainer/ in this Python environment.
State that later tasks need (etcd's pid, the trainer processes) is kept in <run_dir>/state/.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.config import RunConfig, resolve_path
from finetune.etcd import LocalEtcd, delete_rendezvous_keys, etcd_binary, free_port
from finetune.gpu_metrics import (
    HOST_SAMPLES_FILE,
    ResourceSampler,
    host_section,
    load_samples,
    sampled_gpu_metrics,
)
from finetune.image import IMAGE_CONTEXT, image_tag, local_environment
from finetune.outputs import (
    evaluation_result,
    summary,
    trainer_failures,
    trainer_root_cause,
    write_run_file,
)
from finetune.preflight_verdict import (
    PREFLIGHT_FILE,
    PreflightFailed,
    failure_message,
    judge,
    result_line,
    summary_line,
)
from finetune.report import write_report
from finetune.run_plan import plan_run
from finetune.s3_dataset import check_s3_dataset
from finetune.targets.base import TORCHRUN_ENV, Target, TrainingFailed
from finetune.trainer_config import trainer_config
from finetune_contract.errors import ERROR_DIR_ENV, NODE_NAME_ENV, failure_summary
from finetune_contract.fields import EVALUATION_FILE, quoted
from finetune_contract.rules import device_problems

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
PREFLIGHT_TIMEOUT_S = 300


def local_cpu_count() -> int:
    """The CPUs this process may run on (its affinity), which is what torchrun's workers get."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """GPUs on this machine, from nvidia-smi (no CUDA initialisation in the Airflow process)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        visible = os.environ["CUDA_VISIBLE_DEVICES"].strip()
        if not visible or visible == "-1":
            return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.SubprocessError, OSError):
        return 0
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        count = min(count, len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
    return count


# File systems no run directory can be made in (the kernel's views, not storage).
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs",
    "tracefs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "autofs",
    "efivarfs", "binfmt_misc", "nsfs", "rpc_pipefs"})


def _mount_types(mounts: Path = Path("/proc/self/mounts")) -> dict[Path, str]:
    """Mount point -> file system type, from the kernel's table (empty where there is none)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return {}
    table = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:  # spaces in a mount point are written \040
            table[Path(fields[1].replace("\\040", " "))] = fields[2]
    return table


def output_dir_problems(output_dir: str) -> list[tuple[str, str]]:
    """Why the run directory `<output_dir>/<run>` could not be made here, before any stage
    tries: a file on the way, a pseudo-file system, no write permission, a relative path that
    leaves the repository, or a place inside the trainer image's build context (every run's
    outputs would change its content hash and be packed into the next build)."""
    given = quoted(output_dir)
    path = Path(os.path.abspath(resolve_path(output_dir)))  # '..' folded, links kept
    if not Path(output_dir).expanduser().is_absolute() and not path.is_relative_to(REPO_ROOT):
        return [("output_dir", f"{given} leaves the repository (relative paths are from "
                 f"{REPO_ROOT}); give an absolute path to write elsewhere")]
    real = path.resolve()
    for part in IMAGE_CONTEXT:
        if real.is_relative_to((REPO_ROOT / part).resolve()):
            return [("output_dir", f"{given} lies in {part}/, part of the trainer image's build "
                     "context (finetune.image.IMAGE_CONTEXT): every run would change the image's "
                     "content hash and its outputs be packed into the next build; use runs or "
                     "a path outside " + ", ".join(IMAGE_CONTEXT))]
    existing = path
    try:
        while not existing.exists() and not existing.is_symlink():
            existing = existing.parent
    except OSError:  # a name too long to look up: the contract's location rule names it
        return []
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {quoted(str(existing))}"
        return [("output_dir", f"{given} {where}: the run directory cannot be made there")]
    mounts = _mount_types()
    mount = max((point for point in mounts if existing.resolve().is_relative_to(point)),
                key=lambda point: len(point.parts), default=None)
    if mount is not None and mounts[mount] in PSEUDO_FILESYSTEMS:
        return [("output_dir", f"{given} is on {mount}, a {mounts[mount]} pseudo-file system: "
                 "no directory can be made there")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [("output_dir", f"{given}: {quoted(str(existing))} is not writable by this "
                 "user, so the run directory cannot be made")]
    return []


def thread_limit() -> int | None:
    """OMP_NUM_THREADS where the stage runs, when set: no trainer or evaluation process it starts
    gets more threads than that (a machine shared with other work)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def local_resources(nodes: int, procs_per_node: int) -> dict[str, Any]:
    """What a run of nodes x procs_per_node would use here, or why it cannot run: threads per
    process the cores shared out, no more than `thread_limit`; `threads`, one process's alone
    (the evaluation's)."""
    cpus, gpus = local_cpu_count(), gpu_count()
    world = nodes * procs_per_node
    device = "cuda" if gpus else "cpu"
    capacity = gpus if gpus else cpus
    limit = thread_limit() or cpus
    return {
        "device": device, "cpus": cpus, "gpus": gpus, "processes": world,
        "capacity": capacity, "fits": world <= capacity,
        "threads_per_process": min(max(1, cpus // world), limit),
        "threads": min(cpus, limit),
    }


def _torchrun_env(cfg: RunConfig, res: dict, gpus: range) -> dict[str, str]:
    """The environment of a local torchrun: the repo importable, threads per process, the
    GPUs it may use."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = str(res["threads_per_process"])
    env["PYTHONUNBUFFERED"] = "1"
    env[ERROR_DIR_ENV] = cfg.run_dir  # a config the trainer refuses is recorded there too
    env.update(TORCHRUN_ENV)  # in-place worker restarts get a clean store
    if res["device"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def _state_dir(cfg: RunConfig) -> Path:
    path = Path(cfg.run_dir) / "state"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_state(cfg: RunConfig, name: str, data: dict) -> None:
    """Atomic: a reader (a later try, teardown) sees the old record or the new, never a part;
    the temporary file is this process's own, so a stale try writing at once cannot mix in."""
    path = _state_dir(cfg) / f"{name}.json"
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _read_state(cfg: RunConfig, name: str) -> dict | None:
    path = Path(cfg.run_dir) / "state" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _trainer_processes(config_path: str) -> list[int]:
    """Pids of processes (agents and workers) running with this run's trainer config."""
    needle = config_path.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            pids.append(int(entry.name))
    return pids


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, it names one process
    even after the pid is reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _is_agent(pid: int, config_path: str) -> bool:
    """`pid` runs (not a zombie) with this run's trainer config: an agent it started (a pid
    reused by another program has another command line; one read while it execs is empty)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return (not cmdline or config_path.encode() in cmdline) and _alive(pid)


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


def stop_processes(pids: list[int], timeout: float = 15.0) -> list[int]:
    """SIGTERM, wait, then SIGKILL what is left; returns the pids that were running."""
    running = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            running.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in running):
        time.sleep(0.2)
    for pid in running:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return running


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class LocalTarget(Target):
    name = "local"

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        res = local_resources(values["nodes"], values["procs_per_node"])
        errors = []
        if values["float8"] and res["device"] != "cuda":
            errors.append(("float8", "needs GPUs with compute capability >= 8.9; this machine "
                           "has none (the trainer would run on the CPU)"))
        errors += device_problems(quantize_base=values["quantize_base"],
                                  gpu=res["device"] == "cuda", attention=values["attention"])
        if values["output_dir"].startswith("s3://"):
            errors.append(("output_dir", "s3:// output needs target eks; give a local "
                           "directory"))
        else:
            errors += output_dir_problems(values["output_dir"])
        if res["fits"]:
            return errors
        unit = "GPUs" if res["device"] == "cuda" else "CPU cores"
        return errors + [("procs_per_node", (
            f"nodes x procs_per_node = {res['processes']} processes do not fit this machine: "
            f"it has {res['capacity']} {unit}; allowed: at most {res['capacity']} in total"))]

    def snapshot(self, cfg: RunConfig) -> dict:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        return {"target": self.name, "run_dir": cfg.run_dir}

    def scale_up(self, cfg: RunConfig) -> dict:
        if cfg.dataset.startswith("s3://"):  # read with boto3's own credentials, as the trainer
            import boto3

            check_s3_dataset(cfg.dataset, cfg.dataset_format, boto3.client("s3"))
        res = local_resources(cfg.nodes, cfg.procs_per_node)
        if not res["fits"]:
            raise RuntimeError(f"{res['processes']} processes no longer fit this machine "
                               f"({res['capacity']} available)")
        log.info("local target: %d node(s) x %d process(es) on %s; this machine has %d CPU "
                 "cores and %d GPUs; %d thread(s) per process", cfg.nodes, cfg.procs_per_node,
                 res["device"], res["cpus"], res["gpus"], res["threads_per_process"])
        _write_state(cfg, "resources", res)
        return res

    def build_image(self, cfg: RunConfig) -> dict:
        tag = image_tag()
        env = local_environment()
        (Path(cfg.run_dir) / "environment.json").write_text(
            json.dumps({"image_tag": tag, **env}, indent=2))
        log.info("trainer content hash (image tag) %s; torch %s, transformers %s, datasets %s",
                 tag, env["torch"], env["transformers"], env["datasets"])
        return {"image_tag": tag, "image": f"local/finetune-trainer:{tag}"}

    def rendezvous(self, cfg: RunConfig) -> dict:
        endpoint, started = cfg.rdzv_endpoint, False
        if not endpoint:
            binary = etcd_binary()
            if binary is None:
                port = free_port()
                log.warning("etcd is not installed: falling back to torch's c10d rendezvous "
                            "store on 127.0.0.1:%d (install etcd-server for the etcd path)",
                            port)
                return {"backend": "c10d", "endpoint": f"127.0.0.1:{port}",
                        "rdzv_id": cfg.rdzv_id, "started_etcd": False}
            server = LocalEtcd.start(binary, Path(cfg.run_dir) / "logs")
            _write_state(cfg, "etcd", server.to_dict())
            endpoint, started = server.endpoint, True
            log.info("started etcd (pid %d) on %s", server.pid, endpoint)
        deleted = delete_rendezvous_keys(endpoint, cfg.rdzv_id)
        log.info("rendezvous id %s: deleted %d stale key(s) on etcd %s", cfg.rdzv_id,
                 len(deleted), endpoint)
        return {"backend": "etcd-v2", "endpoint": endpoint, "rdzv_id": cfg.rdzv_id,
                "started_etcd": started, "deleted_keys": len(deleted)}

    def preflight(self, cfg: RunConfig, image: dict, rendezvous: dict) -> dict:
        """Check this machine's devices as the run will use them: all its processes in one
        torchrun (gloo on CPU, NCCL on GPUs), grouped into the run's nodes."""
        if not cfg.preflight:
            return {"skipped": True}
        res = local_resources(cfg.nodes, cfg.procs_per_node)
        processes = cfg.nodes * cfg.procs_per_node
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(processes), "-m", "trainer.preflight",
               "--procs-per-node", str(cfg.procs_per_node), "--out", cfg.run_dir]
        log.info("preflight: %s", " ".join(cmd))
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=_torchrun_env(cfg, res, range(processes)),
                              capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S)
        measured = result_line(done.stdout)
        if done.returncode != 0 or measured is None:
            tail = (done.stdout + done.stderr).splitlines()[-LOG_TAIL_LINES:]
            raise PreflightFailed(f"preflight could not measure (exit {done.returncode}):\n"
                                  + "\n".join(tail))
        verdict = judge(measured, None)
        write_run_file(cfg.run_dir, _no_s3, PREFLIGHT_FILE, json.dumps(verdict, indent=2))
        log.info("preflight: %s", summary_line(verdict))
        if not verdict["ok"]:
            raise PreflightFailed(failure_message(verdict, "this machine cannot train the run"))
        return {"ok": True, "summary": summary_line(verdict)}

    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> dict:
        """Follow the run's training to its end: the one an earlier try started when it runs
        on (reattach) or finished (its result), else a new one.

        `state/train.json` is what was started: written before the agents start and after,
        so a try lost at any point leaves a record a retry reads. Only a failure of the
        training itself stops it here; a try that is killed or lost leaves it running for
        the retry, and teardown stops it when the run ends.
        """
        run_dir = Path(cfg.run_dir)
        config_path = run_dir / "trainer_config.json"
        res = local_resources(cfg.nodes, cfg.procs_per_node)
        state = _read_state(cfg, "train")
        if state:
            _stop_earlier_try(state)
        running = state and [pid for pid in state["agents"] if _is_agent(pid, state["config"])]
        if state and (running or training_finished(run_dir, state["started"])):
            if running:  # an earlier try's task process died (worker lost) while it trained
                log.info("reattaching to the training an earlier try started: torchrun agents "
                         "%s", state["agents"])
            else:
                log.info("the training an earlier try started has finished (summary.json "
                         "written, its agents gone): taking its result")
            agents = [Agent(node, pid=pid) for node, pid in enumerate(state["agents"])]
            started, reattached = state["started"], True
        else:
            if state:  # started, then ended unfinished with no try to see it (or cleared)
                log.warning("the training an earlier try started ended without finishing: "
                            "starting it again (it resumes from its newest checkpoint)")
                self._clear_earlier_training(state, rendezvous)
            started, reattached = time.time(), False
            config_path.write_text(json.dumps(trainer_config(cfg), indent=2))
            agents = []
            _write_train_state(cfg, agents, started, config_path)  # before anything starts
            for node in range(cfg.nodes):
                agents.append(Agent(node, self._start_agent(cfg, node, res, rendezvous,
                                                            config_path)))
                _write_train_state(cfg, agents, started, config_path)
        _write_train_state(cfg, agents, started, config_path)  # this try follows it now
        follower = _LogFollower(cfg, agents)
        with ResourceSampler(Path(cfg.run_dir)):
            # Killed or interrupted here, the training runs on (see above).
            failed = self._wait(cfg, agents, follower, res, rendezvous, config_path, started)
        follower.copy_new_lines()
        # Ended or failed: no torchrun agent or worker outlives it.
        stop_processes([a.pid for a in agents if a.alive()])
        stop_processes(_trainer_processes(str(config_path)))
        if failed:
            node, reason = failed
            failures = trainer_failures(str(run_dir), _no_s3)
            if failures and failures[0].get("signal") == "SIGKILL":
                failures[0]["message"] += _peak_memory(run_dir)
            because = failure_summary(failures)
            raise TrainingFailed(f"training failed: {because}node {node} {reason}; last "
                                 f"{len(follower.tail)} lines of {follower.log_path}:\n"
                                 + "\n".join(follower.tail))
        return {"model_dir": str(run_dir / "model"), "train_log": str(follower.log_path),
                "wall_time_s": round(time.time() - started, 1), "image_tag": image["image_tag"],
                "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")},
                "resources": res, "reattached": reattached,
                "node_restarts": max(a.restarts for a in agents)}

    def _clear_earlier_training(self, state: dict, rendezvous: dict) -> None:
        """Before starting again: what is left of the earlier training (processes the record
        missed) stopped, its closed rendezvous deleted (else RendezvousClosedError)."""
        stop_processes(_trainer_processes(state["config"]))
        if rendezvous["backend"] == "etcd-v2":
            delete_rendezvous_keys(rendezvous["endpoint"], rendezvous["rdzv_id"])

    def _wait(self, cfg: RunConfig, agents: list[Agent], follower: _LogFollower, res: dict,
              rendezvous: dict, config_path: Path, started: float) -> tuple[int, str] | None:
        """Follow the agents to the end: (node, reason) of a failure, or None.

        When a node's agent is killed (a lost node), the job is started again, up to
        max_restarts times, as the training operator restarts a job's pods: every agent
        stopped, the rendezvous cleared, all nodes started, the trainer resumes from the newest
        checkpoint. (A lone new agent does not get the survivors of a round that lost a node
        to rendezvous again.)
        """
        restarts = 0
        while True:
            follower.copy_new_lines()
            if cfg.active_deadline_s and time.time() - started > cfg.active_deadline_s:
                # The cost guard the eks job's activeDeadlineSeconds is; the caller stops all.
                return 0, (f"was stopped: the training ran past active_deadline_s "
                           f"({cfg.active_deadline_s} s)")
            lost = [a for a in agents if (a.exit_code() or 0) < 0]
            if lost and restarts < cfg.max_restarts:
                restarts += 1
                log.warning("torchrun agent of node %d was killed (signal %d): restarting all "
                            "%d node(s) (restart %d of %d)", lost[0].node, -lost[0].exit_code(),
                            len(agents), restarts, cfg.max_restarts)
                stop_processes([a.pid for a in agents if a.alive()])
                stop_processes(_trainer_processes(str(config_path)))
                follower.copy_new_lines()
                if rendezvous["backend"] == "etcd-v2":
                    delete_rendezvous_keys(rendezvous["endpoint"], rendezvous["rdzv_id"])
                for agent in agents:
                    agent.proc = self._start_agent(cfg, agent.node, res, rendezvous,
                                                   config_path)
                    agent.pid, agent.restarts = agent.proc.pid, agent.restarts + 1
                _write_train_state(cfg, agents, started, config_path)
            codes = [a.exit_code() for a in agents]
            if any(a.proc is None for a in agents):  # reattached: no exit codes to read
                if any(a.alive() for a in agents):
                    time.sleep(0.5)
                    continue
                if training_finished(Path(cfg.run_dir), started):
                    return None
                return 0, "ended without writing summary.json (its exit code is unknown)"
            if all(c == 0 for c in codes):
                return None
            for agent, code in zip(agents, codes, strict=True):
                if code not in (None, 0) and not (code < 0 and restarts < cfg.max_restarts):
                    return agent.node, f"exited with code {code}"
            time.sleep(0.5)

    def _start_agent(self, cfg: RunConfig, node: int, res: dict, rendezvous: dict,
                     config_path: Path) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "trainer.launch",  # torchrun, recording ranks killed
            "--nnodes", str(cfg.nodes), "--nproc-per-node", str(cfg.procs_per_node),
            "--rdzv-backend", rendezvous["backend"], "--rdzv-endpoint", rendezvous["endpoint"],
            "--rdzv-id", rendezvous["rdzv_id"], "--max-restarts", str(cfg.max_restarts),
            "-m", "trainer.train", "--config", str(config_path),
        ]
        first = node * cfg.procs_per_node
        env = _torchrun_env(cfg, res, range(first, first + cfg.procs_per_node))
        env[NODE_NAME_ENV] = f"{node} ({socket.gethostname()})"
        log.info("starting torchrun agent %d: %s", node, " ".join(cmd))
        # Output to a file and a session of its own: the training outlives this task's process
        # (a lost Airflow worker), and the retry reattaches to it.
        with _agent_log(cfg, node).open("ab") as out:
            return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def evaluate(self, cfg: RunConfig, trained: dict, image: dict, champion: dict) -> dict:
        """trainer.evaluate in one process on this machine, its output in the task log and in
        logs/evaluate.log."""
        run_dir = Path(cfg.run_dir)
        cmd = [sys.executable, "-m", "trainer.evaluate", "--config",
               str(run_dir / "trainer_config.json")]
        if champion.get("model_uri"):
            cmd += ["--champion", champion["model_uri"]]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        resources = trained.get("resources", {})
        env["OMP_NUM_THREADS"] = str(resources.get("threads") or resources.get("cpus") or 1)
        log_path = run_dir / "logs" / "evaluate.log"
        log.info("evaluating the trained model: %s", " ".join(cmd))
        started = time.time()
        with log_path.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
            tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
            for line in proc.stdout:
                out.write(line)
                tail.append(line.rstrip())
                log.info("%s", line.rstrip())
            code = proc.wait()
        if code:
            raise RuntimeError(f"evaluation failed (exit code {code}); last lines of "
                               f"{log_path}:\n" + "\n".join(tail))
        return evaluation_result(json.loads((run_dir / EVALUATION_FILE).read_text()),
                                 str(run_dir / EVALUATION_FILE), time.time() - started)

    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        run_dir = Path(cfg.run_dir)
        # what the train stage sampled: host CPU and memory, and the GPUs where NVML is there
        samples = load_samples(run_dir / HOST_SAMPLES_FILE)
        report = write_report(run_dir, run_id=cfg.run_id, status="success",
                              config=cfg.to_dict(), stages={"train": trained},
                              gpu=sampled_gpu_metrics(samples, node=os.uname().nodename)
                              if trained.get("resources", {}).get("device") == "cuda" else None,
                              host=host_section(samples),
                              node_hourly_price=cfg.node_hourly_price, nodes=1,
                              plan=plan_run(cfg).to_dict())
        return _summary(cfg, report)

    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        run_dir = Path(cfg.run_dir)
        stopped: dict[str, Any] = {}
        train_state = _read_state(cfg, "train")
        if train_state:
            pids = [p for p in train_state["agents"] if _alive(p)]
            pids += _trainer_processes(train_state["config"])
            stopped["trainer_processes"] = stop_processes(sorted(set(pids)))
        etcd_state = _read_state(cfg, "etcd")
        if etcd_state:
            server = LocalEtcd(**etcd_state)
            stopped["etcd"] = server.is_running()
            server.stop()  # its data dir, and so every key, goes with it
        elif cfg.rdzv_endpoint:
            try:  # an etcd the run did not start: leave no keys of this run on it
                stopped["rendezvous_keys"] = len(delete_rendezvous_keys(cfg.rdzv_endpoint,
                                                                        cfg.rdzv_id))
            except Exception as exc:  # the keys are cleared again before the id is reused
                log.warning("could not delete rendezvous %s's keys on etcd %s: %s",
                            cfg.rdzv_id, cfg.rdzv_endpoint, exc)
        if run_dir.is_dir() and not (run_dir / "report.json").exists():
            # The run failed before collect_metrics: still leave a report of what it did.
            cause = trainer_root_cause(str(run_dir), _no_s3)
            report = write_report(run_dir, run_id=cfg.run_id, status="failed",
                                  config=cfg.to_dict(), error=cause)
            stopped["report"] = _summary(cfg, report)
        log.info("teardown: %s; outputs kept in %s", stopped or "nothing was running", run_dir)
        return stopped


def _peak_memory(run_dir: Path) -> str:
    """The machine's peak memory use while the run trained (the resource sampler's), or ""."""
    samples = [s for s in load_samples(run_dir / HOST_SAMPLES_FILE)
               if s.get("memory_used_bytes") and s.get("memory_total_bytes")]
    if not samples:
        return ""
    peak = max(samples, key=lambda s: s["memory_used_bytes"])
    return (f"; the run's peak memory use on this machine: {peak['memory_used_bytes'] / 2**30:.1f}"
            f" of {peak['memory_total_bytes'] / 2**30:.1f} GiB")


def _write_train_state(cfg: RunConfig, agents: list[Agent], started: float,
                       config_path: Path) -> None:
    """What was started (the agents, when, with which config) and which try follows it."""
    _write_state(cfg, "train", {"agents": [a.pid for a in agents], "started": started,
                                "config": str(config_path),
                                "task": {"pid": os.getpid(), "ticks": _start_ticks(os.getpid())}})


def _stop_earlier_try(state: dict) -> None:
    """An earlier try's task process that outlived its supervisor (Airflow stopped as a whole:
    the task runs in a process group of its own) would follow the training beside this try:
    Airflow runs one try at a time, so it is stopped."""
    task = state.get("task") or {}
    pid = task.get("pid")
    if not pid or pid == os.getpid() or _start_ticks(pid) != task.get("ticks"):
        return
    log.warning("stopping the task process of an earlier try (pid %d) that outlived its "
                "supervisor", pid)
    # SIGKILL: a task process takes SIGTERM as on_kill, and lives on.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _summary(cfg: RunConfig, report: dict) -> dict:
    return summary(cfg.run_dir, report, (Path(cfg.run_dir) / "model").is_dir())


def _agent_log(cfg: RunConfig, node: int) -> Path:
    path = Path(cfg.run_dir) / "logs" / f"torchrun-node-{node}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class Agent:
    """One node's torchrun agent: started by this task (proc) or by an earlier try (pid only)."""

    def __init__(self, node: int, proc: subprocess.Popen | None = None, pid: int = 0):
        self.node, self.proc, self.restarts = node, proc, 0
        self.pid = proc.pid if proc is not None else pid

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else _alive(self.pid)


class _LogFollower:
    """Copies the agents' new output lines into the task log and train.log, once each.

    How far each node's log was copied is kept in the run's state, so a retry that reattaches
    continues where the lost try stopped.
    """

    def __init__(self, cfg: RunConfig, agents: list[Agent]):
        self.cfg, self.agents = cfg, agents
        self.log_path = Path(cfg.run_dir) / "train.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.offsets = {int(k): v for k, v in
                        (_read_state(cfg, "train_log") or {}).get("offsets", {}).items()}

    def copy_new_lines(self) -> None:
        copied = False
        with self.log_path.open("a") as train_log:
            for agent in self.agents:
                path = _agent_log(self.cfg, agent.node)
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
            _write_state(self.cfg, "train_log", {"offsets": self.offsets})


def _no_s3() -> None:
    raise AssertionError("the local target's run directories are on this machine")
