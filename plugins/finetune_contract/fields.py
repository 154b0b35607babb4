"""The trainer's fields: allowed values and bounds (one table each), `TrainConfig`, `ContractError`.

The trigger form's parameter specs (plugins/finetune/config.py) take their choices and bounds
from here, and `TrainConfig` checks the same tables, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
MIXED_PRECISION = ("bf16", "fp16", "fp32")
# auto: the planner (finetune_contract.plan) picks the fastest of the others that fits the GPU.
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "auto")
PROMPT_TEMPLATES = ("instruction", "chat")
DATASET_FORMATS = ("auto", "jsonl", "json", "parquet", "csv")
BAD_ROWS = ("skip", "error")
# torchao's float8 scaling: one scale per tensor (weights all-gathered in float8 under FSDP), or
# one per row (finer: closer to bf16's loss, slower; weights all-gathered in bf16).
FLOAT8_RECIPES = ("tensorwise", "rowwise")
# QLoRA: the frozen base Linears of the decoder blocks stored in 4-bit NormalFloat (torchao).
QUANTIZE_BASE = ("none", "nf4")
# The decoder blocks' attention kernel: cuDNN's flash attention through torch's sdpa, or
# FlashAttention 4 (flash-attn-4's CuTe-DSL kernels, trainer/attention.py) where it runs.
ATTENTION = ("sdpa", "fa4")
# fa4's kernels: the CUDA capabilities they are built for (Hopper, Blackwell) and head dims.
FA4_CAPABILITIES = ((9, 0), (10, 0))
FA4_HEAD_DIMS = (64, 96, 128)
# sft: next-token loss on the responses; dpo: preference tuning on (prompt, chosen, rejected) rows.
METHODS = ("sft", "dpo")
# DPO's loss on the policy-minus-reference log-ratio margin: sigmoid (DPO, cDPO with
# dpo_label_smoothing) or ipo (squared, on per-token averages).
DPO_LOSSES = ("sigmoid", "ipo")
# The reference log-probs: a frozen copy of the initial weights (LoRA: the adapters disabled), or
# computed in a first pass over the data so no second model is held.
DPO_REFERENCES = ("model", "precompute")
# metrics.jsonl keys of a dpo run's steps: mean rewards (beta x the log-ratio to the reference)
# of the chosen and rejected responses, share of pairs whose chosen reward is higher, mean margin.
DPO_METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")
# The fields of method dpo, passed through to the trainer as they are.
DPO_FIELDS = ("method", "chosen_field", "rejected_field", "dpo_beta", "dpo_loss",
              "dpo_label_smoothing", "dpo_reference")
# The allowed values of each text field that has a fixed set.
CHOICES: dict[str, tuple[str, ...]] = {
    "strategy": STRATEGIES,
    "mixed_precision": MIXED_PRECISION,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "prompt_template": PROMPT_TEMPLATES,
    "dataset_format": DATASET_FORMATS,
    "bad_rows": BAD_ROWS,
    "float8_recipe": FLOAT8_RECIPES,
    "quantize_base": QUANTIZE_BASE,
    "attention": ATTENTION,
    "method": METHODS,
    "dpo_loss": DPO_LOSSES,
    "dpo_reference": DPO_REFERENCES,
}
# Every Linear of a Llama block: attention and MLP projections.
LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# lora_target_modules' default: the model family's set (finetune_contract.families).
LORA_TARGETS_DEFAULT = "auto"
# The demo data set, relative to the repository root (the trainer's working dir).
DEMO_DATASET = "trainer/demo/instructions.jsonl"
DEMO_PREFERENCES = "trainer/demo/preferences.jsonl"  # the demo data of method dpo
# The run's TrainConfig as the trainer resolved it, in its output_dir (the runs page reads it).
RESOLVED_CONFIG_FILE = "trainer_config.resolved.json"
# Share of the data set held out for the eval loss.
EVAL_FRACTION = 0.05
# Seconds without progress before a rank's watchdog ends it (0: no watchdog); the form's default.
HANG_TIMEOUT_S = 1800
# 0.2: a rank 20% slower than the median rank is flagged.
STRAGGLER_THRESHOLD = 0.2
# Longest value an error message quotes before cutting it.
MAX_QUOTED = 80
# What trainer/evaluate.py writes in the run's output directory, beside model/.
EVALUATION_FILE = "evaluation.json"
# The prepare_data stage's record in the run directory (its statistics, time, cache hit): the
# Airflow worker or the stage's own pod (trainer/prepare_data.py) writes it, the report reads it.
PREPARE_DATA_FILE = "prepare_data.json"
# The lm-evaluation-harness tasks shipped in trainer/eval_tasks (run offline, by name).
EVAL_TASKS = ("demo_instructions",)
# What promotion compares: eval loss or perplexity on the eval split (lower is better), or a
# task's metric (`<task>.<metric>`, higher is better as the harness says).
LOWER_IS_BETTER = ("eval_loss", "perplexity")


@dataclass(frozen=True)
class Bounds:
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None

    def problem(self, value: float) -> str | None:
        if self.exclusive_minimum is not None and value <= self.exclusive_minimum:
            return f"must be > {self.exclusive_minimum:g}, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}, got {value!r}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}, got {value!r}"
        return None


_B = Bounds
# The bounds of every numeric field: the trainer's, and the run's (nodes, deadline, price).
BOUNDS: dict[str, Bounds] = {
    "max_nodes": _B(1, 1024),
    "active_deadline_s": _B(0, 30 * 86400),
    "schedule_timeout_s": _B(0, 86400),
    "prepare_cpu": _B(1, 192),
    "prepare_memory_gib": _B(1, 2048),
    "node_hourly_price": _B(0, 10_000),
    "nodes": _B(1, 128),
    "procs_per_node": _B(1, 64),
    "shard_group_size": _B(0, 8192),
    "tp_degree": _B(1, 64),
    "lora_rank": _B(0, 4096),
    "lora_alpha": _B(maximum=65536, exclusive_minimum=0),
    "lora_dropout": _B(0, 0.99),
    "seq_len": _B(8, 131072),
    "micro_batch": _B(1, 4096),
    "grad_accum": _B(1, 4096),
    "lr": _B(maximum=1, exclusive_minimum=0),
    "warmup_steps": _B(0, 1_000_000),
    "min_lr_ratio": _B(0, 1),
    "weight_decay": _B(0, 10),
    "max_steps": _B(0, 10_000_000),
    "epochs": _B(maximum=1000, exclusive_minimum=0),
    "seed": _B(0, 2**31 - 1),
    "eval_interval": _B(0, 10_000_000),
    "eval_fraction": _B(maximum=0.99, exclusive_minimum=0),
    "max_skipped_fraction": _B(minimum=0, maximum=1),
    "checkpoint_interval": _B(0, 10_000_000),
    "keep_checkpoints": _B(1, 1000),
    "max_restarts": _B(0, 100),
    "log_interval": _B(1, 1_000_000),
    "metrics_port": _B(0, 65535),
    "max_grad_norm": _B(maximum=1e6, exclusive_minimum=0),
    "hang_timeout_s": _B(0, 7 * 86400),
    "straggler_threshold": _B(maximum=100, exclusive_minimum=0),
    "sample_prompts": _B(0, 100),
    "max_new_tokens": _B(1, 4096),
    "promotion_margin": _B(0, 1e6),
    "dpo_beta": _B(maximum=100, exclusive_minimum=0),
    # 0.5 would make the preference a coin toss (cDPO divides by 1 - 2 * smoothing).
    "dpo_label_smoothing": _B(0, 0.49),
}


@dataclass(frozen=True)
class Text:
    """A text field's rule: at most `max_length` characters, all of it matching `pattern`
    (`what` says what in words). An empty value is "not set": whether a field must be set is
    its own rule (_REQUIRED_STRINGS, the target's)."""

    max_length: int
    pattern: str
    what: str

    def problem(self, value: str, shown: str) -> str | None:
        """`shown`: the value as the message may show it (cut by `quoted`, or hidden)."""
        if len(value) > self.max_length:
            return f"{shown} is {len(value)} characters long; at most {self.max_length}"
        if value and not re.fullmatch(self.pattern, value):
            return f"{shown} is not {self.what}"
        return None


# No control character (NUL, newline, tab, DEL): no file system, S3 key or log line takes one.
PRINTABLE = r"[^\x00-\x1f\x7f]+"
PATH_MAX = 4096  # Linux's longest path
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
# An OCI image reference (the distribution spec's grammar): [host[:port]/]path[:tag][@digest],
# each path part lowercase alphanumerics joined by '.', '_', '__' or dashes (so no '..').
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
IMAGE_REFERENCE = (rf"(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*(?::[0-9]{{1,5}})?/)?"
                   rf"{_IMAGE_COMPONENT}(?:/{_IMAGE_COMPONENT})*"
                   r"(?::\w[\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")
# ECR's repository name rule (2-256 characters).
ECR_REPOSITORY = r"(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*"
# Airflow's connection id rule (airflow.models.connection: RE_SANITIZE_CONN_ID, CONN_ID_MAX_LEN;
# a test holds these to the installed Airflow's).
CONN_ID = r"[\w#!()\-.:/\\]{1,}"
CONN_ID_MAX_LEN = 250
_CONN = Text(CONN_ID_MAX_LEN, CONN_ID, "an Airflow connection id (letters, digits and "
             "#!()-.:/\\_)")
_PATH = Text(PATH_MAX, PRINTABLE, "a path, s3:// URI or hub id without control characters "
             "(NUL, newline, tab)")
_COLUMN = Text(256, PRINTABLE, "a column name without control characters")
_NAME = Text(253, _DNS_SUBDOMAIN, "a Kubernetes name (lowercase letters, digits, '-' and '.')")
_LABEL = Text(63, _DNS_LABEL, "a DNS label (lowercase letters, digits and '-', starting and "
              "ending with a letter or digit)")
# The rule of every text field without a fixed set of values (CHOICES, or the form's enum).
TEXTS: dict[str, Text] = {
    "model": _PATH, "tokenizer": _PATH, "dataset": _PATH, "eval_dataset": _PATH,
    "output_dir": _PATH, "prepared_data": _PATH,
    "dataset_split": Text(128, r"[\w.\[\]:%+-]+", "a split name (letters, digits, '_', '.'; "
                          "a slice such as train[:10%])"),
    "text_field": _COLUMN, "prompt_field": _COLUMN, "response_field": _COLUMN,
    "chosen_field": _COLUMN, "rejected_field": _COLUMN,
    # what the value means (op, or k > 0) is selective_every's rule (rules.py)
    "selective_ac": Text(16, r"\w+", "op or a positive integer k"),
    # each name's own rule: rules.py (module names), field_problem (task names)
    "lora_target_modules": Text(4096, PRINTABLE, "comma-separated module names"),
    "eval_tasks": Text(4096, PRINTABLE, "comma-separated task names"),
    "promotion_metric": Text(256, r"[\w.-]+", "a metric name (eval_loss, perplexity or "
                             "<task>.<metric>)"),
    # host:port, [ipv6]:port (a host name is at most 253 characters).
    "rdzv_endpoint": Text(263, r"\S+", "host:port without spaces"),
    # EKS's cluster and node group name rules.
    "cluster_name": Text(100, r"[0-9A-Za-z][A-Za-z0-9_-]*", "an EKS cluster name (letters, "
                         "digits, '-' and '_', starting with a letter or digit)"),
    "nodegroup": Text(63, r"[0-9A-Za-z][A-Za-z0-9_-]*", "an EKS node group name (letters, "
                      "digits, '-' and '_', starting with a letter or digit)"),
    "namespace": _LABEL, "etcd_service": _LABEL,
    "service_account": _NAME, "queue_name": _NAME,
    # the distribution spec: a name of at most 255 characters, a tag of 128, a digest.
    "image": Text(255 + 129 + 72, IMAGE_REFERENCE, "an image reference "
                  "([registry[:port]/]repository[:tag][@sha256:digest]; path parts lowercase "
                  "letters and digits joined by '.', '_' or '-', no '..')"),
    "image_repository": Text(256, rf"(?=.{{2}}){ECR_REPOSITORY}", "an ECR repository name "
                             "(2-256 lowercase letters, digits, '.', '_', '-', '/')"),
    "build_bucket": Text(63, r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", "an S3 bucket name"),
    "codebuild_role": Text(2048, r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+",
                           "an IAM role ARN (arn:aws:iam::<account>:role/<name>)"),
    "aws_conn_id": _CONN, "kubernetes_conn_id": _CONN, "prometheus_conn_id": _CONN,
    "volumes": Text(PATH_MAX, PRINTABLE, "claim:/mount/path pairs without control characters"),
    # each key and value's own rule: the eks target's (Kubernetes label syntax)
    "prepare_node_selector": Text(4096, PRINTABLE, "label=value pairs separated by commas"),
    "hf_token_secret": Text(253 + 1 + 253, r"\S+", "a Secret's name or name:key"),
    "prometheus_url": Text(2048, r"https?://\S+", "an http(s):// URL"),
}
# A Hugging Face hub repo id (huggingface_hub's validate_repo_id): name or namespace/name, each
# part at most 96 letters, digits, '_', '.' and '-', starting and ending with a letter, digit
# or '_', no '--' or '..', not ending in .git.
HUB_PART_MAX = 96
_HUB_PART = re.compile(r"\w(?:[\w.-]{0,94}\w)?")


def hub_id_problem(value: str, namespaced: bool = False) -> str | None:
    """Why the hub would refuse `value` as a repo id (namespaced: org/name required), or None."""
    parts = value.split("/")
    if len(parts) > 2 or (namespaced and len(parts) != 2):
        return "is not a hub id (org/name)" if namespaced else \
            "is not a hub id (name or org/name)"
    for part in parts:
        if len(part) > HUB_PART_MAX:
            return f"has a part of {len(part)} characters; the hub allows {HUB_PART_MAX}"
        if not _HUB_PART.fullmatch(part):
            return ("has a part that is not letters, digits, '_', '.' and '-' starting and "
                    "ending with a letter, digit or '_'")
    if "--" in value or ".." in value or value.endswith(".git"):
        return "holds '--' or '..', or ends in .git, which the hub refuses"
    return None


def quoted(value: Any, limit: int = MAX_QUOTED) -> str:
    """repr(value), cut to `limit` characters with the length said, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ContractError(ValueError):
    """Values the contract refuses; `errors` holds every (field, message) pair found."""

    def __init__(self, errors: Iterable[tuple[str, str]], what: str = "invalid config"):
        self.errors = list(errors)
        lines = "\n".join(f"- {field}: {message}" for field, message in self.errors)
        super().__init__(f"{what} ({len(self.errors)}):\n{lines}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. The defaults are the local demo (tiny-llama on the demo data)."""

    model: str = "tiny-llama"
    tokenizer: str | None = None
    dataset: str = DEMO_DATASET
    dataset_format: str = "auto"
    dataset_split: str = "train"  # for hub data sets
    # The prepare_data stage's set (a directory or s3:// prefix) the trainer loads; None: the
    # trainer prepares the data set itself first, with the same function (a run by hand).
    prepared_data: str | None = None
    text_field: str | None = None
    prompt_field: str = "prompt"
    response_field: str = "response"
    method: str = "sft"  # METHODS
    chosen_field: str = "chosen"  # dpo: the preferred response
    rejected_field: str = "rejected"  # dpo: the dispreferred response
    dpo_beta: float = 0.1  # strength of the pull towards the reference (the KL penalty)
    dpo_loss: str = "sigmoid"  # DPO_LOSSES
    dpo_label_smoothing: float = 0.0  # sigmoid only: share of pairs assumed flipped (cDPO)
    dpo_reference: str = "model"  # DPO_REFERENCES
    prompt_template: str = "instruction"  # chat: the tokenizer's chat template
    packing: bool = False  # pack examples to seq_len; no attention across documents
    # Rows that are malformed, miss a field, are empty or exceed seq_len: skipped and counted,
    # or the first one fails the run at start (file and line in the error).
    bad_rows: str = "skip"
    seq_len: int = 128
    micro_batch: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_steps: int = 150
    epochs: float = 1.0
    seed: int = 1234
    strategy: str = "FULL_SHARD"
    shard_group_size: int = 0
    mixed_precision: str = "fp32"
    activation_checkpointing: str = "none"
    selective_ac: str = "op"  # selective: "op" (save matmul outputs) or k (every k-th block)
    activation_offload: bool = False  # saved activations to CPU memory
    cpu_offload: bool = False  # parameters, gradients and optimizer step on CPU (FSDP2 policy)
    compile: bool = False  # torch.compile each decoder block
    attention: str = "sdpa"  # ATTENTION; fa4 needs bf16/fp16 on sm_90/sm_100, no packing, tp 1
    tp_degree: int = 1  # tensor (and sequence) parallel degree: a 2-D mesh with FSDP
    float8: bool = False  # torchao float8 matmuls in the decoder blocks (CUDA capability >= 8.9)
    float8_recipe: str = "tensorwise"  # FLOAT8_RECIPES
    lora_rank: int = 0  # LoRA adapters of this rank (peft); 0: full fine-tune
    lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0
    # comma-separated Linear names in the blocks; auto: the family's (finetune_contract.families)
    lora_target_modules: str = LORA_TARGETS_DEFAULT
    quantize_base: str = "none"  # QUANTIZE_BASE; nf4: QLoRA (needs lora_rank > 0 and a GPU)
    eval_interval: int = 50
    eval_fraction: float = EVAL_FRACTION
    checkpoint_interval: int = 0
    keep_checkpoints: int = 2
    checkpoint_async: bool = False  # write (and upload) checkpoints in the background
    output_dir: str = "output"
    log_interval: int = 10
    metrics_port: int = 0  # rank 0 serves the per-step metrics to Prometheus here; 0: off
    max_grad_norm: float = 1.0
    # A rank with no step, eval or checkpoint for this long dumps its stacks and collective
    # traces, records a TrainingHang and exits, so torchrun restarts from the newest checkpoint.
    hang_timeout_s: int = HANG_TIMEOUT_S
    # A rank whose median step time exceeds the ranks' median by this fraction is a straggler.
    straggler_threshold: float = STRAGGLER_THRESHOLD
    # Evaluation (trainer/evaluate.py): a separate data set for it (same fields; else the eval
    # split), eval-split prompts to generate answers for, and benchmark tasks (EVAL_TASKS).
    eval_dataset: str | None = None
    sample_prompts: int = 4
    max_new_tokens: int = 16
    eval_tasks: str = ""  # comma-separated

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset", method_dataset(self.method, self.dataset))
        errors: list[tuple[str, str]] = []
        for field in dataclasses.fields(self):
            try:
                value = _coerce(field, getattr(self, field.name))
            except ValueError as exc:
                errors.append((field.name, str(exc)))
                continue
            object.__setattr__(self, field.name, value)
            problem = field_problem(field.name, value)
            if problem:
                errors.append((field.name, problem))
        if errors:
            raise ContractError(errors, "invalid trainer config")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_REQUIRED_STRINGS = ("model", "dataset", "output_dir", "prompt_field", "response_field",
                     "chosen_field", "rejected_field")


def method_dataset(method: str, dataset: str) -> str:
    """The data set a run of `method` reads: the demo's follows the method (instructions for
    sft, preference pairs for dpo), any other is the one given."""
    return DEMO_PREFERENCES if method == "dpo" and dataset == DEMO_DATASET else dataset


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with one well-typed field value on its own (choices, bounds, emptiness)."""
    if name in CHOICES and value not in CHOICES[name]:
        return f"unknown value {quoted(value)}; allowed: {', '.join(CHOICES[name])}"
    if name in BOUNDS and not isinstance(value, str):
        return BOUNDS[name].problem(value)
    if name in TEXTS and isinstance(value, str):
        problem = TEXTS[name].problem(value, quoted(value))
        if problem:
            return problem
    if name in _REQUIRED_STRINGS and not value.strip():
        return "must not be empty"
    if name == "eval_tasks":
        unknown = [task for task in eval_task_names(value) if task not in EVAL_TASKS]
        if unknown:
            return (f"unknown task {quoted(unknown[0])}; allowed (comma-separated, run offline "
                    f"from trainer/eval_tasks): {', '.join(EVAL_TASKS)}")
    return None


def eval_task_names(text: str) -> list[str]:
    """The task names of a comma-separated eval_tasks value."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _coerce(field: dataclasses.Field, value: Any) -> Any:
    """`value` as the field's type; strings (from the command line) are parsed."""
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if kind == "str | None":
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        kind = "str"
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {quoted(value)}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {quoted(value)}")
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"must be a number, got {quoted(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {quoted(value)}")
    if kind == "int":
        if value != int(value):
            raise ValueError(f"must be an integer, got {quoted(value)}")
        return int(value)
    return float(value)


def field_names() -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(TrainConfig))
