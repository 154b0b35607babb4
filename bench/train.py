"""Throughput: this trainer against Hugging Face Trainer, same model, batch and data.

python -m bench.train --models 1b,3b --micro-batch 4 --compile
python -m bench.train --models 8b --micro-batch 2 --compile --ac full --strategy FULL_SHARD
python -m bench.train --models 3b --micro-batch 4 --compile --float8 --no-hf   # H100/H200
python -m bench.train --models 3b --micro-batch 4 --compile --float8 --peers titan --no-hf
torchrun --nproc-per-node 8 -m bench.train --models 8b --no-hf --strategy HYBRID_SHARD ...

Under torchrun (several GPUs) only this trainer runs; tokens/s, TFLOPs and MFU are per GPU and
rank 0 prints them, so the scaling efficiency is tokens/s at N GPUs over tokens/s at one.

Each model is built from its config (random init) and trained on random tokens, first through the
trainer's own path (meta init, apply_parallelism, chunked loss, fused AdamW; bf16 compute on fp32
master weights, fp32 gradient reduction; one GPU with SHARD_GRAD_OP runs without FSDP on bf16
copies of the masters, trainer/master_weights.py), then by Hugging Face Trainer (bf16=True
autocast on fp32 weights, adamw_torch_fused, sdpa). One JSON line per run, and one with the ratio
of tokens/s.
Steps are timed between device synchronisations; the first `--warmup` steps (compilation,
allocator growth) are not timed. Imports neither trainer.data nor `datasets`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from bench import gaps, memory_peak
from bench.family_shapes import FAMILY_SHAPES
from bench.titan import titan_problem, titan_step_runner
from bench.unsloth import unsloth_problem
from finetune_contract.data import IGNORE_INDEX
from finetune_contract.fields import ATTENTION, LORA_TARGET_MODULES, QUANTIZE_BASE
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.rules import lora_module_names, loss_chunk_tokens
from finetune_contract.throughput import flops_per_token, mfu
from trainer.attention import runs_varlen
from trainer.batch import Batch, packed_documents
from trainer.config import TrainConfig
from trainer.float8 import precompute_float8_scales
from trainer.lora import apply_lora, fuse_adapter_adds
from trainer.loss import LOSS_METHOD, add_loss_method
from trainer.master_weights import ATTRIBUTE as MASTER_WEIGHTS
from trainer.master_weights import GradIntoLinear, compute_weights
from trainer.metrics import peak_flops
from trainer.model import (
    build_model,
    builtin_config,
    materialize_weights,
    model_on_meta,
    stretch_positions,
)
from trainer.optim import build_optimizer, optimizer_step
from trainer.parallel import (
    DistEnv,
    apply_parallelism,
    check_start,
    init_distributed,
    quantize_dtype,
)
from trainer.qlora import nf4_bytes

# The peers beside ours: Hugging Face Trainer, Trainer with Liger's kernels, torchtitan
# (bench/titan.py) and Unsloth (bench/unsloth.py); each with the "run" name of its JSON line.
PEERS = {"hf": "hf_trainer", "liger": "hf_liger", "titan": "titan", "unsloth": "unsloth"}
# What a peer's child process runs before anything of the project: Unsloth patches transformers
# when imported, so it must come before the trainer package (which imports transformers.utils).
PEER_PRELUDES = {"unsloth": "import os; os.environ.setdefault('HF_HUB_OFFLINE', '1'); "
                            "import unsloth"}
SHORT_NAMES = {"1b": "llama-1b", "3b": "llama-3b", "8b": "llama-8b", "70b": "llama-70b",
               "tiny": "tiny-llama"}
GIB = 1024**3
RERUNS = 20  # --attention-check: each backward again on the same inputs, for its spread
DETERMINISTIC_RUNS = 3  # and fa4's deterministic backward, which must repeat to the bit


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.train", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1b,3b,8b",
                        help="comma-separated: 1b, 3b, 8b, tiny, a family shape, or a directory "
                        "with a config.json (random weights of that config)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro batches per optimizer step (both trainers)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    # float8 runs print tokens/s; TFLOPs and MFU are left out (their peak is the bf16 one).
    parser.add_argument("--mixed-precision", default="bf16", choices=["bf16", "fp32"],
                        help="ours: fp32 trains without bf16 copies (a reference for losses)")
    parser.add_argument("--float8", action="store_true", help="torchao float8 in the blocks")
    parser.add_argument("--float8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="LoRA adapters on every block Linear (peft on both sides)")
    parser.add_argument("--lora-forward", default="fused", choices=["fused", "peft"],
                        help="ours: peft's own LoRA forward instead of the fused add (an A/B)")
    parser.add_argument("--quantize-base", default="none", choices=QUANTIZE_BASE,
                        help="nf4: QLoRA (ours: torchao NF4; HF: bitsandbytes 4-bit NF4)")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--selective-ac", default="op", help="op, or k: every k-th block")
    parser.add_argument("--activation-offload", action="store_true",
                        help="saved activations in CPU memory (with --ac full: each block's "
                             "input, the MLP tiled; trainer/offload.py)")
    # One GPU: resharding after forward saves memory (8B needs it) but gathers again in backward.
    parser.add_argument("--strategy", default="SHARD_GRAD_OP", help="FULL_SHARD for 8B")
    parser.add_argument("--shard-group-size", type=int, default=0, help="HYBRID_SHARD group")
    parser.add_argument("--tp-degree", type=int, default=1,
                        help="tensor (and sequence) parallel degree, under torchrun")
    parser.add_argument("--attention", default="sdpa",
                        help="ours: comma-separated ATTENTION values, one run each (sdpa, fa4)")
    parser.add_argument("--attention-check", action="store_true",
                        help="first: fa4's kernels against cuDNN's (error, TFLOP/s) at the "
                        "models' head shapes")
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-hf: no Hugging Face Trainer (the other --peers still run)")
    parser.add_argument("--peers", default="hf",
                        help="comma-separated: hf (Trainer), liger (Trainer + Liger kernels), "
                        "titan (torchtitan), unsloth (LoRA and QLoRA: FastLanguageModel)")
    parser.add_argument("--peer-worker", default="", choices=["", *PEERS],
                        help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true",
                        help="print a profile of each run's steps, untimed: two more of ours and "
                        "torchtitan's, one more of a Trainer peer's")
    parser.add_argument("--memory-peak", action="store_true",
                        help="CUDA: print what was allocated at our run's peak, by where "
                             "(bench/memory_peak.py)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokens", choices=["random", "demo"], default="random",
                        help="demo: the demo instructions, and every step's loss in the line")
    parser.add_argument("--packing", action="store_true",
                        help="ours: rows packed from documents whose positions restart (demo: "
                        "each instruction; random: lengths drawn between DOCUMENT_TOKENS), no "
                        "loss across their bounds; sdpa masks them, fa4 runs its varlen kernel")
    args = parser.parse_args(argv)
    args.models = [SHORT_NAMES.get(m, m) for m in args.models.split(",") if m]
    unknown = [m for m in args.models
               if m not in BUILTIN_MODELS and m not in FAMILY_SHAPES and not is_config_dir(m)]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from "
                     f"{', '.join([*SHORT_NAMES, *FAMILY_SHAPES])}, or a directory holding a "
                     "config.json")
    args.attention = [a for a in args.attention.split(",") if a]
    bad = [a for a in args.attention if a not in ATTENTION]
    if bad:
        parser.error(f"unknown --attention {', '.join(bad)}; choose from {', '.join(ATTENTION)}")
    args.peers = [p for p in args.peers.split(",") if p and (args.hf or p != "hf")]
    bad = [p for p in args.peers if p not in PEERS]
    if bad:
        parser.error(f"unknown --peers {', '.join(bad)}; choose from {', '.join(PEERS)}")
    if args.lora_forward != parser.get_default("lora_forward") and not args.lora_rank:
        parser.error("--lora-forward chooses LoRA's forward: pass --lora-rank too")
    for ours_only in ("packing", "mixed_precision", "lora_forward"):
        if args.peers and getattr(args, ours_only) != parser.get_default(ours_only):
            parser.error(f"--{ours_only.replace('_', '-')} runs ours only: pass --no-hf "
                         "--peers ''")
    return args


def is_config_dir(name: str) -> bool:
    return (Path(name) / "config.json").is_file()


def bench_batches(vocab: int, args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """(warmup + steps, grad_accum, micro_batch, seq_len) token ids, the same for every trainer:
    random (`--tokens random`), or the demo instructions (`--tokens demo`: trainer/demo's rows
    tokenized by its tokenizer, shuffled by the seed, packed end to end and repeated as needed),
    for a loss that learns something (float8 against bf16)."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.warmup + args.steps, args.grad_accum, args.micro_batch, args.seq_len)
    if args.tokens == "random":
        return torch.randint(0, vocab, shape, generator=generator).to(device)
    documents = demo_documents(vocab, args.seed)
    ids = [token for document in documents for token in document]
    needed = torch.Size(shape).numel()
    stream = torch.tensor(ids).repeat(-(-needed // len(ids)))[:needed]
    return stream.view(shape).to(device)


def demo_documents(vocab: int, seed: int) -> list[list[int]]:
    """The demo instructions' token ids, one list per row, in the seed's order."""
    from tokenizers import Tokenizer

    from trainer.demo import DEMO_DATASET, DEMO_TOKENIZER

    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    if tokenizer.get_vocab_size() > vocab:
        raise ValueError(f"--tokens demo: the demo tokenizer's {tokenizer.get_vocab_size()} ids "
                         f"exceed the model's vocabulary of {vocab}")
    rows = [json.loads(line) for line in DEMO_DATASET.read_text().splitlines() if line]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [encoding.ids for encoding in tokenizer.encode_batch(
        [f"{rows[i]['prompt']}\n{rows[i]['response']}" for i in order])]


# --packing --tokens random: each document's length, drawn uniformly between these (tokens).
DOCUMENT_TOKENS = (128, 2048)


def bench_positions(vocab: int, args: argparse.Namespace, device: torch.device
                    ) -> torch.Tensor | None:
    """--packing: position ids for bench_batches' tokens (its shape), restarting at 0 where a
    document starts. demo: each instruction is a document, as bench_batches joins them; random:
    lengths drawn from DOCUMENT_TOKENS. Rows are full: a document cut by a row's end goes on in
    the next row from position 0 (the data pipeline's `pack` splits none and pads the row's end
    instead, prepared_set.py; here every token is a document's, as bench_batches fills rows).
    None without --packing."""
    if not args.packing:
        return None
    shape = (args.warmup + args.steps, args.grad_accum, args.micro_batch, args.seq_len)
    needed = torch.Size(shape).numel()
    if args.tokens == "demo":
        lengths = [len(document) for document in demo_documents(vocab, args.seed)]
    else:
        generator = torch.Generator().manual_seed(args.seed + 1)
        lengths = torch.randint(DOCUMENT_TOKENS[0], DOCUMENT_TOKENS[1] + 1,
                                (needed // DOCUMENT_TOKENS[0] + 1,), generator=generator).tolist()
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    starts = starts.repeat(-(-needed // len(starts)))[:needed].view(-1, args.seq_len)
    starts[:, 0] = True
    return document_positions(starts).view(shape).to(device)


def attended_keys(positions: torch.Tensor) -> float:
    """The keys per query that the FLOP count takes for packed rows (seq_len unpacked: the whole
    score matrix, as families.attended_length counts it): sum of L^2 over sum of L, for the
    documents' lengths L."""
    lengths = torch.diff(packed_documents(positions)["cu_seq_lens_q"]).double()
    return float((lengths**2).sum() / lengths.sum())


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document, from where documents start (bool, rows x seq)."""
    index = torch.arange(starts.shape[-1]).expand_as(starts)
    return index - torch.where(starts, index, 0).cummax(-1).values


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled graphs hold on to their inputs' metadata and pools
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def result(
    run: str,
    model: str,
    options: dict[str, Any],
    args: argparse.Namespace,
    model_config: PretrainedConfig,
    step_times: list[float],
    losses: list[float],
    device: torch.device,
    peak: float | None,
    adapter_params: int | None = None,
) -> dict[str, Any]:
    """The JSON line of a run: throughput from the median timed step."""
    timed = step_times[args.warmup :]
    median = statistics.median(timed)
    # The ranks of a tensor-parallel group work on the same tokens: per GPU, a tp-th of them.
    tokens_per_step = args.grad_accum * args.micro_batch * args.seq_len
    tokens_per_s = tokens_per_step / median / options.get("tp_degree", 1)
    # Packed rows: each token attends only its document's keys (attended_keys).
    keys = options.get("attended_keys") or args.seq_len
    tflops = flops_per_token(model_config, keys, adapter_params) * tokens_per_s / 1e12
    float8 = bool(options.get("float8"))
    return {
        "run": run,
        "model": model,
        "options": options,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "seq_len": args.seq_len,
        "steps_timed": len(timed),
        "step_time_s": _rounded(median),
        "step_time_mean_s": _rounded(statistics.fmean(timed)),
        "tokens_per_s": _rounded(tokens_per_s),
        "tflops_per_gpu": None if float8 else _rounded(tflops),
        # fp32 against the dense bf16 peak would be no utilisation
        "mfu": None if float8 or options.get("mixed_precision") == "fp32"
        else _rounded(mfu(tflops, peak)),
        "peak_memory_gib": _rounded(peak_memory_gib(device)),
        "loss_first": _loss(losses[0]),
        "loss_last": _loss(losses[-1]),
        **({"losses": [_loss(loss) for loss in losses]} if args.tokens == "demo" else {}),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def _loss(value: float) -> float:
    """Six significant digits: two runs' curves are compared step by step, and they can part by
    less than four digits would show (docs/trainer.md, packed rows with FA4)."""
    return float(f"{value:.6g}")


def _rounded(value: float | None) -> float | None:
    """Four significant digits: enough for a table, whatever the scale (CPU or H200)."""
    return None if value is None else float(f"{value:.4g}")


def bench_config(name: str) -> PretrainedConfig:
    """A built-in model's LlamaConfig, a family shape's config (FAMILY_SHAPES), or a directory's
    config.json."""
    if name in BUILTIN_MODELS:
        return builtin_config(name)
    if name not in FAMILY_SHAPES:
        return AutoConfig.from_pretrained(name)
    class_name, kwargs = FAMILY_SHAPES[name]
    config = getattr(transformers, class_name)(**kwargs)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    return config


def build_bench_model(name: str, attention: str, seq_len: int | None = None) -> torch.nn.Module:
    """The model on the meta device, as trainer.model.build_model builds it (its attention:
    eager where the family soft-caps the scores; positions stretched to seq_len)."""
    if name in BUILTIN_MODELS:
        return build_model(name, attention=attention, seq_len=seq_len)
    config = bench_config(name)
    if seq_len is not None:
        stretch_positions(config, seq_len)
    return model_on_meta(config, attention)


def materialize_bench_model(model: torch.nn.Module, name: str, config: TrainConfig,
                            device: torch.device) -> None:
    """Seeded random weights: a family shape or config directory has no checkpoint, so
    trainer.model's random init (the built-in models' path, QLoRA's NF4 included) fills it too."""
    materialize_weights(model, name, config.seed, device, quantize_dtype(config),
                        random_init=True)


def run_trainer(
    name: str, args: argparse.Namespace, env: DistEnv, peak: float | None,
    attention: str = "sdpa",
) -> dict[str, Any]:
    """This trainer's step (as train.py runs it) on random tokens."""
    config = TrainConfig(
        model=name,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        lr=1e-5,
        seed=args.seed,
        strategy=args.strategy,
        shard_group_size=args.shard_group_size,
        mixed_precision=args.mixed_precision,
        activation_checkpointing=args.ac,
        activation_offload=args.activation_offload,
        selective_ac=args.selective_ac if args.ac == "selective" else "op",
        compile=args.compile,
        float8=args.float8,
        float8_recipe=args.float8_recipe,
        tp_degree=args.tp_degree,
        lora_rank=args.lora_rank,
        quantize_base=args.quantize_base,
        attention=attention,
        packing=args.packing,  # the contract's rules on packed rows (apply_parallelism checks)
    )
    check_start(config, env)  # the trainer's rules (float8's GPU) before the model is built
    recording = args.memory_peak and env.device.type == "cuda"
    if recording:
        memory_peak.start()
    model = build_bench_model(name, attention, args.seq_len)
    model_config = model.config
    adapter_params = apply_lora(model, config) if args.lora_rank else None
    if args.lora_forward == "peft":  # the A/B of trainer/lora.py's fused adapter add
        fuse_adapter_adds(model, fused=False)
    apply_parallelism(model, config, env)
    materialize_bench_model(model, name, config, env.device)
    add_loss_method(model, loss_chunk_tokens(config, model_config.vocab_size))
    optimizer = build_optimizer(model, config, env.device)
    loss_sum: Callable[..., torch.Tensor] = getattr(model, LOSS_METHOD)
    batches = bench_batches(model_config.vocab_size, args, env.device)
    positions = bench_positions(model_config.vocab_size, args, torch.device("cpu"))
    varlen = runs_varlen(model)

    # No loss where a document starts (its first token's prediction would come from the
    # document before), as the data pipeline's pack labels them (prepared_set.py).
    labels = batches if positions is None else batches.masked_fill(
        (positions == 0).to(env.device), IGNORE_INDEX)

    def micro_batch(step: int, i: int) -> Batch:
        """As train.py moves it (trainer.train is not imported: it loads datasets)."""
        input_ids = batches[step, i]
        if positions is None:
            return Batch(input_ids, input_ids, input_ids.numel())
        return Batch(input_ids, labels[step, i], input_ids.numel(),
                     positions[step, i]).to(env.device, varlen=varlen)

    # Labelled predictions per step, counted on the host (no sync in the timed step).
    labelled = ([args.grad_accum * args.micro_batch * (args.seq_len - 1)] * len(batches)
                if positions is None else (positions[..., 1:] != 0).flatten(1).sum(1).tolist())

    def step(index: int) -> float:
        micro_batches = [micro_batch(index, i) for i in range(args.grad_accum)]
        total = torch.zeros((), device=env.device)
        for batch in micro_batches:  # as trainer.train's train_step accumulates
            with compute_weights(model):
                loss = loss_sum(batch.labels, IGNORE_INDEX,
                                **batch.model_inputs(varlen=varlen)) / labelled[index]
                loss.backward()
            total += loss.detach()
        optimizer_step(model, optimizer, config.max_grad_norm)
        if args.float8:
            precompute_float8_scales(model)
        optimizer.zero_grad(set_to_none=True)
        return total.item()

    step_times, losses = [], []
    for index in range(len(batches)):
        synchronize(env.device)
        start = time.perf_counter()
        losses.append(step(index))
        synchronize(env.device)
        step_times.append(time.perf_counter() - start)
    if recording:
        print(json.dumps({"run": "memory_peak", "model": name,
                          **memory_peak.summary(memory_peak.stop(), env.device.index or 0)}),
              flush=True)
    if args.profile:
        print_profile(lambda: step(len(batches) - 1), env.device)
    options = {
        "strategy": args.strategy,
        # One unsharded rank trains without FSDP (trainer/master_weights.py).
        "fsdp": isinstance(model, FSDPModule),
        "shard_group_size": args.shard_group_size or env.local_world_size,
        "gpus": env.world_size,
        "tp_degree": args.tp_degree,
        # One rank sums nothing: its bf16 gradient reduce is exact (trainer/parallel.py).
        "mixed_precision": "fp32" if args.mixed_precision == "fp32" else "bf16 (fp32 master, "
        + ("fp32 reduce)" if env.world_size > args.tp_degree else "no reduce)"),
        "ac": args.ac if args.ac != "selective" else f"selective:{args.selective_ac}",
        "activation_offload": args.activation_offload,
        "compile": args.compile,
        "float8": args.float8,
        "float8_recipe": args.float8_recipe if args.float8 else None,
        "lora_rank": args.lora_rank,
        "lora_forward": args.lora_forward if args.lora_rank else None,
        "quantize_base": args.quantize_base,
        "nf4_gib": _rounded(nf4_bytes(model) / GIB) if args.quantize_base != "none" else None,
        "loss": "chunked",
        # grad_accum > 1 at one rank: the block Linears' weight-gradient GEMMs accumulate in fp32
        "grad_into_gemm": any(isinstance(m, GradIntoLinear) for m in model.modules()),
        # float8 Linears cast their fp32 masters (trainer/master_weights.py), or bf16 copies
        "float8_from_masters": bool(getattr(getattr(model, MASTER_WEIGHTS, None), "kept", None)),
        "optimizer": "AdamW fused" if env.device.type == "cuda" else "AdamW",
        "attention": attention,
        "packing": args.packing,
        "attended_keys": None if positions is None else _rounded(attended_keys(positions)),
        "attn_implementation": model_config._attn_implementation,  # eager: soft-capped scores
    }
    return result(
        "trainer", name, options, args, model_config, step_times, losses, env.device, peak,
        adapter_params,
    )


def run_hf_trainer(
    name: str, args: argparse.Namespace, device: torch.device, peak: float | None,
    peer: str = "hf",
) -> dict[str, Any]:
    """Hugging Face Trainer on the same model, batches and hyper-parameters; `peer` "liger":
    its use_liger_kernel (Liger's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy);
    "unsloth": the model Unsloth's FastLanguageModel loads and patches
    (bench/unsloth.py)."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    liger = peer == "liger"
    model_config = bench_config(name)
    torch.manual_seed(args.seed)
    recipe: dict[str, Any] = {}  # what the peer's own recipe sets beyond these options
    if peer == "unsloth":
        from bench.unsloth import unsloth_model

        model, adapter_params, base_dir, recipe = unsloth_model(model_config, args, device,
                                                                release_memory)
    else:
        model, adapter_params, base_dir = hf_model(model_config, args, device)
    batches = bench_batches(model_config.vocab_size, args, torch.device("cpu"))
    rows = [{"input_ids": ids, "labels": ids} for ids in batches.flatten(0, 2)]
    step_times: list[float] = []
    losses: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            synchronize(device)
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            synchronize(device)
            step_times.append(time.perf_counter() - self.start)

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    class StepProfiler(TrainerCallback):  # --profile: one step after the timed ones
        profile: Any = None

        def on_step_begin(self, _: Any, state: Any, *__: Any, **___: Any) -> None:
            if state.global_step == state.max_steps - 1:
                self.profile = profiling(device, f"{PEERS[peer]}, one step")
                self.profile.__enter__()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.stop()

        def stop(self) -> None:
            if self.profile is not None:
                self.profile.__exit__(None, None, None)
                self.profile = None

    cuda = device.type == "cuda"
    profiler = StepProfiler()
    callbacks = [StepTimer(), *([profiler] if args.profile else [])]
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.grad_accum,
            max_steps=args.warmup + args.steps + (1 if args.profile else 0),
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            bf16=True,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            gradient_checkpointing=args.ac != "none",
            logging_steps=max(1, args.warmup + args.steps - 1),  # 2 logs: 2 syncs
            logging_first_step=True,
            save_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=args.seed,
            use_cpu=not cuda,
            use_liger_kernel=liger,
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=rows, callbacks=callbacks
        )
        trainer.remove_callback(PrinterCallback)  # its log dicts would break the JSON lines
        try:
            trainer.train()
        finally:  # a step that raised leaves no profiler running
            profiler.stop()
    if args.profile:
        step_times.pop()  # the profiled step, timed with the profiler's overhead
    if base_dir is not None:
        base_dir.cleanup()
    options = {
        "liger": _liger_version() if liger else None,
        "mixed_precision": "bf16 autocast (fp32 weights)",
        "gradient_checkpointing": args.ac != "none",
        "attention": model_config._attn_implementation,
        "optimizer": training_args.optim,
        "lora_rank": args.lora_rank,
        "quantize_base": "bitsandbytes nf4 (double quant, bf16 compute)"
        if args.quantize_base == "nf4" else "none",
        **recipe,
    }
    return result(
        PEERS[peer], name, options, args, model_config, step_times, losses, device, peak,
        adapter_params,
    )


def run_titan(
    name: str, args: argparse.Namespace, device: torch.device, peak: float | None
) -> dict[str, Any]:
    """torchtitan's Llama 3 on the same shape, tokens and hyper-parameters
    (bench/titan.py says what of torchtitan runs)."""
    problem = titan_problem(name, args)
    if problem:
        raise ValueError(problem)
    if device.type != "cuda":
        raise ValueError("the torchtitan peer is a GPU comparison (its fused AdamW, compile)")
    model_config = bench_config(name)
    with torch.device("meta"):
        ours_params = sum(p.numel() for p in build_model(name).parameters())
    torch.manual_seed(args.seed)
    step, options = titan_step_runner(name, args, device)
    if options["params"] != ours_params:  # the same shape, or the comparison means nothing
        raise ValueError(f"torchtitan's {options['model']} has {options['params']} parameters, "
                         f"{name} {ours_params}")
    batches = bench_batches(model_config.vocab_size, args, device)
    step_times, losses = [], []
    for micro_batches in batches:
        synchronize(device)
        start = time.perf_counter()
        losses.append(step(micro_batches))
        synchronize(device)
        step_times.append(time.perf_counter() - start)
    if args.profile:  # two more steps, untimed, as ours
        print_profile(lambda: step(batches[-1]), device, "torchtitan")
    return result("titan", name, options, args, model_config, step_times, losses, device, peak)


def _liger_version() -> str:
    from importlib.metadata import version

    return f"liger-kernel {version('liger-kernel')}"


def hf_model(
    model_config: PretrainedConfig, args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, int | None, tempfile.TemporaryDirectory | None]:
    """The model as Hugging Face users build it: fp32 weights; with --lora-rank peft's
    get_peft_model; with --quantize-base nf4 the QLoRA recipe (a checkpoint loaded with
    bitsandbytes' 4-bit NF4, prepare_model_for_kbit_training, then the adapters)."""
    if args.quantize_base == "none":
        with torch.device(device):  # fp32: bf16=True autocasts, as users run it
            model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        base_dir = None
    else:
        from peft import prepare_model_for_kbit_training
        from transformers import BitsAndBytesConfig

        base_dir = tempfile.TemporaryDirectory()  # bitsandbytes quantizes while loading
        with torch.device(device):
            AutoModelForCausalLM.from_config(model_config).to(torch.bfloat16).save_pretrained(
                base_dir.name)
        release_memory(device)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(
            base_dir.name, quantization_config=quantization, dtype=torch.bfloat16,
            device_map={"": device.index or 0}, attn_implementation="sdpa",
        )  # fmt: skip
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.ac != "none"
        )
    if not args.lora_rank:
        return model, None, base_dir
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(
        r=args.lora_rank, lora_alpha=16, target_modules=lora_module_names(LORA_TARGET_MODULES),
        bias="none", task_type="CAUSAL_LM"))  # fmt: skip
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, adapters, base_dir


def print_profile(step: Callable[[], float], device: torch.device,
                  who: str = "trainer") -> None:
    """The ops that take the most device time over two steps, as a table."""
    with profiling(device, f"{who}, two steps"):
        for _ in range(2):
            step()


@contextlib.contextmanager
def profiling(device: torch.device, title: str) -> Iterator[None]:
    """Profile what runs inside, then print the ops that took the most device time (CPU time on
    a CPU) as a table on stderr: the JSON lines on stdout stay whole."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
        synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"# profile: {title}\n"
          + prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70),
          file=sys.stderr, flush=True)
    if device.type == "cuda":  # the device's idle gaps and what the host did then
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / "trace.json"
            prof.export_chrome_trace(str(trace))
            print(f"# idle: {title}\n{gaps.summary(gaps.idle(gaps.load_trace(trace)))}",
                  file=sys.stderr, flush=True)


def guarded(run: Callable[[], dict[str, Any]], run_name: str, model: str) -> dict[str, Any]:
    """A run's result, or its error: a model that does not fit must not stop the others."""
    try:
        return run()
    except torch.OutOfMemoryError as error:
        return {"run": run_name, "model": model, "error": f"out of memory: {error}"[:300]}
    except Exception as error:  # a peer or shape that cannot run: its row says why
        return {"run": run_name, "model": model,
                "error": f"{type(error).__name__}: {error}"[:400]}


def attention_check(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """fa4's kernels (trainer/attention.py's ops) against sdpa (cuDNN on an H200) at each model's
    heads, micro-batch and sequence: relative error of out and of dq, dk, dv, and TFLOP/s of
    forward and backward (causal FLOPs: 2 matmuls of B x H x S^2 / 2 x D forward, 2.5x that
    backward), medians of 10 timed calls after 3."""
    rows = []
    for name in args.models:
        rows.append(_attention_row(name, args, device))
        release_memory(device)
        if args.packing:
            rows.append(_packed_attention_row(name, args, device))
            release_memory(device)
    return rows


def _packed_attention_row(name: str, args: argparse.Namespace, device: torch.device
                          ) -> dict[str, Any]:
    """--packing: fa4's varlen kernels on one micro-batch of packed documents (bench_positions)
    against each document attended alone (sdpa, one call each), and timed against what sdpa
    runs for packed rows: the block-diagonal causal mask (transformers' sdpa path)."""
    from trainer.attention import document_index, fa4_bwd, fa4_fwd

    config = bench_config(name)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups, scale = heads // kv_heads, head_dim**-0.5
    positions = bench_positions(config.vocab_size, args, torch.device("cpu"))[0, 0]
    bounds = packed_documents(positions)["cu_seq_lens_q"]
    total = positions.numel()
    generator = torch.Generator(device).manual_seed(args.seed)
    q, k, v = (torch.randn(total, h, head_dim, device=device, dtype=torch.bfloat16,
                           generator=generator) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn_like(q)
    cu_seqlens = bounds.to(device)
    bound = packed_documents(positions)["max_length_q"]  # as the trainer passes it
    out, lse = fa4_fwd(q, k, v, scale, True, cu_seqlens, bound)

    def fa4_backward() -> Sequence[torch.Tensor]:
        return fa4_bwd(dout, q, k, v, out, lse, scale, True, cu_seqlens, bound)

    grads = fa4_backward()

    def attend(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """sdpa as transformers calls it, (S, H, D) tokens of one row or document."""
        a, b, c = (t.transpose(0, 1)[None] for t in (a, b, c))
        b, c = b.repeat_interleave(groups, 1), c.repeat_interleave(groups, 1)
        result = torch.nn.functional.scaled_dot_product_attention(
            a, b, c, attn_mask=mask, is_causal=mask is None, scale=scale)
        return result[0].transpose(0, 1)

    # The reference: each document attended alone, in fp32.
    reference = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = torch.cat([attend(*(t[start:end] for t in reference))
                          for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(),
                                                strict=True)])
    expected.backward(dout.float())

    def errors(result: torch.Tensor, result_grads: Sequence[torch.Tensor]) -> dict[str, Any]:
        return {"out": _rel(result, expected), **{
            f"d{n}": _rel(g, leaf.grad) for n, g, leaf in zip("qkv", result_grads, reference)}}

    rows = positions.view(-1, args.seq_len)
    document = document_index(bounds, total).view(rows.shape)
    causal = torch.ones(args.seq_len, args.seq_len, dtype=torch.bool).tril()
    masks = ((document[:, :, None] == document[:, None, :]) & causal).to(device)

    def masked(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.cat([attend(*(t[i * args.seq_len:(i + 1) * args.seq_len] for t in (a, b, c)),
                                 masks[i][None, None]) for i in range(rows.shape[0])])

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    masked_out = masked(*leaves)
    masked_grads = torch.autograd.grad(masked_out, leaves, dout)

    def masked_forward_backward() -> Sequence[torch.Tensor]:
        return torch.autograd.grad(masked(*leaves), leaves, dout)

    reruns = [fa4_backward() for _ in range(RERUNS)]
    deterministic = _deterministic(fa4_backward, reruns[0], [t.grad for t in reference])
    masked_reruns = [masked_forward_backward() for _ in range(RERUNS)]

    lengths = torch.diff(bounds).double()
    fwd_flops = float(4 * heads * head_dim * (lengths**2 / 2).sum())
    fa4_f = _median_ms(lambda: fa4_fwd(q, k, v, scale, True, cu_seqlens, bound))
    fa4_b = _median_ms(fa4_backward)
    sdpa_f = _median_ms(lambda: masked(q, k, v))
    sdpa_b = max(_median_ms(masked_forward_backward) - sdpa_f, 1e-9)
    return {
        "run": "attention_check_packed", "model": name, "heads": heads, "kv_heads": kv_heads,
        "head_dim": head_dim, "batch": rows.shape[0], "seq_len": args.seq_len,
        "documents": len(lengths), "tokens": args.tokens,
        "document_tokens": [int(lengths.min()), int(lengths.median()), int(lengths.max())],
        # Relative error against each document attended alone in fp32: fa4's varlen kernels,
        # and sdpa's block-diagonal mask (what packed rows run on sdpa).
        "fa4_varlen_rel_error": errors(out, grads),
        "sdpa_masked_rel_error": errors(masked_out, masked_grads),
        "fa4_varlen_reruns": _rerun_spread(grads, reruns, [t.grad for t in reference]),
        "fa4_varlen_deterministic": deterministic,
        "sdpa_masked_reruns": _rerun_spread(masked_grads, masked_reruns,
                                            [t.grad for t in reference]),
        "fa4_fwd_ms": _rounded(fa4_f), "fa4_bwd_ms": _rounded(fa4_b),
        "sdpa_masked_fwd_ms": _rounded(sdpa_f), "sdpa_masked_bwd_ms": _rounded(sdpa_b),
        "fa4_fwd_tflops": _rounded(fwd_flops / fa4_f / 1e9),
        "fa4_bwd_tflops": _rounded(2.5 * fwd_flops / fa4_b / 1e9),
        "sdpa_masked_fwd_tflops": _rounded(fwd_flops / sdpa_f / 1e9),
        "sdpa_masked_bwd_tflops": _rounded(2.5 * fwd_flops / sdpa_b / 1e9),
    }


def _attention_row(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from trainer.attention import fa4_bwd, fa4_fwd

    config = bench_config(name)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator(device).manual_seed(args.seed)
    q, k, v = (torch.randn(args.micro_batch, args.seq_len, h, head_dim, device=device,
                           dtype=torch.bfloat16, generator=generator)
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn_like(q)
    scale = head_dim**-0.5
    groups = heads // kv_heads

    def sdpa(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """As transformers' sdpa path calls it: (B, H, S, D), KV heads repeated."""
        return torch.nn.functional.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2).repeat_interleave(groups, 1),
            c.transpose(1, 2).repeat_interleave(groups, 1), is_causal=True,
            scale=scale).transpose(1, 2)

    out, lse = fa4_fwd(q, k, v, scale, True)

    def fa4_backward() -> Sequence[torch.Tensor]:
        return fa4_bwd(dout, q, k, v, out, lse, scale, True)

    grads = fa4_backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = sdpa(*leaves)
    expected.backward(dout)

    errors = {"out": _rel(out, expected)}
    errors.update({f"d{n}": _rel(g, leaf.grad) for n, g, leaf in zip("qkv", grads, leaves)})
    reruns = [fa4_backward() for _ in range(RERUNS)]
    deterministic = _deterministic(fa4_backward, reruns[0], [leaf.grad for leaf in leaves])

    def sdpa_forward_backward() -> None:
        torch.autograd.grad(sdpa(*leaves), leaves, dout)

    fwd_flops = 4 * args.micro_batch * heads * args.seq_len**2 / 2 * head_dim
    fa4_f = _median_ms(lambda: fa4_fwd(q, k, v, scale, True))
    fa4_b = _median_ms(fa4_backward)
    sdpa_f = _median_ms(lambda: sdpa(q, k, v))
    sdpa_b = max(_median_ms(sdpa_forward_backward) - sdpa_f, 1e-9)  # the rest is backward
    return {
        "run": "attention_check", "model": name, "heads": heads, "kv_heads": kv_heads,
        "head_dim": head_dim, "batch": args.micro_batch, "seq_len": args.seq_len,
        "fa4_vs_sdpa_rel_error": errors,
        "fa4_reruns": _rerun_spread(grads, reruns, [leaf.grad for leaf in leaves]),
        "fa4_deterministic": deterministic,
        "fa4_fwd_tflops": _rounded(fwd_flops / fa4_f / 1e9),
        "fa4_bwd_tflops": _rounded(2.5 * fwd_flops / fa4_b / 1e9),
        "sdpa_fwd_tflops": _rounded(fwd_flops / sdpa_f / 1e9),
        "sdpa_bwd_tflops": _rounded(2.5 * fwd_flops / sdpa_b / 1e9),
        "sdpa": "default dispatch, KV heads repeated (as transformers calls it)",
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """|a - b| / |b| over the whole tensor, in fp32."""
    return _rounded(((a.float() - b.float()).norm() / b.float().norm()).item())


def _rerun_spread(first: Sequence[torch.Tensor], reruns: Sequence[Sequence[torch.Tensor]],
                  reference: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A backward run again on the same inputs: how far its dq, dk, dv move from the first run's
    (fa4 adds with atomics, in no fixed order: dq over key blocks, and with grouped-query heads
    each KV head's dk and dv over its query heads; 0 is bitwise repeatable) and the worst of them
    against the reference (a rare race would show there)."""
    names = [f"d{n}" for n in "qkv"]
    return {
        "runs": len(reruns),
        "max_rel_diff": {n: max(_rel(r[i], first[i]) or 0.0 for r in reruns)
                         for i, n in enumerate(names)},
        "max_rel_error": {n: max(_rel(r[i], reference[i]) or 0.0 for r in [first, *reruns])
                          for i, n in enumerate(names)},
    }


def _deterministic(backward: Callable[[], Sequence[torch.Tensor]], first: Sequence[torch.Tensor],
                   reference: Sequence[torch.Tensor]) -> dict[str, Any]:
    """fa4's backward under torch.use_deterministic_algorithms (its semaphore-ordered sums):
    its rerun spread (0 if it holds), against the reference, and its time. The caller's setting
    is put back after."""
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [backward() for _ in range(DETERMINISTIC_RUNS)]
        return {**_rerun_spread(runs[0], runs[1:], reference),
                "vs_default_rel_diff": {f"d{n}": _rel(a, b)
                                        for n, a, b in zip("qkv", runs[0], first, strict=True)},
                "bwd_ms": _rounded(_median_ms(backward))}
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


def _median_ms(run: Callable[[], Any], warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peer_problem(peer: str, name: str, args: argparse.Namespace) -> str | None:
    """Why a peer would not run `name` with these settings as ours does, or None."""
    if peer == "titan":
        return titan_problem(name, args)
    if peer == "unsloth":
        return unsloth_problem(args)
    return None


def peer_in_child(peer: str, name: str, argv: Sequence[str]) -> dict[str, Any]:
    """A peer run in its own process: Liger patches transformers' modules for good, which must
    not reach the next model's runs; its JSON line, or an error row with the child's last words."""
    done = subprocess.run(peer_command(peer, peer_child_argv(argv, name, peer)),
                          capture_output=True, text=True, check=False)
    sys.stderr.write(done.stderr)  # its warnings and --profile's table, with the parent's
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"run": PEERS[peer], "model": name,
            "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}


def peer_command(peer: str, child_argv: Sequence[str]) -> list[str]:
    """The child's command line: this module's main, after the peer's prelude (PEER_PRELUDES)."""
    if peer not in PEER_PRELUDES:
        return [sys.executable, "-m", "bench.train", *child_argv]
    main = "import runpy; runpy.run_module('bench.train', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", f"{PEER_PRELUDES[peer]}\n{main}", *child_argv]


def peer_child_argv(argv: Sequence[str], name: str, peer: str) -> list[str]:
    """The child's arguments: the parent's, for one model and one peer, without the kernel check
    (the parent ran it)."""
    return [a for a in argv if a != "--attention-check"] + ["--models", name,
                                                            "--peer-worker", peer]


def run_peer_worker(args: argparse.Namespace) -> None:
    """In the child of peer_in_child: the one peer --peer-worker names, each model."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peak, _ = peak_flops(device, torch.bfloat16)
    for name in args.models:
        if args.peer_worker == "titan":
            run = functools.partial(run_titan, name, args, device, peak)
        else:
            run = functools.partial(run_hf_trainer, name, args, device, peak,
                                    peer=args.peer_worker)
        print(json.dumps(guarded(run, PEERS[args.peer_worker], name)), flush=True)


def print_ratios(ours_rows: list[dict[str, Any]], theirs: dict[str, Any],
                 args: argparse.Namespace) -> None:
    for ours in ours_rows:
        if "error" in ours or "error" in theirs:
            continue
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        print(json.dumps({"run": "ratio", "model": ours["model"], "micro_batch": args.micro_batch,
                          "grad_accum": args.grad_accum, "ours": ours["options"]["attention"],
                          "peer": theirs["run"], "ours_over_peer_tokens_per_s": round(ratio, 3)}),
              flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.peer_worker:  # a child of peer_in_child: that peer alone
        run_peer_worker(args)
        return
    if args.attention_check and torch.cuda.is_available():
        for row in attention_check(args, torch.device("cuda", 0)):
            print(json.dumps(row), flush=True)
    for name in args.models:
        env = init_distributed()
        peak, _ = peak_flops(env.device, torch.bfloat16)
        ours_rows = []
        for attention in args.attention:
            run = functools.partial(run_trainer, name, args, env, peak, attention)
            ours = guarded(run, "trainer", name)
            release_memory(env.device)
            if env.rank == 0:
                print(json.dumps(ours), flush=True)
            ours_rows.append(ours)
        dist.destroy_process_group()  # Hugging Face Trainer runs as a plain single process
        if env.world_size > 1:  # the peers are the single-GPU comparison
            continue
        for peer in args.peers:
            if peer == "hf":
                hf_run = functools.partial(run_hf_trainer, name, args, env.device, peak)
                theirs = guarded(hf_run, "hf_trainer", name)
                release_memory(env.device)
            elif problem := peer_problem(peer, name, args):  # refused before any cost
                theirs = {"run": PEERS[peer], "model": name, "error": problem}
            else:
                theirs = peer_in_child(peer, name, argv)
            print(json.dumps(theirs), flush=True)
            print_ratios(ours_rows, theirs, args)


if __name__ == "__main__":
    main()
