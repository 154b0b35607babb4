"""Fine-tune a causal LM with FSDP2. Run under torchrun, or alone as a world of one:

torchrun --nproc-per-node 2 -m trainer.train --config cfg.json [--max_steps 10 ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.elastic.multiprocessing.errors import record
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from finetune_contract.data import batches_per_epoch, optimizer_steps
from finetune_contract.errors import ERROR_DIR_ENV
from finetune_contract.fields import RESOLVED_CONFIG_FILE
from finetune_contract.parallel_dims import ParallelDims, elastic_grad_accum
from finetune_contract.rules import loss_chunk_tokens
from finetune_contract.stragglers import RANK_STEP_TIMES, stragglers
from finetune_contract.throughput import flops_per_token, mfu
from trainer.activations import resolve_auto_checkpointing
from trainer.attention import runs_varlen
from trainer.checkpoint import Checkpointer
from trainer.config import TrainConfig, parse_args
from trainer.data import (
    IGNORE_INDEX,
    Batch,
    EvalBatches,
    ResumableSampler,
    Splits,
    TrainBatches,
    build_splits,
)
from trainer.dpo import dpo_train_step, with_reference_logps
from trainer.errors import root_cause_recorded
from trainer.export import export_hf
from trainer.float8 import precompute_float8_scales
from trainer.history import RunHistory, process_started
from trainer.lora import apply_lora
from trainer.loss import LOSS_METHOD, add_loss_method
from trainer.master_weights import compute_weights
from trainer.metrics import (
    METRICS_FILE,
    MetricsLog,
    peak_flops,
    peak_memory_bytes,
)
from trainer.model import build_model, materialize_weights
from trainer.optim import build_grad_scaler, build_optimizer, optimizer_step
from trainer.parallel import (
    COMPUTE_DTYPES,
    DistEnv,
    ParallelMesh,
    apply_parallelism,
    build_mesh,
    check_start,
    init_distributed,
    quantize_dtype,
)
from trainer.preemption import Notice, Preempted, mark_done, mark_saved, stop_agent
from trainer.storage import RunOutput
from trainer.tensor_parallel import SequenceParallelBatches
from trainer.watchdog import HangWatchdog, watchdog_env_defaults


@record  # torchrun's error file, and so its ChildFailedError, carries this rank's exception
def main(argv: Sequence[str] | None = None) -> None:
    started = time.time()
    notice = Notice().install()  # a SIGTERM from here on saves the step it interrupts
    rank = int(os.environ.get("RANK", 0))  # torchrun's global rank; 0 for a world of one
    with root_cause_recorded(os.environ.get(ERROR_DIR_ENV), rank):
        config = parse_args(argv)
    with root_cause_recorded(config.output_dir, rank):
        if config.hang_timeout_s:  # before the process group: NCCL reads them at its start
            os.environ.update(watchdog_env_defaults(config.output_dir, torch.cuda.is_available()))
        env = init_distributed()
        try:
            train(config, env, started, notice)
        finally:
            dist.destroy_process_group()
        mark_done()


def train(config: TrainConfig, env: DistEnv, started: float,
          notice: Notice | None = None) -> dict[str, Any] | None:
    """The whole run; returns the summary on rank 0. Raises Preempted once a notice's step is
    saved."""
    trainer = Trainer.setup(config, env, started)
    trainer.notice = notice or Notice()
    if config.hang_timeout_s:  # here, not in resume(): it ends the process it runs in
        trainer.watchdog = HangWatchdog(
            config.output_dir, trainer.output.dir, env.rank, config.hang_timeout_s
        ).start()
    try:
        state = trainer.resume()
        while state.step < trainer.max_steps:
            trainer.step(state)
        return trainer.finish(state)
    finally:
        if trainer.watchdog is not None:
            trainer.watchdog.stop()


@dataclass
class TrainState:
    """Where the run is: what a step changes, and what a checkpoint keeps of it."""

    step: int = 0
    initial_eval_loss: float | None = None
    resumed_from_step: int | None = None
    skipped_steps: int = 0  # steps the fp16 grad scaler skipped on inf/NaN gradients
    eval_loss: float | None = None
    last_eval_step: int | None = None
    # the step's eval was due and not taken before its save (a notice saves first): resume takes
    # it, so a sweep's rung and the eval curve keep that step
    eval_due: bool = False
    # A mixture's eval loss per source (name -> loss), at the first eval and the last.
    initial_eval_loss_by_source: dict[str, float] | None = None
    eval_loss_by_source: dict[str, float] | None = None


@dataclass
class Trainer:
    """Everything built once for a run: setup() makes it, then resume(), step() and finish()."""

    config: TrainConfig
    env: DistEnv
    mesh: ParallelMesh  # the parallel layout of this world, and its device mesh
    started: float  # wall-clock time the process started, for the summary
    output: RunOutput
    tokenizer: PreTrainedTokenizerBase
    splits: Splits
    sampler: ResumableSampler
    batches: Iterator[Batch]
    evals: Iterable[Batch]
    max_steps: int
    # A mixture's held-out batches by source (the eval loss per source); {} for one data set.
    source_evals: dict[str, Iterable[Batch]]
    model: torch.nn.Module
    model_config: PretrainedConfig
    token_flops: float
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    scheduler: LambdaLR
    checkpointer: Checkpointer
    compute_dtype: torch.dtype
    peak: float | None  # None: no trusted peak (CPUs), so no MFU
    peak_source: str
    # DPO without LoRA: the frozen initial weights, sharded like the policy (no optimizer state).
    reference: torch.nn.Module | None = None
    data_load_s: float = 0.0  # loading the prepared splits at start (memory-mapped)
    # From the process's start to the end of its first optimizer step (model, data, compile).
    time_to_first_step_s: float | None = None
    # Opened by resume(): a resumed run's log keeps its records up to the checkpoint.
    log: MetricsLog = field(init=False)
    # Started by train() when hang_timeout_s is set: ends this rank when it stops progressing.
    watchdog: HangWatchdog | None = field(init=False, default=None)
    # SIGTERM noted (trainer/preemption.py); the run's history of rounds, saves and notices.
    notice: Notice = field(init=False, default_factory=Notice)
    history: RunHistory = field(init=False)
    load_s: float = 0.0  # this round's checkpoint load
    saved_step: int | None = None  # the step of the checkpoint saved (or loaded) last

    @classmethod
    def setup(cls, config: TrainConfig, env: DistEnv, started: float) -> Trainer:
        """Check the config, then build data, model, optimizer and checkpointer."""
        config, chosen = resolve_auto_checkpointing(config, env.world_size,
                                                    env.local_world_size, env.device)
        if chosen and env.rank == 0:
            print(chosen, flush=True)  # the resolved config below records the choice
        check_start(config, env)
        mesh = build_mesh(config, env)
        # For an s3:// output_dir: a local staging dir with the same layout, uploaded from.
        output = RunOutput(config.output_dir, env.rank)
        write_resolved_config(config, env, output)
        torch.manual_seed(config.seed)

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        pad_id = (
            tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        )
        data_started = time.perf_counter()
        splits = build_splits(config)
        data_load_s = time.perf_counter() - data_started
        # The ranks of a tensor-parallel group work on the same batch: sample per data-parallel
        # rank.
        dp_rank, dp_size = mesh.dims.dp_rank(env.rank), mesh.dims.dp_degree
        sampler = ResumableSampler(
            len(splits.train), config.micro_batch, dp_rank, dp_size, config.seed
        )
        # Packed rows are seq_len long anyway. float8 matmuls need token counts in multiples of
        # 16, which compiled blocks cannot prove of dynamic lengths: rows of a fixed length then.
        pad_to = config.seq_len if config.packing or config.float8 else None
        batches: Iterator[Batch] = TrainBatches(splits.train, sampler, pad_id, pad_to)
        evals: Iterable[Batch] = EvalBatches(
            splits.eval, config.micro_batch, dp_rank, dp_size, pad_id, pad_to
        )
        source_evals: dict[str, Iterable[Batch]] = {
            name: EvalBatches(rows, config.micro_batch, dp_rank, dp_size, pad_id, pad_to)
            for name, rows in splits.eval_by_source().items()}
        if config.tp_degree > 1:
            batches = SequenceParallelBatches(batches, config.tp_degree, pad_id)
            evals = SequenceParallelBatches(evals, config.tp_degree, pad_id)
            source_evals = {name: SequenceParallelBatches(rows, config.tp_degree, pad_id)
                            for name, rows in source_evals.items()}
        # An elastic run in a smaller world than planned keeps its global batch (more
        # micro-batches a step) and its schedule: the steps are the planned world's.
        grad_accum = elastic_grad_accum(config, mesh.dims)
        if grad_accum != config.grad_accum:
            planned_dp = ParallelDims.of(config, world_size=config.nodes * env.local_world_size,
                                         procs_per_node=env.local_world_size).dp_degree
            max_steps = optimizer_steps(config, batches_per_epoch(
                len(splits.train), config.micro_batch, planned_dp))
            if env.rank == 0:
                print(f"elastic: {env.world_size // env.local_world_size} of {config.nodes} "
                      f"nodes, grad_accum {config.grad_accum} -> {grad_accum} keeps the global "
                      "batch", flush=True)
            config = dataclasses.replace(config, grad_accum=grad_accum)
        else:
            max_steps = optimizer_steps(config, sampler.batches_per_epoch)
        if env.rank == 0:
            print_data(splits, max_steps)

        model = build_model(config.model, tokenizer, config.attention, config.seq_len)
        # LoRA: adapters in the blocks before any wrapping; the base weights are frozen.
        adapter_params = apply_lora(model, config) if config.lora_rank else None
        model_config = model.config
        token_flops = flops_per_token(model_config, config.seq_len, adapter_params)
        apply_parallelism(model, config, env, mesh)
        # FSDP's CPU offload keeps the sharded parameters in CPU memory.
        param_device = torch.device("cpu") if config.cpu_offload else env.device
        materialize_weights(model, config.model, config.seed, param_device,
                            quantize_dtype(config))
        add_loss_method(model, loss_chunk_tokens(config, model_config.vocab_size))
        reference = None
        if config.method == "dpo" and config.dpo_reference == "precompute":
            # Scored once by the initial weights, before any step: no second model is held.
            splits.train = with_reference_logps(splits.train, model, config.micro_batch, env,
                                                pad_id)
            batches = TrainBatches(splits.train, sampler, pad_id, pad_to)
        elif config.method == "dpo" and not config.lora_rank:  # LoRA: the adapters disabled
            reference = build_model(config.model, tokenizer, config.attention, config.seq_len)
            # frozen before its weights exist: on one GPU they are made in the compute dtype,
            # and it computes as the policy's copies do (master_weights.frozen_in_compute_dtype)
            reference.requires_grad_(False)
            apply_parallelism(reference, config, env, mesh)
            materialize_weights(reference, config.model, config.seed, param_device,
                                quantize_dtype(config))
            add_loss_method(reference, loss_chunk_tokens(config, model_config.vocab_size))
        optimizer = build_optimizer(model, config, env.device)
        scaler = build_grad_scaler(config.mixed_precision, env.device)
        scheduler = LambdaLR(
            optimizer, warmup_cosine(config.warmup_steps, max_steps, config.min_lr_ratio)
        )
        checkpointer = Checkpointer(
            output,
            config.keep_checkpoints,
            env.rank,
            local_rank=env.local_rank,
            async_save=config.checkpoint_async,
        )
        compute_dtype = COMPUTE_DTYPES[config.mixed_precision]
        peak, peak_source = peak_flops(env.device, compute_dtype)
        return cls(
            config=config, env=env, mesh=mesh, started=started, output=output, tokenizer=tokenizer,
            splits=splits, sampler=sampler, batches=batches, evals=evals, max_steps=max_steps,
            source_evals=source_evals,
            model=model, model_config=model_config, token_flops=token_flops, optimizer=optimizer,
            scaler=scaler, scheduler=scheduler, checkpointer=checkpointer,
            compute_dtype=compute_dtype, peak=peak, peak_source=peak_source, reference=reference,
            data_load_s=data_load_s,
        )  # fmt: skip

    def resume(self) -> TrainState:
        """Continue from the newest complete checkpoint, or start at step 0 with an eval; open
        the metrics log accordingly."""
        state = TrainState()
        self.history = RunHistory(self.output, self.env.rank)
        latest = self.checkpointer.latest()
        if latest is not None:
            loading = time.perf_counter()
            state = self.restore_checkpoint(latest)
            self.load_s = time.perf_counter() - loading
            if self.env.rank == 0:
                print(f"resumed from {latest}", flush=True)
        self.output.fetch(METRICS_FILE)  # the log up to the checkpoint, to continue

        config, splits = self.config, self.splits
        self.log = MetricsLog(
            str(self.output.dir), self.env.rank, self.max_steps, config.log_interval,
            state.resumed_from_step, config.metrics_port,
        )  # fmt: skip
        self.log.log_data(
            len(splits.train),
            len(splits.eval),
            splits.skipped,
            resumed=state.resumed_from_step is not None,
        )
        if state.initial_eval_loss is None:
            self.eval_and_log(state)
            state.initial_eval_loss = state.eval_loss
            state.initial_eval_loss_by_source = state.eval_loss_by_source
        elif state.eval_due:  # the saved step's eval, which its notice came before
            self.eval_and_log(state)
            self.output.sync(METRICS_FILE)
        self.model.train()
        return state

    def begin_round(self, state: TrainState) -> None:
        """At this round's first step (or its end, for a round resumed at the last step): what
        came before was start-up; from here a notice is noted and saved for, not ended at once."""
        if self.notice.training:
            return
        self.notice.training = True
        env, lost = self.env, self.log.dropped
        self.history.append(
            "start", started=process_started(), world_size=env.world_size,
            nodes=env.world_size // env.local_world_size,
            resumed_from_step=state.resumed_from_step, load_s=self.load_s,
            lost_steps=len(lost), lost_s=sum(r["step_time_s"] for r in lost))

    def step(self, state: TrainState) -> None:
        """One optimizer step over grad_accum micro batches; logs it, then evaluates, uploads the
        log and checkpoints as the intervals say."""
        config, env, scaler = self.config, self.env, self.scaler
        self.begin_round(state)
        step_start = time.perf_counter()
        micro_batches = [next(self.batches) for _ in range(config.grad_accum)]
        waits: list[float] = []
        dpo_metrics: dict[str, float] = {}
        if config.method == "dpo":
            loss, tokens, dpo_metrics = dpo_train_step(
                self.model, self.reference, micro_batches, config, env, scaler)
        else:
            loss, tokens = train_step(self.model, micro_batches, env, scaler, waits)
        tokens //= self.mesh.dims.tp_degree  # every rank of a TP group counted the same tokens
        grad_norm, skipped = optimizer_step(
            self.model, self.optimizer, config.max_grad_norm, scaler
        )
        if config.float8:
            precompute_float8_scales(self.model)
        state.skipped_steps += skipped
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        if not skipped:  # as in Accelerate: a step the fp16 scaler skipped keeps its learning rate
            self.scheduler.step()
        state.step += 1
        step_time = time.perf_counter() - step_start
        if self.time_to_first_step_s is None:
            self.time_to_first_step_s = time.time() - self.started
            if env.rank == 0:
                print(f"first step {self.time_to_first_step_s:.1f} s after start (data loaded "
                      f"in {self.data_load_s:.2f} s, nothing tokenized)", flush=True)
        # Without the wait for the others at the step's first collective: a rank slow to get
        # its batches or to finish its previous step shows; the others would report its delay.
        # A notice (SIGTERM) any rank noted travels with them: every rank learns of it here.
        gathered = gather_floats([step_time - sum(waits), self.notice.at], env)
        rank_times = [times for times, _ in gathered]
        notices = [at for _, at in gathered if at]
        tflops = self.token_flops * tokens / step_time / env.world_size / 1e12
        # fp16: the steps skipped so far on inf/NaN gradients, and the loss scale now.
        scaling = (
            {"skipped_steps": state.skipped_steps, "loss_scale": scaler.get_scale()}
            if scaler
            else {}
        )
        self.log.log_train(
            step=state.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens,
            tokens_per_s=tokens / step_time,
            tflops_per_device=tflops,
            mfu=mfu(tflops, self.peak),
            step_time_s=step_time,
            peak_memory_bytes=peak_memory_bytes(env.device),
            **{RANK_STEP_TIMES: rank_times},
            **scaling,
            **dpo_metrics,
        )
        if notices:
            self.stop_for_notice(state, min(notices))
        if config.eval_interval and state.step % config.eval_interval == 0:
            self.eval_and_log(state)
            self.output.sync(METRICS_FILE)
        elif state.step % config.log_interval == 0:
            self.output.sync(METRICS_FILE)
        if config.checkpoint_interval and state.step % config.checkpoint_interval == 0:
            self.save_checkpoint(state)
            self.output.sync(METRICS_FILE)
        self.progressed(state)

    def stop_if_noticed(self, state: TrainState) -> None:
        """Outside a step (which gathers them itself): whether any rank has noted a notice since
        the last step's end; if one has, stop_for_notice."""
        notices = [at for (at,) in gather_floats([self.notice.at], self.env) if at]
        if notices:
            self.stop_for_notice(state, min(notices))

    def stop_for_notice(self, state: TrainState, notice_at: float) -> None:
        """A rank got a notice during this step: save it, record the preemption, stop."""
        saving = time.perf_counter()
        if self.saved_step == state.step:  # after the last step, saved at its interval: its
            self.checkpointer.restate(state.step, self.trainer_state(state))  # eval, if taken
        else:
            self.save_checkpoint(state)
        self.checkpointer.wait()  # an async save is complete (uploaded) before the exit
        save_s = time.perf_counter() - saving
        self.output.sync(METRICS_FILE)
        self.history.append("preempted", step=state.step, notice=notice_at, save_s=save_s)
        if self.env.rank == 0:
            print(f"preempted at step {state.step}: a notice came "
                  f"{max(0.0, time.time() - notice_at):.1f} s ago; the step is saved "
                  f"({save_s:.1f} s) and the run goes on from it when started again",
                  flush=True)
        mark_saved()
        stop_agent()
        raise Preempted(state.step)

    def finish(self, state: TrainState) -> dict[str, Any] | None:
        """Complete the last checkpoint, evaluate, export the model; rank 0 writes the summary
        and returns it."""
        env, output = self.env, self.output
        self.begin_round(state)  # a round resumed at the last step trains nothing
        # A notice after the last step's gather, or during the final eval, saves the last step
        # and stops as one during a step does: the next round evaluates and exports. (One during
        # the export lets it finish, in the grace torchrun's agent gives it.)
        self.stop_if_noticed(state)
        if state.last_eval_step != state.step:
            self.eval_and_log(state)
            self.stop_if_noticed(state)
        self.checkpointer.close()  # an async save still in flight completes (and is pruned) first
        self.history.append("end", step=state.step)
        output.sync(METRICS_FILE)
        export_hf(
            self.model,
            self.model_config,
            self.tokenizer,
            output.dir / "model",
            env.rank,
            self.compute_dtype,
        )
        output.sync_tree("model")
        self.progressed(state)

        memory = torch.tensor(peak_memory_bytes(env.device), device=env.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        if env.rank != 0:
            return None
        summary = self.summary(state, int(memory.item()))
        (output.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        output.sync("summary.json")
        print(
            f"done: {state.step} steps, eval loss {state.initial_eval_loss:.4f} -> "
            f"{state.eval_loss:.4f}, {summary['wall_time_s']:.1f}s, "
            f"{summary['tokens_per_s'] or 0:,.0f} tokens/s; model in "
            f"{output.location.rstrip('/')}/model",
            flush=True,
        )
        return summary

    def eval_and_log(self, state: TrainState) -> None:
        """The eval loss at this step (a mixture's per source too, over the same rows), logged."""
        evaluating = time.perf_counter()
        if self.source_evals:
            sums = {name: eval_sums(self.model, rows, self.env.device)
                    for name, rows in self.source_evals.items()}
            state.eval_loss_by_source = {name: (loss / tokens).item()
                                         for name, (loss, tokens) in sums.items()}
            total = sum(sums.values())
            state.eval_loss = (total[0] / total[1]).item()
        else:
            state.eval_loss = evaluate(self.model, self.evals, self.env.device)
        state.last_eval_step = state.step
        self.log.log_eval(state.step, state.eval_loss, state.eval_loss_by_source)
        self.history.append("eval", step=state.step, seconds=time.perf_counter() - evaluating)
        self.progressed(state)

    def progressed(self, state: TrainState) -> None:
        """A step, eval, save or export completed: the hang watchdog's clock restarts."""
        if self.watchdog is not None:
            self.watchdog.progress(state.step)

    def save_checkpoint(self, state: TrainState) -> None:
        """Model, optimizer and what restore_checkpoint() needs to continue from this step."""
        saving = time.perf_counter()
        self.checkpointer.save(state.step, self.model, self.optimizer, self.trainer_state(state))
        self.saved_step = state.step
        # what the training waited for (an async save: the copy to CPU memory)
        self.history.append("save", step=state.step, seconds=time.perf_counter() - saving)

    def trainer_state(self, state: TrainState) -> dict[str, Any]:
        """What a checkpoint keeps beside the model and optimizer (restore_checkpoint)."""
        return {
            "sampler": self.sampler.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "initial_eval_loss": state.initial_eval_loss,
            "initial_eval_loss_by_source": state.initial_eval_loss_by_source,
            "skipped_steps": state.skipped_steps,
            "eval_due": bool(self.config.eval_interval
                             and state.step % self.config.eval_interval == 0
                             and state.last_eval_step != state.step),
            # the last eval taken, so a round resumed at the last step (a notice after the final
            # eval) does not take it again
            "last_eval_step": state.last_eval_step,
            "eval_loss": state.eval_loss,
            "eval_loss_by_source": state.eval_loss_by_source,
            **({"grad_scaler": self.scaler.state_dict()} if self.scaler else {}),
        }

    def restore_checkpoint(self, path: Path) -> TrainState:
        """Load a checkpoint save_checkpoint() wrote into model, optimizer, sampler, scheduler
        and scaler; the state to continue from."""
        saved = self.checkpointer.load(path, self.model, self.optimizer)
        self.saved_step = saved["step"]
        self.sampler.load_state_dict(saved["sampler"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and "grad_scaler" in saved:
            self.scaler.load_state_dict(saved["grad_scaler"])
        return TrainState(
            step=saved["step"],
            initial_eval_loss=saved["initial_eval_loss"],
            initial_eval_loss_by_source=saved.get("initial_eval_loss_by_source"),
            resumed_from_step=saved["step"],
            skipped_steps=saved.get("skipped_steps", 0),
            eval_due=saved.get("eval_due", False),
            last_eval_step=saved.get("last_eval_step"),
            eval_loss=saved.get("eval_loss"),
            eval_loss_by_source=saved.get("eval_loss_by_source"),
        )

    def summary(self, state: TrainState, peak_memory: int) -> dict[str, Any]:
        """summary.json: the run's outcome, throughput, data and config."""
        splits = self.splits
        return {
            "initial_eval_loss": state.initial_eval_loss,
            "final_eval_loss": state.eval_loss,
            "steps": state.step,
            **self.log.throughput_summary(),
            "peak_memory_bytes": peak_memory,
            "wall_time_s": time.time() - self.started,
            "world_size": self.env.world_size,
            "resumed_from_step": state.resumed_from_step,
            "skipped_rows": splits.skipped_rows,
            "skipped_rows_by_reason": splits.skipped,
            "time_to_first_step_s": self.time_to_first_step_s,
            "data_load_s": self.data_load_s,
            "prepared_data": splits.stats.get("path"),
            "skipped_steps": state.skipped_steps,
            "stragglers": stragglers(
                [r[RANK_STEP_TIMES] for r in self.log.train], self.config.straggler_threshold
            ),
            "train_rows": len(splits.train),
            "eval_rows": len(splits.eval),
            **({"initial_eval_loss_by_source": state.initial_eval_loss_by_source,
                "final_eval_loss_by_source": state.eval_loss_by_source}
               if self.source_evals else {}),
            "flops_per_token": self.token_flops,
            "peak_flops": self.peak,
            "peak_flops_source": self.peak_source,
            "config": self.config.to_dict(),
        }


def write_resolved_config(config: TrainConfig, env: DistEnv, output: RunOutput) -> None:
    """Rank 0 saves the resolved config beside the run's outputs and prints one line of it."""
    if env.rank != 0:
        transformers.logging.set_verbosity_error()
        return
    output.dir.mkdir(parents=True, exist_ok=True)
    resolved = json.dumps(config.to_dict(), indent=2)
    (output.dir / RESOLVED_CONFIG_FILE).write_text(resolved + "\n")
    output.sync(RESOLVED_CONFIG_FILE)
    print(config_line(config, env, f"{output.location.rstrip('/')}/{RESOLVED_CONFIG_FILE}"),
          flush=True)


def config_line(config: TrainConfig, env: DistEnv, saved_at: str) -> str:
    """What the run trains, in one line; every field is in the file `saved_at`."""
    options = [config.strategy, config.mixed_precision]
    if config.activation_checkpointing != "none":
        options.append(f"{config.activation_checkpointing} activation checkpointing")
    if config.lora_rank:
        options.append(f"LoRA rank {config.lora_rank}")
    if config.quantize_base != "none":
        options.append(f"{config.quantize_base} base")
    if config.tp_degree > 1:
        options.append(f"tp {config.tp_degree}")
    options += [name for name in ("compile", "float8", "cpu_offload", "packing")
                if getattr(config, name)]
    steps = f"{config.max_steps} steps" if config.max_steps else f"{config.epochs:g} epochs"
    return (f"world size {env.world_size} on {env.device.type}: {config.model}, "
            f"{', '.join(options)}; {config.micro_batch} x {config.seq_len} tokens x "
            f"{config.grad_accum} accum per process, lr {config.lr:g}, {steps}; "
            f"config in {saved_at}")


def print_data(splits: Splits, max_steps: int) -> None:
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(splits.skipped.items()))
    sources = ", ".join(f"{s['name']} {s['share']:.1%} ({s['train_examples']} examples, "
                        f"{s['eval_examples']} held out)"
                        for s in splits.stats.get("sources") or [])
    print(
        f"data: {len(splits.train)} train rows, {len(splits.eval)} eval rows, skipped "
        f"{splits.skipped_rows} bad rows{f' ({reasons})' if reasons else ''}; "
        f"{max_steps} steps" + (f"; mixture: {sources}" if sources else ""),
        flush=True,
    )


def warmup_cosine(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """LR multiplier for step i (0-based): linear warm-up, then cosine decay to min_lr_ratio."""

    def multiplier(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        progress = min(1.0, (i - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def token_loss_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross entropy of every labelled next-token prediction in the batch."""
    loss_sum = getattr(model, LOSS_METHOD)  # the chunked head + loss of trainer.loss
    return loss_sum(batch.labels, IGNORE_INDEX,
                    **batch.model_inputs(varlen=runs_varlen(model)))


def train_step(
    model: torch.nn.Module,
    micro_batches: list[Batch],
    env: DistEnv,
    scaler: torch.amp.GradScaler | None = None,
    waits: list[float] | None = None,
) -> tuple[float, int]:
    """Forward and backward over the micro batches; returns (mean loss per token, global tokens).

    The loss is normalised by the labelled tokens of the whole global batch, so every token weighs
    the same whatever its micro batch or rank; FSDP averages gradients over ranks, hence the
    factor world_size. `waits` gets the seconds this rank waited in the first collective.
    """
    counts = torch.tensor(
        [
            sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches),
            sum(b.num_tokens for b in micro_batches),
        ],
        dtype=torch.float64,
        device=env.device,
    )
    waited = time.perf_counter()
    dist.all_reduce(counts)
    if waits is not None:
        waits.append(time.perf_counter() - waited)
    labelled_tokens, tokens = counts.tolist()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    for batch in micro_batches:
        with compute_weights(model):
            loss = token_loss_sum(model, batch.to(env.device, varlen=runs_varlen(model)))
            scaled = loss * env.world_size / labelled_tokens
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    return loss_sum.item() / labelled_tokens, int(tokens)


def gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """`values` of every rank, by rank (one small all_gather)."""
    mine = torch.tensor(values, dtype=torch.float64, device=env.device)
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> float:
    """Mean loss per labelled token over the whole eval split, all ranks together."""
    loss, tokens = eval_sums(model, batches, device)
    return (loss / tokens).item()


@torch.no_grad()
def eval_sums(model: torch.nn.Module, batches: Iterable[Batch],
              device: torch.device) -> torch.Tensor:
    """(summed loss, labelled tokens) over the batches, all ranks together."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with compute_weights(model):
        for batch in batches:
            batch = batch.to(device, varlen=runs_varlen(model))
            totals[0] += token_loss_sum(model, batch)
            totals[1] += (batch.labels[:, 1:] != IGNORE_INDEX).sum()
    dist.all_reduce(totals)
    model.train()
    return totals


if __name__ == "__main__":
    main()
