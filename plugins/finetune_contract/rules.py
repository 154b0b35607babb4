"""Rules across fields, as functions that return (field, message) pairs: every problem at once.

`validate` calls `config_problems` with the run's TrainConfig, world and model shape before any
cloud call; the trainer calls it at start with its real world and its model's config. A rule
that is only here cannot be accepted by one side and refused by the other.
"""

from __future__ import annotations

import ipaddress
import re

from finetune_contract.families import FAMILIES, lora_target_problem
from finetune_contract.fields import (
    FA4_CAPABILITIES,
    FA4_HEAD_DIMS,
    FA4_MODULE,
    FA4_PACKAGE,
    FLOAT8_MIN_CAPABILITY,
    PRINTABLE,
    capability_text,
    quoted,
)
from finetune_contract.mixture import parse_mixture, source_config
from finetune_contract.models import STRETCHED_ROPE, ModelShape
from finetune_contract.parallel_dims import ParallelDims, elastic_problems
from finetune_contract.parameters import BY_NAME, TRAINER_PARAMETERS
from finetune_contract.throughput import LOGITS_PER_CHUNK, OFFLOADED_LOGITS_PER_CHUNK
from finetune_contract.train_config import TrainConfig

Problems = list[tuple[str, str]]
S3_SCHEME = "s3://"
# A file or directory name: most Linux file systems (ext4, xfs) and S3 tools stop at 255 bytes.
MAX_NAME_BYTES = 255
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*$")


# Offloaded blocks (activation_offload with full checkpointing, trainer/offload.py) run their MLP
# over slices of at most this many tokens: 8B's four MLP-wide tensors are then 3.8 GB at most
# however long the sequence (at 400k tokens, whole: 47 GB).
MLP_TILE_TOKENS = 32768
# ... and over at least this many: a block's backward keeps eight MLP-wide tensors of its slice
# (bench.train --memory-peak, 8B at 8,192 tokens: 1.75 GiB of an 8.8 GiB peak), the lean mode's
# largest part below 128k tokens. But a 4-bit (QLoRA) MLP's slices are no smaller than
# QUANTIZED_MLP_MIN_TILE_TOKENS: each slice dequantizes its weights again (8B at 8,192 tokens in 4
# slices: 7% slower on an H100; dequantizing once for all slices was slower still).
MIN_MLP_TILES = 4
QUANTIZED_MLP_MIN_TILE_TOKENS = 8192


def min_mlp_tile_tokens(cfg: TrainConfig) -> int:
    """The fewest tokens an offloaded MLP's slice keeps: a 4-bit base's, or any number."""
    return QUANTIZED_MLP_MIN_TILE_TOKENS if cfg.quantize_base != "none" else 1


