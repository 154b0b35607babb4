"""`LocalTarget`: the local target's stages, this machine as the cluster.

Nodes are torchrun agents on this machine (`training`), the rendezvous is a local etcd (or
torch's c10d store when etcd is not installed), the image is this checkout's trainer/ in this
Python environment. What later tasks need (etcd's pid, the training started) is kept in
<run_dir>/state/ (`state`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.config import RunConfig
from finetune.etcd import LocalEtcd, delete_rendezvous_keys, etcd_binary, free_port
from finetune.gpu_metrics import (
    HOST_SAMPLES_FILE,
    ResourceSampler,
    host_section,
    load_samples,
    sampled_gpu_metrics,
)
from finetune.image import image_tag, local_environment
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
from finetune.sweep.early_stop import LOCAL_POLL_S, RungWatch, is_trial, stop_reason
from finetune.targets.base import Target, TrainingFailed
from finetune.targets.local.machine import (
    gpu_capability,
    local_resources,
    output_dir_problems,
    python_env,
    torchrun_env,
)
from finetune.targets.local.processes import (
    is_agent,
    is_alive,
    stop_processes,
    trainer_processes,
)
from finetune.targets.local.state import read_state, write_state
from finetune.targets.local.training import (
    LOG_TAIL_LINES,
    Agent,
    LogFollower,
    clear_earlier_training,
    follow_agents,
    read_history,
    start_agent,
    stop_earlier_try,
    training_finished,
    write_train_state,
)
from finetune.trainer_config import trainer_config
from finetune_contract.errors import failure_summary
from finetune_contract.fields import EVALUATION_FILE
from finetune_contract.rules import device_problems, fa4_importable
from finetune_contract.run_history import preemptions

log = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_S = 300


class LocalTarget(Target):
    name = "local"

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        res = local_resources(values["nodes"], values["procs_per_node"])
        gpu = res["device"] == "cuda"
        errors = device_problems(quantize_base=values["quantize_base"], gpu=gpu,
                                 attention=values["attention"], float8=values["float8"],
                                 capability=gpu_capability() if gpu else None,
                                 fa4_installed=fa4_importable(),
                                 where="this machine's Python environment (the trainer's)")
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
        write_state(cfg, "resources", res)
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
            earlier = read_state(cfg, "etcd")
            if earlier:  # this stage run again (cleared): the etcd it started before goes first
                LocalEtcd(**earlier).stop()
                log.info("stopped the etcd (pid %d) an earlier rendezvous of this run started",
                         earlier["pid"])
            server = LocalEtcd.start(binary, Path(cfg.run_dir) / "logs")
            write_state(cfg, "etcd", server.to_dict())
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
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=torchrun_env(cfg, res, range(processes)),
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
        state = read_state(cfg, "train")
        if state:
            stop_earlier_try(state)
        running = state and [pid for pid in state["agents"] if is_agent(pid, state["config"])]
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
                clear_earlier_training(state, rendezvous)
            started, reattached = time.time(), False
            config_path.write_text(json.dumps(trainer_config(cfg), indent=2))
            agents = []
            write_train_state(cfg, agents, started, config_path)  # before anything starts
            for node in range(cfg.nodes):
                agents.append(Agent(node, start_agent(cfg, node, res, rendezvous, config_path)))
                write_train_state(cfg, agents, started, config_path)
        write_train_state(cfg, agents, started, config_path)  # this try follows it now
        follower = LogFollower(cfg, agents)
        # A sweep's trial: the early-stopping rule, asked while it trains.
        watch = RungWatch(cfg, _no_s3, LOCAL_POLL_S) if is_trial(cfg) else None
        with ResourceSampler(Path(cfg.run_dir)):
            # Killed or interrupted here, the training runs on (see above).
            failed = follow_agents(cfg, agents, follower, res, rendezvous, config_path, started,
                                   stop=watch.poll if watch is not None else None)
        follower.copy_new_lines()
        # Ended or failed: no torchrun agent or worker outlives it.
        stop_processes([a.pid for a in agents if a.alive()])
        stop_processes(trainer_processes(str(config_path)))
        if failed:
            node, reason = failed
            failures = trainer_failures(str(run_dir), _no_s3)
            if failures and failures[0].get("signal") == "SIGKILL":
                failures[0]["message"] += _peak_memory(run_dir)
            because = failure_summary(failures)
            raise TrainingFailed(f"training failed: {because}node {node} {reason}; last "
                                 f"{len(follower.tail)} lines of {follower.log_path}:\n"
                                 + "\n".join(follower.tail))
        ended = time.time()
        result = {"model_dir": str(run_dir / "model"), "train_log": str(follower.log_path),
                  "wall_time_s": round(ended - started, 1), "started": started, "ended": ended,
                  "nodes": cfg.nodes,
                  "image_tag": image["image_tag"],
                  "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")},
                  "resources": res, "reattached": reattached,
                  "node_restarts": max(a.restarts for a in agents)}
        if watch is not None and watch.stop is not None and \
                not training_finished(run_dir, started):
            noticed = preemptions(read_history(cfg))
            at = noticed[-1]["step"] if noticed else None
            result.update(model_dir=None, stopped={**watch.stop, "stopped_at": at,
                                                   "reason": stop_reason(watch.stop, at)})
        return result

    def evaluate(self, cfg: RunConfig, trained: dict, image: dict, champion: dict) -> dict:
        """trainer.evaluate in one process on this machine, its output in the task log and in
        logs/evaluate.log."""
        run_dir = Path(cfg.run_dir)
        cmd = [sys.executable, "-m", "trainer.evaluate", "--config",
               str(run_dir / "trainer_config.json")]
        if champion.get("model_uri"):
            cmd += ["--champion", champion["model_uri"]]
        resources = trained.get("resources", {})
        env = python_env(resources.get("threads") or resources.get("cpus") or 1)
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
        return self.release(cfg)  # this machine's nodes need no giving back

    def release(self, cfg: RunConfig) -> dict:
        run_dir = Path(cfg.run_dir)
        stopped: dict[str, Any] = {}
        train_state = read_state(cfg, "train")
        if train_state:
            pids = [p for p in train_state["agents"] if is_alive(p)]
            pids += trainer_processes(train_state["config"])
            stopped["trainer_processes"] = stop_processes(sorted(set(pids)))
        etcd_state = read_state(cfg, "etcd")
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


def _summary(cfg: RunConfig, report: dict) -> dict:
    return summary(cfg.run_dir, report, (Path(cfg.run_dir) / "model").is_dir())


def _no_s3() -> None:
    raise AssertionError("the local target's run directories are on this machine")
