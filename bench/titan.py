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

With `--float8` it is torchtitan's own float8, as its Trainer applies it: the model converter
`quantize.linear.float8` (`build_model_converters(job, parallel_dims).convert(model)` on the meta
model, before `parallelize_llama`) and the converters' `post_optimizer_hook` after each optimizer
step (its precomputed scales for FSDP's float8 all-gather: off on one GPU, as ours). The recipe
is ours (`--float8-recipe`): tensorwise is its default path (no `recipe_name`; the all-gather
and precompute flags its docs advise, inactive without FSDP), rowwise its `recipe_name`
"rowwise" (which also sets inductor's `emulate_precision_casts`). `filter_fqns = ["output"]`
keeps the head in bf16, as ours does; torchao's 16-divisibility filter is its own. The run
checks that it converted what ours converts, the 7 Linears of each block and nothing else, and
that torchao's Float8LinearConfig is the one ours builds for that recipe on one GPU.

Only the pure parts (which shape, which checkpointing, what it refuses) run without torchtitan
installed; `titan_step_runner` and `titan_float8` import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from trainer.float8 import emulated, float8_config

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
# torchtitan's float8 model converter (its `model.converters` name), and the Linears of a
# llama3 TransformerBlock: attention wq, wk, wv, wo and feed_forward w1, w2, w3.
TITAN_FLOAT8 = "quantize.linear.float8"
BLOCK_LINEARS = 7


def titan_problem(name: str, args: argparse.Namespace) -> str | None:
    """Why torchtitan cannot run this bench row as a peer of the same settings, else None."""
    if name not in TITAN_SHAPES:
        return f"the torchtitan peer runs the Llama shapes {', '.join(TITAN_SHAPES)}, not {name}"
    unsupported = [flag for flag, on in (
        ("--lora-rank", args.lora_rank), ("--quantize-base", args.quantize_base != "none"),
        ("--tp-degree", args.tp_degree > 1)) if on]
    if unsupported:
        return (f"the torchtitan peer compares full fine-tuning (bf16, or float8 blocks) on one "
                f"GPU only; {', '.join(unsupported)} not supported")
    return None


def titan_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The next token of each position; the last has none (IGNORE_INDEX): the same seq_len - 1
    labelled tokens a row as the bench's other runs."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def titan_float8_settings(job: Any, recipe: str) -> None:
    """torchtitan's float8 settings (its job config's `model.converters` and
    `quantize.linear.float8`) for our `recipe`, the head left out as ours leaves it."""
    job.model.converters = [TITAN_FLOAT8]
    settings = job.quantize.linear.float8
    settings.filter_fqns = ["output"]  # substring match: no block Linear's name holds it
    settings.emulate = emulated()  # tests only (TRAINER_FLOAT8_EMULATE), as ours
    if recipe == "rowwise":
        settings.recipe_name = "rowwise"
    else:  # its tensorwise path; both flags take effect only under FSDP (dp_shard > 1)
        settings.recipe_name = None
        settings.enable_fsdp_float8_all_gather = True
        settings.precompute_float8_dynamic_scale_for_fsdp = True


def titan_float8(
    model: torch.nn.Module, job: Any, parallel_dims: Any, recipe: str
) -> tuple[Any, dict[str, Any]]:
    """torchtitan's float8 converter applied to its (meta) llama3 `model` as its Trainer applies
    it; the converters (for their post_optimizer_hook) and what ran, for the options. Raises
    unless it converted exactly the block Linears (what ours converts) with ours' torchao
    config for `recipe`."""
    from torchtitan.protocols.model_converter import build_model_converters

    titan_float8_settings(job, recipe)
    converters = build_model_converters(job, parallel_dims)
    converters.convert(model)
    converted = [fqn for fqn, module in model.named_modules()
                 if type(module).__name__ == "Float8Linear"]
    expected = BLOCK_LINEARS * len(model.layers)
    outside = [fqn for fqn in converted if not fqn.startswith("layers.")]
    if len(converted) != expected or outside:
        raise ValueError(f"torchtitan's float8 converted {len(converted)} Linears "
                         f"({', '.join(outside) or 'all in the blocks'} outside the blocks); "
                         f"ours converts the {expected} block Linears only")
    (converter,) = converters.converters
    ours = float8_config(recipe, sharded=False)  # one GPU: ours does not shard either
    if dataclasses.replace(converter.config, emulate=False) != dataclasses.replace(
            ours, emulate=False):
        raise ValueError(f"torchtitan's float8 config for {recipe} is not ours: "
                         f"{converter.config} != {ours}")
    settings = job.quantize.linear.float8
    options = {
        "float8_converter": f"{TITAN_FLOAT8} (build_model_converters, before parallelize_llama)",
        "float8_recipe_name": settings.recipe_name,  # None: its tensorwise path
        "float8_filter_fqns": list(settings.filter_fqns),
        "float8_linears": len(converted),
        "float8_converted": f"block Linears (attention wq wk wv wo, feed_forward w1 w2 w3) x "
                            f"{len(model.layers)} blocks; tok_embeddings and output not float8",
        "float8_same_linears_as_ours": True,  # checked above: 7 a block, none outside
        "float8_config_as_ours": True,  # checked above: torchao's Float8LinearConfig equal
        "float8_fsdp_all_gather": converter.config.enable_fsdp_float8_all_gather,
        "float8_post_optimizer_hook": "precompute scales" if converter.precompute_scale
        else "no-op (no FSDP float8 all-gather)",
    }
    return converters, options


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
    # Its Trainer converts the meta model before parallelizing it (checkpointing, compile).
    converters, float8_options = (titan_float8(model, job, parallel_dims, args.float8_recipe)
                                  if args.float8 else (None, {}))
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
    if converters is not None:  # as its Trainer: the converters' hook after each optimizer step
        model_parts = [model]
        optimizers.register_step_post_hook(
            lambda *_args, **_kwargs: converters.post_optimizer_hook(model_parts))
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
        "float8": args.float8,
        "float8_recipe": args.float8_recipe if args.float8 else None,
        **float8_options,
        "loss": "cross_entropy_loss (sum / valid tokens)",
        "optimizer": "AdamW fused",
        "params": sum(p.numel() for p in params),
    }
    return step, options