def mlp_tiles(tokens: int, tile_tokens: int = MLP_TILE_TOKENS, min_tile_tokens: int = 1) -> int:
    """How many slices an offloaded block's MLP runs over for `tokens` tokens: enough that none
    exceeds `tile_tokens`, at least MIN_MLP_TILES where each keeps `min_tile_tokens`, one at
    least."""
    wanted = max(MIN_MLP_TILES, -(-tokens // tile_tokens))
    return max(1, min(wanted, tokens // min_tile_tokens))


def mlp_tile_fraction(cfg: TrainConfig, tokens: int) -> float:
    """The share of `tokens` the largest slice holds (the planner's MLP part of an offloaded
    block): the trainer's slices (trainer/offload.py), rounded as they are."""
    tiles = mlp_tiles(tokens, MLP_TILE_TOKENS, min_mlp_tile_tokens(cfg))
    return -(-tokens // tiles) / tokens


def offloads_blocks(cfg: TrainConfig) -> bool:
    """activation_offload with full checkpointing at tensor-parallel degree 1: each block's input
    waits in CPU memory and its MLP is tiled (trainer/offload.py); otherwise activation_offload
    moves what each block saves (trainer/activations.py)."""
    return (cfg.activation_offload and cfg.activation_checkpointing == "full"
            and cfg.tp_degree == 1)


def float8_reads_masters(cfg: TrainConfig) -> bool:
    """Whether a one-process run with master weights (no FSDP: trainer/master_weights.py) casts
    its trained float8 Linears' weights from their fp32 masters, with no bf16 copies: where that
    was measured faster (docs/trainer.md, "float8 Linears cast their fp32 masters"). Without
    accumulated micro-batches, either recipe; with them, rowwise only (measured +0.9% at 3B;
    likely, not profiled: its weight gradient's row scaling and the cast to fp32 then run as one
    pass), as tensorwise was slower there (each micro-batch casts from fp32 again, 4 bytes a
    weight read, not 2). The planner counts no compute copies for those weights."""
    return cfg.float8 and (cfg.grad_accum == 1 or cfg.float8_recipe == "rowwise")


def loss_chunk_tokens(cfg: TrainConfig, vocab_size: int) -> int:
    """The tokens of one chunk of the chunked loss (trainer/loss.py), which the planner counts:
    a fixed number of logits, a quarter of it when blocks are offloaded."""
    logits = OFFLOADED_LOGITS_PER_CHUNK if offloads_blocks(cfg) else LOGITS_PER_CHUNK
    return max(1, logits // vocab_size)


def selective_every(selective_ac: str) -> int | None:
    """The k of selective_ac "k" (checkpoint every k-th block), None for "op"; else ValueError."""
    if selective_ac == "op":
        return None
    if selective_ac.isdigit() and int(selective_ac) > 0:
        return int(selective_ac)
    raise ValueError(f"{quoted(selective_ac)}: allowed: op, or a positive integer k (checkpoint "
                     "every k-th block)")


def lora_module_names(text: str) -> list[str]:
    """The module names of a comma-separated `lora_target_modules`, without blanks."""
    return [name.strip() for name in text.split(",") if name.strip()]


def bucket_problem(bucket: str) -> str | None:
    """Why S3 would refuse this bucket name (its naming rules), or None."""
    if not _BUCKET.match(bucket):
        return ("3 to 63 lowercase letters, digits, '.' and '-', starting and ending with a letter "
                "or digit")
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        return "no '..', '.-' or '-.'"
    try:
        ipaddress.IPv4Address(bucket)
        return "not an IP address"
    except ValueError:
        pass
    if bucket.startswith(_BUCKET_PREFIXES) or bucket.endswith(_BUCKET_SUFFIXES):
        return "no reserved prefix (" + ", ".join(_BUCKET_PREFIXES) + ") or suffix (" + \
            ", ".join(_BUCKET_SUFFIXES) + ")"
    return None


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key without slashes at either end) of `s3://bucket/key`; ValueError naming what
    is wrong when S3 would not take it."""
    bucket, _, key = uri.removeprefix(S3_SCHEME).partition("/")
    key = key.strip("/")
    if not bucket:
        raise ValueError(f"{quoted(uri)}: an s3:// URI needs a bucket (s3://bucket/key)")
    problem = bucket_problem(bucket)
    if problem:
        raise ValueError(f"{quoted(uri)}: bucket {quoted(bucket)} is not a valid S3 bucket name "
                         f"({problem})")
    if not key:
        raise ValueError(f"{quoted(uri)}: give a key or prefix after the bucket "
                         "(s3://bucket/key)")
    if "//" in key or len(key.encode()) > 1024:
        raise ValueError(f"{quoted(uri)}: the key has an empty part ('//') or is over 1024 bytes")
    if not re.fullmatch(PRINTABLE, key):
        raise ValueError(f"{quoted(uri)}: the key holds a control character (NUL, newline, tab, "
                         "DEL); S3 tools and logs cannot carry it")
    return bucket, key


def path_problem(path: str) -> str | None:
    """Why no file system would hold this path (a NUL byte, a name over 255 bytes), or None."""
    if path and not re.fullmatch(PRINTABLE, path):
        return "holds a control character (NUL, newline, tab, DEL)"
    for part in path.split("/"):
        if len(part.encode()) > MAX_NAME_BYTES:
            return (f"has a name of {len(part.encode())} bytes ({quoted(part, 40)}); file systems "
                    f"allow {MAX_NAME_BYTES}")
    return None


def location_problems(field: str, value: str) -> Problems:
    """An s3:// URI S3 accepts, or a path a file system can hold."""
    if value.startswith(S3_SCHEME):
        try:
            split_s3(value)
        except ValueError as exc:
            return [(field, str(exc))]
        return []
    problem = path_problem(value)
    return [(field, f"{quoted(value, 60)} {problem}")] if problem else []


def _name(shape: ModelShape) -> str:
    return shape.name if len(shape.name) <= 80 else f"{shape.name[:80]}..."


def config_problems(cfg: TrainConfig, *, world_size: int, local_world_size: int,
                    shape: ModelShape | None) -> Problems:
    """Every cross-field problem of a run of `world_size` processes, `local_world_size` per
    node, on a model of `shape` (None: not known yet; the trainer passes its model's)."""
    problems: Problems = []
    problems += _checkpointing(cfg)
    problems += _float8_and_lora(cfg)
    problems += _attention(cfg, shape)
    problems += _preference(cfg)
    problems += _parallelism(cfg, world_size, local_world_size, shape)
    problems += _architecture(cfg, shape)
    if (shape and shape.max_position_embeddings and cfg.seq_len > shape.max_position_embeddings
            and shape.rope_type not in STRETCHED_ROPE):
        problems.append(("seq_len", f"{cfg.seq_len} exceeds model {_name(shape)}'s "
                         f"max_position_embeddings ({shape.max_position_embeddings}) and its "
                         f"rope type {shape.rope_type!r} is not one the trainer stretches "
                         f"({', '.join(STRETCHED_ROPE)}): lower seq_len or choose a model "
                         "with more positions"))
    if cfg.prompt_template == "chat" and cfg.text_field:
        problems.append(("prompt_template", f"chat needs prompt and response fields, but "
                         f"text_field={quoted(cfg.text_field)} makes every row plain text: "
                         "unset one of them"))
    for field in ("output_dir", "dataset", "model", "tokenizer"):
        value = getattr(cfg, field)
        if value and (field == "output_dir" or value.startswith(("/", ".", "~", S3_SCHEME))):
            problems += location_problems(field, value)
    problems += _mixture(cfg)
    return problems


def _mixture(cfg: TrainConfig) -> Problems:
    """The mixture's sources (finetune_contract.mixture), each held to the rules the run's own
    data fields are: its fields' methods, chat with plain text, its data set's location."""
    sources, problems = parse_mixture(cfg.mixture)
    for source in sources:
        where = source.where
        for key, value in source.fields.items():
            parameter = BY_NAME[key]
            if cfg.method not in parameter.methods and value != parameter.default:
                problems.append((f"{where}.{key}", f"{quoted(value)} applies to method "
                                 f"{' or '.join(parameter.methods)} only (method is "
                                 f"{cfg.method}): a mixture is of {cfg.method} sources only"))
        own = source_config(cfg, source)
        if own.prompt_template == "chat" and own.text_field:
            problems.append((f"{where}.prompt_template", "chat needs prompt and response "
                             f"fields, but text_field={quoted(own.text_field)} makes every "
                             "row plain text: unset one of them"))
        if own.method == "dpo" and own.text_field:
            problems.append((f"{where}.text_field", f"{quoted(own.text_field)} with method = "
                             "dpo: DPO rows need prompt, chosen and rejected fields"))
        if own.dataset.startswith(("/", ".", "~", S3_SCHEME)):
            problems += [(f"{where}.dataset", message)
                         for _, message in location_problems("dataset", own.dataset)]
    return problems


def device_problems(*, quantize_base: str, gpu: bool, attention: str = "sdpa",
                    float8: bool = False, capability: tuple[int, int] | None = None,
                    fa4_installed: bool = True, where: str = "this run") -> Problems:
    """Options that need a GPU, or a GPU of some compute capability, for a world whose processes
    have none (`gpu` false) or have `capability`: the local target's check (this machine), the
    eks target's (the instance type's GPUs and the image) and the trainer's start (its device)
    ask the same.
    `capability`: the GPUs' CUDA compute capability where known (None: not refused for it);
    `fa4_installed`: whether the trainer's environment has fa4's package, `where` naming that
    environment."""
    problems: Problems = []
    has = f"compute capability {capability_text(capability)}" if gpu and capability \
        else "no CUDA GPU"
    if quantize_base != "none" and not gpu:
        problems.append(("quantize_base", f"{quantize_base} needs CUDA GPUs (the 4-bit weights "
                         "are dequantized by GPU kernels, as QLoRA runs); this run has none: "
                         "set quantize_base to none or run on GPUs"))
    if float8 and (not gpu or (capability and capability < FLOAT8_MIN_CAPABILITY)):
        problems.append(("float8", f"needs CUDA GPUs of compute capability "
                         f"{capability_text(FLOAT8_MIN_CAPABILITY)} or later (float8 tensor "
                         f"cores: L4, H100/H200, B200); this run has {has}: set float8 to false"))
    if attention == "fa4" and (not gpu or (capability and capability not in FA4_CAPABILITIES)):
        problems.append(("attention", f"fa4 runs FlashAttention 4's kernels, built for CUDA "
                         f"compute capability {_capabilities()} (H100/H200, B200); this run has "
                         f"{has}: set attention to sdpa"))
    elif attention == "fa4" and not fa4_installed:
        problems.append(("attention", f"fa4 runs FlashAttention 4's kernels, from the package "
                         f"{FA4_PACKAGE}, which {where} does not have: install it there (pip "
                         f"install {FA4_PACKAGE}) or set attention to sdpa"))
    return problems


def fa4_importable() -> bool:
    """Whether this Python environment has fa4's package (FA4_MODULE), without importing it."""
    import importlib.util

    return importlib.util.find_spec(FA4_MODULE) is not None


def _capabilities() -> str:
    return " or ".join(map(capability_text, FA4_CAPABILITIES))


def _conflicts(cfg: TrainConfig, field: str, what: str, undo: str,
               conflicts: tuple[tuple[str, bool, str, str], ...]) -> list[tuple[str, str]]:
    """`field`'s problems with the other fields it cannot be combined with: each row is (other
    field, conflicting now, a value that works, why), the fix naming both ways out."""
    return [(field, f"{what}cannot be combined with {name} = {getattr(cfg, name)}: {reason}; "
                    f"set {undo} or {name} to {working}")
            for name, conflicting, working, reason in conflicts if conflicting]


def _attention(cfg: TrainConfig, shape: ModelShape | None) -> Problems:
    """fa4 against the options its kernels do not take; each message says what to change."""
    if cfg.attention != "fa4":
        return []
    problems: Problems = []
    if cfg.mixed_precision == "fp32":
        problems.append(("attention", "fa4 with mixed_precision fp32: its kernels take bf16 or "
                         "fp16; set mixed_precision to bf16 or attention to sdpa"))
    if cfg.packing and shape is not None and (shape.windowed or shape.soft_capped):
        what = "sliding windows" if shape.windowed else "soft-capped attention scores"
        problems.append(("packing", f"packed rows with fa4 run FlashAttention 4's varlen "
                         f"kernel, which model {_name(shape)}'s {what} do not take: set "
                         "attention to sdpa or packing to false"))
    conflicts = (
        ("tp_degree", cfg.tp_degree > 1, "1",
         "sequence parallelism gathers attention's inputs through DTensor, which the fa4 "
         "kernels do not take"),
    )  # fmt: skip
    problems += _conflicts(cfg, "attention", "fa4 ", "attention to sdpa", conflicts)
    head_dim = shape.head_dim if shape is not None else None
    if head_dim and head_dim not in FA4_HEAD_DIMS:
        problems.append(("attention", f"fa4 takes head dims {', '.join(map(str, FA4_HEAD_DIMS))}; "
                         f"model {_name(shape)} has {head_dim}: set attention to sdpa"))
    return problems


def _checkpointing(cfg: TrainConfig) -> Problems:
    if cfg.activation_checkpointing == "selective":
        try:
            selective_every(cfg.selective_ac)
        except ValueError as exc:
            return [("selective_ac", str(exc))]
    elif cfg.selective_ac != "op":
        return [("selective_ac", f"{quoted(cfg.selective_ac)} applies only to "
                 f"activation_checkpointing selective (it is {cfg.activation_checkpointing!r}): "
                 "set activation_checkpointing to selective or leave selective_ac at op")]
    return []


def _float8_and_lora(cfg: TrainConfig) -> Problems:
    """float8 and LoRA against the options they cannot run with; each message names both."""
    problems: Problems = []
    if cfg.float8_recipe != "tensorwise" and not cfg.float8:
        problems.append(("float8_recipe", f"{cfg.float8_recipe} scales float8 matmuls, and "
                         "float8 is false: set float8 to true, or float8_recipe to tensorwise"))
    if cfg.float8:
        if cfg.mixed_precision != "bf16":
            problems.append(("float8", f"needs mixed_precision bf16 (got {cfg.mixed_precision}): "
                             "its matmuls take bf16 inputs; set mixed_precision to bf16"))
        if cfg.seq_len % 16:
            problems.append(("float8", f"needs seq_len divisible by 16 (got {cfg.seq_len}): "
                             "float8 matmuls take dimensions in multiples of 16"))
        conflicts = (
            ("cpu_offload", cfg.cpu_offload, "false",
             "float8 casts run on the GPU, CPU-offloaded weights are not there"),
            ("tp_degree", cfg.tp_degree > 1, "1",
             "the tensor-parallel plan shards nn.Linear, not torchao's Float8Linear"),
            ("lora_rank", cfg.lora_rank > 0, "0",
             "LoRA wraps the Linear layers that float8 would swap"),
        )  # fmt: skip
        problems += _conflicts(cfg, "float8", "", "float8 to false", conflicts)
    if cfg.quantize_base != "none":
        if not cfg.lora_rank:
            problems.append(("quantize_base", f"{cfg.quantize_base} quantizes the frozen base "
                             "weights of a LoRA run, and lora_rank is 0 (a full fine-tune trains "
                             "them): set lora_rank > 0 or quantize_base to none"))
        if cfg.cpu_offload:
            problems.append(("quantize_base", f"{cfg.quantize_base} cannot be combined with "
                             "cpu_offload = true: the 4-bit weights stay on the GPU, unsharded; "
                             "set cpu_offload to false or quantize_base to none"))
    if cfg.lora_rank:
        if cfg.tp_degree > 1:
            problems.append(("lora_rank", f"{cfg.lora_rank} with tp_degree = {cfg.tp_degree}: "
                             "the tensor-parallel plan does not know peft's LoRA layers; set "
                             "tp_degree to 1 or lora_rank to 0"))
        names = lora_module_names(cfg.lora_target_modules)
        if not names or any(not _MODULE_NAME.match(name) for name in names):
            problems.append(("lora_target_modules", f"{quoted(cfg.lora_target_modules)}: give "
                             "comma-separated module names such as q_proj,v_proj"))
    return problems


def _preference(cfg: TrainConfig) -> Problems:
    """A field set away from its default for a method it does not apply to (the parameter
    table's `methods`), and DPO against what it cannot run with."""
    problems: Problems = []
    for parameter in TRAINER_PARAMETERS:
        value = getattr(cfg, parameter.name)
        if cfg.method not in parameter.methods and value != parameter.default and \
                not (parameter.optional and value is None):  # an optional text left unset
            problems.append((parameter.name, f"{quoted(value)} applies to method "
                             f"{' or '.join(parameter.methods)} only (method is {cfg.method}): "
                             f"set method to {parameter.methods[0]} or {parameter.name} to "
                             f"{parameter.default}"))
    if cfg.method != "dpo":
        return problems
    if cfg.packing:
        problems.append(("packing", "cannot be combined with method = dpo: a chosen and a "
                         "rejected response are scored as whole sequences, one pair per row; "
                         "set packing to false or method to sft"))
    if cfg.text_field:
        problems.append(("text_field", f"{quoted(cfg.text_field)} with method = dpo: DPO rows "
                         "need prompt, chosen and rejected fields, not plain text; unset "
                         "text_field or set method to sft"))
    if cfg.tp_degree > 1:
        problems.append(("tp_degree", f"{cfg.tp_degree} with method = dpo: the per-response "
                         "log-probabilities are not computed over a sequence-parallel split; "
                         "set tp_degree to 1 or method to sft"))
    if cfg.dpo_label_smoothing and cfg.dpo_loss != "sigmoid":
        problems.append(("dpo_label_smoothing", f"{cfg.dpo_label_smoothing:g} smooths the "
                         f"sigmoid loss (cDPO), and dpo_loss is {cfg.dpo_loss}: set "
                         "dpo_label_smoothing to 0 or dpo_loss to sigmoid"))
    if cfg.chosen_field == cfg.rejected_field:
        problems.append(("rejected_field", f"{quoted(cfg.rejected_field)} is also chosen_field: "
                         "the two responses of a pair must be different columns"))
    return problems


def _architecture(cfg: TrainConfig, shape: ModelShape | None) -> Problems:
    """The model's architecture against the table: in it, and with what the run asks of it."""
    if shape is None:
        return []
    if shape.architecture_problem:
        return [("model", f"{_name(shape)}: {shape.architecture_problem}")]
    family = FAMILIES[shape.model_type]
    problems: Problems = []
    if cfg.lora_rank:
        problem = lora_target_problem({"model_type": shape.model_type}, cfg.lora_target_modules)
        if problem:
            problems.append(("lora_target_modules", f"{quoted(cfg.lora_target_modules)} "
                             f"{problem}: name those or leave it at auto"))
    if cfg.tp_degree > 1 and family.tp_refused:
        problems.append(("tp_degree", f"{cfg.tp_degree} with model {_name(shape)} "
                         f"({family.label}): {family.tp_refused}; set tp_degree to 1"))
    return problems


def _parallelism(cfg: TrainConfig, world_size: int, local_world_size: int,
                 shape: ModelShape | None) -> Problems:
    """The layout's problems (finetune_contract.parallel_dims) and tensor parallelism against the
    sequence, CPU offload and the model's heads and MLP."""
    layout = ParallelDims.of(cfg, world_size=world_size, procs_per_node=local_world_size)
    problems: Problems = list(layout.tp_problems)
    tp = cfg.tp_degree
    if tp > 1:
        if cfg.seq_len % tp:
            problems.append(("tp_degree", f"{tp} does not divide seq_len = {cfg.seq_len}: "
                             "sequence parallelism splits every sequence into equal parts"))
        if cfg.cpu_offload:
            problems.append(("cpu_offload", f"is not supported with tp_degree > 1 (got {tp}): "
                             "set cpu_offload to false or tp_degree to 1"))
        if shape is not None:
            for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
                count = getattr(shape, name)
                if count and count % tp:
                    problems.append(("tp_degree", f"{tp} does not divide model "
                                     f"{_name(shape)}'s {name} ({count}): each "
                                     "tensor-parallel rank computes an equal part"))
    if problems and cfg.strategy == "HYBRID_SHARD":
        return problems  # its shard group is measured against the tp_degree these ask to change
    problems += layout.shard_problems
    # An elastic run's smaller worlds, once its planned one holds.
    return problems or list(elastic_problems(cfg, local_world_size))
