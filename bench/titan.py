"""torchtitan as a peer of bench.train: its Llama 3 model, sdpa, compile, AC and loss.

`python -m bench.train --peers titan` runs it in a child process (as the Liger peer runs), on
the bench's shapes, tokens and hyper-parameters. torchtitan 0.2.2: the newest release that runs
on torch 2.11 (0.3.0 imports `DataParallelMeshDims` from `torch.distributed.fsdp`, which torch
2.11 lacks: seen on the H200, 2026-12-03). What runs is torchtitan's own: its llama3
`Transformer` (sdpa, causal) at the bench's shape, `parallelize_llama` (its activation
checkpointing and per-block torch.compile; on one GPU it applies no FSDP, and its trainer's
`maybe_enable_amp` gives bf16 autocast over fp32 weights, the bench's numerics), its
`init_weights`, its cross-entropy (sum over tokens / the step's valid tokens, compiled with the
model), `build_optimizers` (AdamW, fused) and `clip_grad_norm_`. The step is its Trainer's
`train_step` on one device without the data loader, metrics or checkpointing around it.
torchtitan's llama3 never ties the output head to the embedding; the 1B and 3B shapes (Llama
3.2) tie it, so the adapter ties the embedding to the head after torchtitan's init, and the
parameter count is checked equal to ours.

Only the pure parts (which shape, which checkpointing, what it refuses) run without torchtitan
installed; `titan_step_runner` imports it.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import torch

# The bench's built-in Llama shapes as torchtitan's TransformerModelArgs (its FFN width rule:
# multiple_of rounding of 2/3 * 4 * dim * ffn_dim_multiplier gives Llama's 8192, 8192 and 14336),
# and whether Llama ties the head to the embedding (1B, 3B).
TITAN_SHAPES = {
    "llama-1b": (dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                      multiple_of=256, rope_theta=500000), True),
    "llama-3b": (dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                      multiple_of=256, rope_theta=500000), True),
    "llama-8b": (dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                      multiple_of=1024, rope_theta=500000), False),
}
IGNORE_INDEX = -100  # torchtitan's, and Hugging Face's


def titan_problem(name: str, args: argparse.Namespace) -> str | None:
    """Why torchtitan cannot run this bench row as a peer of the same settings, else None."""
    if name not in TITAN_SHAPES:
        return f"the torchtitan peer runs the Llama shapes {', '.join(TITAN_SHAPES)}, not {name}"
    unsupported = [flag for flag, on in (
        ("--lora-rank", args.lora_rank), ("--quantize-base", args.quantize_base != "none"),
        ("--float8", args.float8), ("--tp-degree", args.tp_degree > 1)) if on]
    if unsupported:
        return (f"the torchtitan peer compares full bf16 fine-tuning only; "
                f"{', '.join(unsupported)} not supported")
    return None


def titan_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The next token of each position; the last has none (IGNORE_INDEX): the same seq_len - 1
    labelled tokens a row as the bench's other runs."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def titan_step_runner(
    name: str, args: argparse.Namespace, device: torch.device
) -> tuple[Callable[[torch.Tensor], float], dict[str, Any]]:
    """torchtitan's model, parallelism, loss and optimizer for `name`: a step function taking
    (grad_accum, micro_batch, seq_len) token ids and returning the step's mean loss, and the
    run's options (versions, settings) for its JSON line."""
    from importlib.metadata import version

    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    shape, tied = TITAN_SHAPES[name]
    job = JobConfig()
    job.training.seq_len = args.seq_len
    job.training.local_batch_size = args.micro_batch
    job.training.mixed_precision_param = "bfloat16"
    job.training.max_norm = 1.0
    job.compile.enable = args.compile  # its default components: model and loss
    job.activation_checkpoint.mode = args.ac  # the same recomputation both sides
    if args.ac == "selective":
        job.activation_checkpoint.selective_ac_option = str(args.selective_ac)
    # The bench's hyper-parameters (lr 1e-5, no weight decay), torchtitan's betas and eps.
    job.optimizer.lr = 1e-5
    job.optimizer.weight_decay = 0.0
    job.optimizer.implementation = "fused"
    model_args = TransformerModelArgs(**shape, vocab_size=128256, max_seq_len=args.seq_len)
    model_args.update_from_config(job)
    if not torch.distributed.is_initialized():  # one rank, in memory, as its launcher's torchrun
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=torch.distributed.HashStore(),
            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                 world_size=1)
    with torch.device("meta"):
        model = Transformer(model_args)  # fp32 parameters: the masters
    with tempfile.TemporaryDirectory() as dump_folder:
        job.job.dump_folder = dump_folder
        model = parallelize_llama(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if tied:  # the head's init (std dim**-0.5) for both: its embedding's std 1 would blow up
        model.tok_embeddings.weight = model.output.weight  # the logits of a tied head
    model.train()
    loss_fn = build_cross_entropy_loss(job)
    optimizers = build_optimizers([model], job.optimizer, parallel_dims)
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param,
                                      device.type)
    params = list(model.parameters())

    def step(micro_batches: torch.Tensor) -> float:
        optimizers.zero_grad()
        labels = [titan_labels(ids) for ids in micro_batches]
        valid = sum((lab != IGNORE_INDEX).sum() for lab in labels)
        total = torch.zeros((), device=device)
        for input_ids, lab in zip(micro_batches, labels, strict=True):
            with amp:
                pred = model(input_ids)
                loss = loss_fn(pred, lab) / valid
            del pred
            loss.backward()
            total += loss.detach()
        dist_utils.clip_grad_norm_(params, job.training.max_norm, foreach=True)
        optimizers.step()
        return total.item()

    options = {
        "torchtitan": version("torchtitan"),
        "model": f"llama3 Transformer {name}" + (", head tied" if tied else ""),
        "attention": "sdpa (causal)",
        "fsdp": "none (one GPU: parallelize_llama applies none)",
        "mixed_precision": "bf16 autocast (maybe_enable_amp), fp32 weights",
        "ac": job.activation_checkpoint.mode,
        "compile": "per TransformerBlock + loss" if args.compile else False,
        "loss": "cross_entropy_loss (sum / valid tokens)",
        "optimizer": "AdamW fused",
        "params": sum(p.numel() for p in params),
    }
    return step, options
