"""torchtitan as a peer of trainer.bench: its Llama 3, flex attention, FSDP2, compile and loss.

`python -m trainer.bench --peers titan` runs it in a child process (as the Liger peer runs), on
the bench's shapes, tokens and hyper-parameters. What runs is torchtitan's own: `model_registry`'s
Llama 3 flavor with `attn_backend="flex"` (its language models take no sdpa), `parallelize_llama`
(its activation checkpointing, per-block torch.compile, and `fully_shard` with its
MixedPrecisionPolicy: bf16 parameters, fp32 reduction, fp32 masters) on a one-rank FSDP mesh, its
`init_weights`, its ChunkedLossWrapper over CrossEntropyLoss (sum over tokens / the step's valid
tokens), its AdamW container (fused) and its `clip_grad_norm_`. The step is its Trainer's
`train_step` without the data loader, metrics or checkpointing around it: per micro-batch the
positions (one document a row, as its data loaders emit them), the block mask from
`get_attention_masks`, forward without the head, the chunked loss and backward; then clip and step.
Its Trainer also wraps that forward-backward in a CUDA graph by default; this adapter does not.

Only the pure parts (which flavor, which checkpointing, what it refuses) run without torchtitan
installed; `titan_step_runner` imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import torch

# The bench's built-in Llama shapes and torchtitan's llama3 flavors of the same shapes (vocab
# 128256, the same FFN widths; 1B and 3B tie the embedding, 8B and 70B do not).
TITAN_FLAVORS = {"llama-1b": "1B", "llama-3b": "3B", "llama-8b": "8B", "llama-70b": "70B"}
IGNORE_INDEX = -100  # torchtitan's, and Hugging Face's


def titan_problem(name: str, args: argparse.Namespace) -> str | None:
    """Why torchtitan cannot run this bench row as a peer of the same settings, else None."""
    if name not in TITAN_FLAVORS:
        return (f"torchtitan's llama3 has no flavor of {name}; it runs "
                + ", ".join(TITAN_FLAVORS))
    unsupported = [flag for flag, on in (
        ("--lora-rank", args.lora_rank), ("--quantize-base", args.quantize_base != "none"),
        ("--float8", args.float8), ("--tp-degree", args.tp_degree > 1)) if on]
    if unsupported:
        return (f"the torchtitan peer compares full bf16 fine-tuning only; "
                f"{', '.join(unsupported)} not supported")
    return None


def titan_activation_checkpointing(ac: str) -> str | None:
    """torchtitan's checkpointing class for the bench's --ac: the same recomputation both sides."""
    return {"none": None, "full": "FullAC", "selective": "SelectiveAC"}[ac]


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

    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import activation_checkpoint as titan_ac
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.parallelize import parallelize_llama

    flavor = TITAN_FLAVORS[name]
    spec = model_registry(flavor, attn_backend="flex")
    model_config = spec.model
    # What its Trainer's update_from_config does for one GPU: RoPE cached for the run's length.
    for layer in model_config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope,
                                                   max_seq_len=args.seq_len)
    # partial_dtensor: the FSDP2 path of DTensor parameters; with no TP or CP the spmd_types
    # default applies the same fully_shard.
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    training = TrainingConfig(local_batch_size=args.micro_batch, seq_len=args.seq_len,
                              mixed_precision_param="bfloat16",
                              mixed_precision_reduce="float32", max_norm=1.0)
    compile_config = CompileConfig(enable=args.compile, components=["model", "loss"])
    ac_class = titan_activation_checkpointing(args.ac)
    ac_config = getattr(titan_ac, ac_class).Config() if ac_class else None
    # Its mesh needs a process group (its Trainer's torchrun makes one): one rank, in memory.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=torch.distributed.HashStore(),
            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1,
                                 world_size=1, spmd_backend=parallelism.spmd_backend)
    with torch.device("meta"):
        model = model_config.build()  # fp32 parameters: the masters
    with tempfile.TemporaryDirectory() as dump_folder:
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=training,
                                  parallelism=parallelism, compile_config=compile_config,
                                  ac_config=ac_config, dump_folder=dump_folder)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size)
    ).build(compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    # The bench's hyper-parameters (lr 1e-5, no weight decay), torchtitan's betas and fused AdamW.
    optimizers = default_adamw(lr=1e-5, weight_decay=0.0).build(model_parts=[model])
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    params = [p for p in model.parameters()]

    def step(micro_batches: torch.Tensor) -> float:
        optimizers.zero_grad()
        labels = [titan_labels(ids) for ids in micro_batches]
        valid = sum((lab != IGNORE_INDEX).sum() for lab in labels)
        total = torch.zeros((), device=device)
        for input_ids, lab in zip(micro_batches, labels, strict=True):
            positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
            with train_context():
                masks = model.get_attention_masks(positions=positions)
                pred = model(input_ids, positions=positions, attention_masks=masks)
                loss, _ = loss_fn(pred, lab, valid, positions=positions)
                del pred
                loss.backward()
            total += loss.detach()
        dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True)
        optimizers.step()
        return total.item()

    options = {
        "torchtitan": version("torchtitan"),
        "flavor": f"llama3 {flavor}",
        "attention": "flex",
        "fsdp": "fully_shard, one-rank mesh, reshard_after_forward policy default",
        "mixed_precision": "MixedPrecisionPolicy bf16 params, fp32 reduce (fp32 master)",
        "ac": ac_class or "none",
        "compile": "per TransformerBlock + loss" if args.compile else False,
        "loss": "ChunkedLossWrapper(CrossEntropyLoss), 8 chunks",
        "optimizer": "AdamW fused",
        "cuda_graph": False,
        "params": sum(p.numel() for p in params),
    }
    return step, options

