"""What a field's value may be: the sets of choices, the bounds and text rules the parameter table
(finetune_contract.parameters) names, the files a run writes, and `ContractError`."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
MIXED_PRECISION = ("bf16", "fp16", "fp32")
# auto: the planner (finetune_contract.planner) picks the fastest of the others that fits the GPU.
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
# The package that has them (its import name, and the pin that ran on the GPU: docs/trainer.md).
FA4_PACKAGE, FA4_MODULE = "flash-attn-4==4.0.0b36", "flash_attn"
# float8 tensor cores (torch._scaled_mm): sm_89 (Ada, L4) and sm_90 (Hopper) on.
FLOAT8_MIN_CAPABILITY = (8, 9)


def capability_text(capability: tuple[int, int]) -> str:
    """A CUDA compute capability as NVIDIA writes it: (8, 9) -> '8.9'."""
    return ".".join(map(str, capability))
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
# Every Linear of a Llama block: attention and MLP projections.
LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# lora_target_modules' default: the model family's set (finetune_contract.families).
LORA_TARGETS_DEFAULT = "auto"
# The demo data set, relative to the repository root (the trainer's working dir).
DEMO_DATASET = "trainer/demo/instructions.jsonl"
DEMO_PREFERENCES = "trainer/demo/preferences.jsonl"  # the demo data of method dpo
# The built-in models' tokenizer, which prepare_data encodes the demo data with.
DEMO_TOKENIZER = "trainer/demo/tokenizer"
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
CONN_ID_TEXT = Text(CONN_ID_MAX_LEN, CONN_ID, "an Airflow connection id (letters, digits and "
             "#!()-.:/\\_)")
PATH_TEXT = Text(PATH_MAX, PRINTABLE, "a path, s3:// URI or hub id without control characters "
             "(NUL, newline, tab)")
COLUMN_TEXT = Text(256, PRINTABLE, "a column name without control characters")
JSON_TEXT = Text(PATH_MAX, PRINTABLE, "JSON on one line, without control characters")
NAME_TEXT = Text(253, _DNS_SUBDOMAIN, "a Kubernetes name (lowercase letters, digits, '-' and '.')")
LABEL_TEXT = Text(63, _DNS_LABEL, "a DNS label (lowercase letters, digits and '-', starting and "
              "ending with a letter or digit)")
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
