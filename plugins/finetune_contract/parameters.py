"""Every run parameter, declared once: `PARAMETERS`.

Each `Parameter` carries its type (its default's), default, bounds or text rule, choices, the
trigger form's section, title and description, and the targets and methods it applies to.
Everything else is a view of this table, never a copy: the trigger form's Params and JSON
schema (finetune.params), the run config (finetune.config.RunConfig), validate's per-field
checks (`Parameter.problem`), the trainer's `TrainConfig` (finetune_contract.train_config),
what a target hands the trainer (finetune.trainer_config) and docs/parameters.md
(finetune.docs). Adding a parameter is one entry here plus the code that uses it;
tests/plugins/test_parameters.py fails when a name is declared anywhere else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from finetune_contract.fields import (
    ACTIVATION_CHECKPOINTING,
    ATTENTION,
    BAD_ROWS,
    COLUMN_TEXT,
    CONN_ID_TEXT,
    DATASET_FORMATS,
    DEMO_DATASET,
    DEMO_PREFERENCES,
    DPO_LOSSES,
    DPO_REFERENCES,
    ECR_REPOSITORY,
    EVAL_FRACTION,
    EVAL_TASKS,
    FLOAT8_MIN_CAPABILITY,
    FLOAT8_RECIPES,
    HANG_TIMEOUT_S,
    IMAGE_REFERENCE,
    JSON_TEXT,
    LABEL_TEXT,
    LORA_TARGETS_DEFAULT,
    METHODS,
    MIXED_PRECISION,
    NAME_TEXT,
    PATH_MAX,
    PATH_TEXT,
    PRINTABLE,
    PROMPT_TEMPLATES,
    QUANTIZE_BASE,
    STRAGGLER_THRESHOLD,
    STRATEGIES,
    Bounds,
    Text,
    capability_text,
    quoted,
)
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.presets import PRESET_DISPLAY, PRESET_NAMES

TARGETS = ("local", "eks")
# torchrun rendezvous backends the training operator passes on (elasticPolicy.rdzvBackend).
RDZV_BACKENDS = ("etcd-v2", "etcd", "c10d")
ETCD_RESETS = ("keys", "restart")
# What runs the trainer on eks: Kubeflow's training operator v1 (PyTorchJob) or Kubeflow Trainer
# v2 (TrainJob on a ClusterTrainingRuntime, on JobSet).
LAUNCHERS = ("pytorchjob", "trainjob")
# How the eks target provides the trainer image (plugins/finetune/targets/eks/image_build.py).
IMAGE_BUILDERS = ("buildkit", "codebuild", "buildah", "prebuilt")
# Where the prepare_data stage encodes the data set on eks: the Airflow worker, or a CPU pod of
# its own in the cluster; the local target's is this machine.
PREPARE_ON = ("worker", "pod")
# The node group's capacity (EKS's capacityType: ON_DEMAND, SPOT, CAPACITY_BLOCK), and what a run
# does when the nodes do not come in time.
CAPACITY_TYPES = ("on-demand", "spot", "capacity-block")
CAPACITY_FALLBACKS = ("fail", "on-demand")
EKS, LOCAL = ("eks",), ("local",)
DPO, SFT = ("dpo",), ("sft",)
# EKS's cluster and node group name rules.
EKS_NAME = r"[0-9A-Za-z][A-Za-z0-9_-]*"
EKS_NAME_WHAT = "(letters, digits, '-' and '_', starting with a letter or digit)"
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Parameter:
    """One run parameter. Its type is its default's (bool, int, float or str)."""

    name: str
    default: Any
    section: str  # the trigger form's section, in the order of first use
    title: str
    description: str
    choices: tuple[Any, ...] | None = None
    display: Mapping[str, str] | None = None  # the form's names of the choices
    bounds: Bounds | None = None  # numbers
    text: Text | None = None  # text without a fixed set of values: length and characters
    # A text that must not be empty; by default every text with a default (an optional one's
    # default is "", not set) and no fixed choices.
    required: bool | None = None
    secret: bool = False  # never quoted in a message or log: it may be (or hold) a credential
    targets: tuple[str, ...] = TARGETS
    methods: tuple[str, ...] = METHODS
    trainer: bool = True  # a field of the trainer's TrainConfig
    form: bool = True  # set by the run's conf; False: by a stage (prepared_data)
    # A sweep's own (llm_finetune_sweep): only the sweep DAG's form shows it, and a trial's conf
    # cannot set it (finetune.sweep); a single run keeps its default.
    sweep: bool = False
    rule: Callable[[Any], str | None] | None = None  # what the text rule cannot say

    def __post_init__(self) -> None:
        if type(self.default) not in _JSON_TYPES:
            raise TypeError(f"{self.name}: a default of type {type(self.default).__name__}")
        if self.display is not None:
            object.__setattr__(self, "display", MappingProxyType(dict(self.display)))
        if self.required is None:
            object.__setattr__(self, "required", self.type is str and self.default != ""
                               and self.choices is None)

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def json_type(self) -> str:
        return _JSON_TYPES[self.type]

    @property
    def optional(self) -> bool:
        """A text that may stay empty ("not set"): the trainer gets None for it."""
        return self.type is str and self.default == ""

    def shown(self, value: Any) -> str:
        """The value as a message may show it: cut, and never a secret's."""
        return "a value (not shown)" if self.secret else quoted(value)

    def type_problem(self, value: Any) -> str | None:
        """What is wrong with a value's JSON type (a conf's, the form's), or None."""
        if self.type is str:
            return None if isinstance(value, str) else \
                f"must be a string, got {self.shown(value)}"
        if self.type is bool:
            return None if isinstance(value, bool) else \
                f"must be true or false, got {self.shown(value)}"
        if isinstance(value, bool):
            return f"must be a {self.json_type}, got {value!r}"
        if self.type is int:
            if isinstance(value, int):
                return None
            positive = self.bounds is not None and (self.bounds.minimum or 0) > 0
            return (f"must be a {'positive ' if positive else ''}integer, got "
                    f"{self.shown(value)}")
        if isinstance(value, int | float) and math.isfinite(value):
            return None
        return f"must be a finite number, got {self.shown(value)}"

    def coerce(self, value: Any) -> Any:
        """A value from JSON or the command line as this parameter's type (strings parsed; an
        optional text's "", none or null as None); ValueError naming what is wrong."""
        if self.optional and (value is None or (isinstance(value, str) and value.lower()
                                                in ("", "none", "null"))):
            return None
        if self.type is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError(f"must be true or false, got {self.shown(value)}")
            return value
        if self.type is str:
            if not isinstance(value, str):
                raise ValueError(f"must be a string, got {self.shown(value)}")
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"must be a number, got {self.shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {self.shown(value)}")
        if self.type is int:
            if value != int(value):
                raise ValueError(f"must be an integer, got {self.shown(value)}")
            return int(value)
        return float(value)

    def problem(self, value: Any) -> str | None:
        """What is wrong with a well-typed value on its own: its choices, bounds, length and
        characters, emptiness; None when it is allowed."""
        if value is None and self.optional:
            return None
        if self.choices is not None and value not in self.choices:
            return f"unknown value {self.shown(value)}; allowed: " + \
                ", ".join(str(v) for v in self.choices)
        if self.bounds is not None:
            return self.bounds.problem(value)
        if self.text is not None:
            problem = self.text.problem(value, self.shown(value))
            if problem:
                return problem
        if self.required and not value.strip():
            return "must not be empty"
        return self.rule(value) if self.rule is not None else None


def eval_task_names(text: str) -> list[str]:
    """The task names of a comma-separated eval_tasks value."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _unknown_tasks(text: str) -> str | None:
    unknown = [task for task in eval_task_names(text) if task not in EVAL_TASKS]
    if unknown:
        return (f"unknown task {quoted(unknown[0])}; allowed (comma-separated, run offline from "
                f"trainer/eval_tasks): {', '.join(EVAL_TASKS)}")
    return None


P = Parameter
PARAMETERS: tuple[Parameter, ...] = (
    P('preset', 'none', 'Preset', 'Preset',
      'Settings known to fit a model on an instance type (plugins/finetune_contract/presets.py). '
      'Its values replace the defaults below; a field you change here overrides the preset.',
      choices=PRESET_NAMES, display=PRESET_DISPLAY, trainer=False),
    P('target', 'local', 'Where to run', 'Target',
      '`local`: this machine is the cluster (torchrun, local etcd). `eks`: Amazon EKS with the '
      'Kubeflow training operator.',
      choices=TARGETS,
      display={'local': 'local (this machine)', 'eks': 'Amazon EKS'}, trainer=False),
    P('model', 'tiny-llama', 'Model', 'Model',
      "A built-in config trained from scratch (" + ", ".join(BUILTIN_MODELS) + "), a directory "
      "with Hugging Face model files, or a Hugging Face hub id (org/name).",
      text=PATH_TEXT),
    P('tokenizer', '', 'Model', 'Tokenizer',
      "Directory with tokenizer files. Empty: the model's own (the demo tokenizer for built-in "
      'configs).',
      text=PATH_TEXT),
    P('dataset', DEMO_DATASET, 'Data', 'Data set',
      'A jsonl, json, parquet or csv file or a directory of them (relative paths are from the '
      'repository root), an s3://bucket/key URI (file or prefix), or a hub name (org/name).',
      text=PATH_TEXT),
    P('dataset_format', 'auto', 'Data', 'Data set format',
      '`auto` picks the file format from the extension. Whatever the format, rows holding a '
      'conversation (a messages or conversations column) are found by themselves: see '
      'messages_field.',
      choices=DATASET_FORMATS),
    P('dataset_split', 'train', 'Data', 'Split',
      'Split of a Hugging Face hub data set (files and s3:// use all their rows).',
      text=Text(128, r"[\w.\[\]:%+-]+", "a split name (letters, digits, '_', '.'; a "
                "slice such as train[:10%])")),
    P('text_field', '', 'Data', 'Text field',
      'Field holding plain text to train on. Empty: use the prompt and response fields.',
      text=COLUMN_TEXT),
    P('prompt_field', 'prompt', 'Data', 'Prompt field',
      'Field holding the instruction; the loss is not computed on it.',
      text=COLUMN_TEXT),
    P('response_field', 'response', 'Data', 'Response field',
      'Field holding the answer the model learns to give.',
      text=COLUMN_TEXT),
    P('messages_field', '', 'Data', 'Messages field',
      "Field holding each row's conversation: a list of messages, OpenAI's {role, content} "
      "(assistant tool_calls and tool results kept, a row's `tools` passed on) or ShareGPT's "
      "{from, value}. It is rendered with the tokenizer's chat template (which it needs), the "
      'loss on every assistant turn and only there. Empty: a messages or conversations column '
      'is used when the rows lack the prompt or the response field. A conversation longer '
      'than seq_len is a bad row (bad_rows: skipped whole and counted, or the run fails '
      'naming its line), never cut at a turn.',
      text=COLUMN_TEXT, methods=SFT),
    P('prompt_template', 'instruction', 'Data', 'Prompt template',
      "instruction: '### Instruction: ... ### Response:'; chat: the tokenizer's chat template "
      '(user = prompt, assistant = response).',
      choices=PROMPT_TEMPLATES),
    P('mixture', '', 'Data', 'Mixture',
      'Several data sets in one run: a JSON list of sources, each an object with its `dataset` '
      'and a `weight` (its share of the training examples; 1 when neither is given) or `rows` '
      '(exactly that many training examples, repeated when the source has fewer), and, where '
      'they differ from the fields above, `name`, `dataset_format`, `dataset_split`, '
      '`text_field`, `prompt_field`, `response_field`, `messages_field`, `prompt_template`, '
      '`chosen_field` and `rejected_field`. E.g. [{"dataset": "ours.jsonl", "weight": 3}, '
      '{"dataset": "org/chat", "weight": 1}]. Weighted sources are drawn without repeating a '
      'row until the first runs out; the draw follows seed. Each source keeps its own held-out '
      'split (eval loss per source). JSON on one line. Empty: the data set above alone.',
      text=JSON_TEXT),
    P('packing', False, 'Data', 'Packing',
      'Pack examples into full sequences; no token attends to another example.'),
    P('bad_rows', 'skip', 'Data', 'Bad rows',
      'Rows that are not JSON, miss a field, hold a non-string or empty one, or are longer than '
      'seq_len tokens (a conversation is skipped whole, never cut at a turn), or a conversation '
      'the chat template cannot render: `skip` skips them and counts them by reason in the '
      'report; `error` fails the run at the first one, naming its file and line.',
      choices=BAD_ROWS),
    P('eval_fraction', EVAL_FRACTION, 'Data', 'Eval fraction',
      'The share of the usable rows held out for the eval loss (at least micro_batch rows).',
      bounds=Bounds(maximum=0.99, exclusive_minimum=0)),
    P('prepared_data', '', 'Data', 'Prepared data',
      "The prepare_data stage's encoded set (a directory or s3:// prefix) the trainer loads; "
      'set by that stage. Empty: the trainer prepares the data set itself first (a run by '
      'hand).',
      text=PATH_TEXT, form=False),
    P('max_skipped_fraction', 0.1, 'Data', 'Max skipped fraction',
      "The share of the data set's rows that may be skipped as bad (bad_rows skip) before the "
      'run fails at prepare_data, before any GPU is up, naming the count and the longest rows. '
      '1: never fail for skipped rows.',
      bounds=Bounds(minimum=0, maximum=1), trainer=False),
    P('method', 'sft', 'Preference tuning (DPO)', 'Method',
      'sft: learn the responses (next-token loss). dpo: direct preference optimisation on rows '
      'of prompt, chosen and rejected response; left at the demo data set it trains on '
      f'{DEMO_PREFERENCES}. Not with packing, text_field or tp_degree > 1.',
      choices=METHODS),
    P('chosen_field', 'chosen', 'Preference tuning (DPO)', 'Chosen field',
      'dpo: the field holding the preferred response.',
      text=COLUMN_TEXT, methods=DPO),
    P('rejected_field', 'rejected', 'Preference tuning (DPO)', 'Rejected field',
      'dpo: the field holding the dispreferred response.',
      text=COLUMN_TEXT, methods=DPO),
    P('dpo_beta', 0.1, 'Preference tuning (DPO)', 'DPO beta',
      'How strongly the policy is held to the reference (the KL penalty); the rewards are beta '
      'times the policy-minus-reference log-ratio.',
      bounds=Bounds(maximum=100, exclusive_minimum=0), methods=DPO),
    P('dpo_loss', 'sigmoid', 'Preference tuning (DPO)', 'DPO loss',
      "sigmoid: DPO (-log sigmoid of beta times the log-ratio margin); ipo: IPO's squared loss "
      'on the per-token averaged margin.',
      choices=DPO_LOSSES, methods=DPO),
    P('dpo_label_smoothing', 0.0, 'Preference tuning (DPO)', 'DPO label smoothing',
      'sigmoid only: the share of pairs assumed mislabelled (conservative DPO).',
      bounds=Bounds(minimum=0, maximum=0.49), methods=DPO),
    P('dpo_reference', 'model', 'Preference tuning (DPO)', 'DPO reference',
      'model: the frozen initial weights, sharded like the policy, without optimizer state '
      '(with LoRA: the base with its adapters disabled, no copy). precompute: the initial '
      'weights score every training pair once before step 1 and no reference is held (less '
      'memory, one extra forward pass over the pairs); the same losses as model.',
      choices=DPO_REFERENCES, methods=DPO),
    P('nodes', 1, 'Resources', 'Nodes',
      'Nodes (local: torchrun agents on this machine).',
      bounds=Bounds(minimum=1, maximum=128)),
    P('min_nodes', 0, 'Resources', 'Minimum nodes',
      'Elastic: when a node is lost and none comes back within node_wait_s, the training goes '
      'on with the nodes it has, down to this many (torchrun --nnodes min_nodes:nodes; the '
      "checkpoint is resharded to the smaller world and grad_accum raised so the global batch "
      'stays the same), and grows back at the next restart when nodes return. Each node lost '
      'is a restart (max_restarts). 0: nodes (not elastic).',
      bounds=Bounds(minimum=0, maximum=128)),
    P('node_wait_s', 300, 'Resources', 'Lost node wait (s)',
      'Elastic runs: how long the training waits for a lost node to come back (or for more '
      'nodes to join a restart) before it goes on with the nodes it has.',
      bounds=Bounds(minimum=1, maximum=86400), trainer=False),
    P('max_preemptions', 10, 'Resources', 'Max preemptions',
      'A notice to the nodes (SIGTERM: a spot reclaim, a drain, an eviction) ends the step in '
      'progress, saves it and starts the training again from it, without counting against '
      'max_restarts; one before the first step (while the model loads) counts here too. A run '
      'noticed more often than this fails, saying so.',
      bounds=Bounds(minimum=0, maximum=100000), trainer=False),
    P('procs_per_node', 2, 'Resources', 'Processes per node',
      'Training processes per node: one per GPU, or CPU processes on the local target.',
      bounds=Bounds(minimum=1, maximum=64), trainer=False),
    P('rdzv_endpoint', '', 'Resources', 'etcd endpoint',
      "host:port of an etcd (v2 API) for torchrun's rendezvous. Empty: the local target starts "
      "its own etcd, or uses torch's c10d store when etcd is not installed.",
      text=Text(263, r"\S+", "host:port without spaces"), secret=True, targets=LOCAL,
      trainer=False),
    P('strategy', 'FULL_SHARD', 'Parallelism', 'Sharding strategy',
      'FSDP2 sharding: FULL_SHARD (params, grads, optimizer state sharded), SHARD_GRAD_OP '
      '(params kept after forward), HYBRID_SHARD (shard within a group, replicate across), '
      'NO_SHARD (replicate, like DDP). On one GPU no FSDP runs (bf16 copies of fp32 masters; '
      'FULL_SHARD and HYBRID_SHARD free each block\'s copies after use).',
      choices=STRATEGIES,
      display={'FULL_SHARD': 'FULL_SHARD (ZeRO-3)', 'SHARD_GRAD_OP': 'SHARD_GRAD_OP (ZeRO-2)',
               'HYBRID_SHARD': 'HYBRID_SHARD (HSDP)', 'NO_SHARD': 'NO_SHARD (replicate)'}),
    P('shard_group_size', 0, 'Parallelism', 'Shard group size',
      'HYBRID_SHARD only: processes per shard group; 0 means processes per node.',
      bounds=Bounds(minimum=0, maximum=8192)),
    P('tp_degree', 1, 'Parallelism', 'Tensor parallel degree',
      'Tensor (and sequence) parallel processes per model replica, for long sequences; FSDP '
      'shards across the rest. Must divide the processes per node.',
      bounds=Bounds(minimum=1, maximum=64)),
    P('mixed_precision', 'fp32', 'Memory and speed', 'Mixed precision',
      'bf16: bf16 compute with fp32 master weights and fp32 gradient reduction (GPUs). fp16: '
      'fp16 compute with a gradient scaler. fp32: full precision (the fast choice on CPUs).',
      choices=MIXED_PRECISION),
    P('activation_checkpointing', 'none', 'Memory and speed', 'Activation checkpointing',
      'full: recompute every decoder block in backward; selective: see below.',
      choices=ACTIVATION_CHECKPOINTING),
    P('selective_ac', 'op', 'Memory and speed', 'Selective checkpointing',
      'With selective checkpointing: `op` keeps matmul outputs and recomputes the rest, or a '
      'number k checkpoints every k-th block.',
      text=Text(16, r"\w+", "op or a positive integer k")),
    P('activation_offload', False, 'Memory and speed', 'Offload activations',
      'Keep saved activations in CPU memory until backward. With full checkpointing (and '
      'tp_degree 1) each block\'s input waits there and its MLP runs in 32,768-token slices: '
      'the long-context setting (docs/trainer.md, Long context).'),
    P('cpu_offload', False, 'Memory and speed', 'Offload parameters',
      'Parameters, gradients and the optimizer step on the CPU (FSDP2 CPU offload).'),
    P('compile', False, 'Memory and speed', 'torch.compile',
      'Compile each decoder block with torch.compile.'),
    P('attention', 'sdpa', 'Memory and speed', 'attention kernel',
      'sdpa: cuDNN flash attention through torch (any GPU, and CPUs); fa4: FlashAttention 4 '
      "(flash-attn-4's kernels, faster on H100/H200 and B200: compute capability 9.0 or 10.0), "
      'with mixed precision bf16 or fp16 and tp_degree 1; packed rows run its varlen kernel '
      '(each document attends only to itself, no mask), except on models with sliding windows '
      'or soft-capped scores. Needs the flash-attn-4 package where the trainer runs: the image '
      'this project builds does not install it (validate says so; give a prebuilt image).',
      choices=ATTENTION),
    P('float8', False, 'Memory and speed', 'float8 matmuls',
      "The decoder blocks' Linear layers compute in float8 (torchao; weights all-gathered in "
      f'float8). Needs GPUs of compute capability {capability_text(FLOAT8_MIN_CAPABILITY)} or '
      'later (L4, H100, H200) and mixed precision bf16; reported by tokens/s (MFU assumes the '
      'bf16 peak).'),
    P('float8_recipe', 'tensorwise', 'Memory and speed', 'float8 scaling',
      'tensorwise: one scale per tensor, weights all-gathered in float8 under FSDP (fastest); '
      "rowwise: one scale per row of each operand (closer to bf16's loss, weights all-gathered "
      'in bf16). Only with float8.',
      choices=FLOAT8_RECIPES),
    P('lora_rank', 0, 'LoRA', 'LoRA rank',
      'Train LoRA adapters of this rank instead of all weights (peft); 0: full fine-tune. The '
      'exported model has the adapters merged in; model/adapter/ holds them alone.',
      bounds=Bounds(minimum=0, maximum=4096)),
    P('quantize_base', 'none', 'LoRA', 'Quantize the base (QLoRA)',
      'nf4: keep the frozen base weights of the decoder blocks in 4-bit NormalFloat (torchao), '
      "the LoRA adapters in the compute dtype: QLoRA, about a quarter of the base's bf16 "
      'memory. Needs lora_rank > 0 and GPUs; not with cpu_offload.',
      choices=QUANTIZE_BASE),
    P('lora_alpha', 16.0, 'LoRA', 'LoRA alpha',
      "The adapters' output is scaled by alpha / rank.",
      bounds=Bounds(maximum=65536, exclusive_minimum=0)),
    P('lora_dropout', 0.0, 'LoRA', 'LoRA dropout',
      "Dropout on the adapters' input.",
      bounds=Bounds(minimum=0, maximum=0.99)),
    P('lora_target_modules', LORA_TARGETS_DEFAULT, 'LoRA', 'LoRA target modules',
      "Comma-separated names of the decoder blocks' Linear layers that get adapters; auto: the "
      "model family's set (all attention and MLP projections; docs/trainer.md, Model families).",
      text=Text(4096, PRINTABLE, "comma-separated module names")),
    P('seq_len', 128, 'Training', 'Sequence length',
      'Tokens per sequence. An example longer than this is never truncated: bad_rows decides '
      '(skip: skipped and counted in the report; error: the run fails at validate naming its '
      'line). Beyond the model\'s positions its RoPE is stretched (default, linear and llama3 '
      'types); what fits the GPU is the planner\'s to say at validate.',
      bounds=Bounds(minimum=8, maximum=1_048_576)),
    P('micro_batch', 8, 'Training', 'Micro-batch',
      'Sequences per process per forward pass.',
      bounds=Bounds(minimum=1, maximum=4096)),
    P('grad_accum', 1, 'Training', 'Gradient accumulation',
      'Micro-batches per optimizer step.',
      bounds=Bounds(minimum=1, maximum=4096)),
    P('lr', 3e-3, 'Training', 'Learning rate',
      'Peak AdamW learning rate (linear warmup, then cosine decay).',
      bounds=Bounds(maximum=1, exclusive_minimum=0)),
    P('warmup_steps', 10, 'Training', 'Warmup steps',
      'Optimizer steps of linear learning-rate warmup.',
      bounds=Bounds(minimum=0, maximum=1_000_000)),
    P('min_lr_ratio', 0.1, 'Training', 'Final learning rate ratio',
      'The cosine decay ends at lr times this at the last step; 0: at zero.',
      bounds=Bounds(minimum=0, maximum=1)),
    P('weight_decay', 0.0, 'Training', 'Weight decay',
      "AdamW's decoupled weight decay, on the weight matrices (not on norms and biases).",
      bounds=Bounds(minimum=0, maximum=10)),
    P('max_grad_norm', 1.0, 'Training', 'Gradient clipping',
      'The gradients are scaled down to this global L2 norm before each optimizer step when '
      'their norm is larger.',
      bounds=Bounds(maximum=1e6, exclusive_minimum=0)),
    P('max_steps', 150, 'Training', 'Steps',
      'Optimizer steps to train; 0 means train for `epochs` instead.',
      bounds=Bounds(minimum=0, maximum=10_000_000)),
    P('epochs', 1.0, 'Training', 'Epochs',
      'Passes over the data set, used when steps is 0.',
      bounds=Bounds(maximum=1000, exclusive_minimum=0)),
    P('seed', 1234, 'Training', 'Seed',
      'Seed for initialisation and data order.',
      bounds=Bounds(minimum=0, maximum=2**31 - 1)),
    P('eval_interval', 50, 'Training', 'Eval interval',
      'Optimizer steps between eval-loss measurements (also at start and end); 0: start and end '
      'only.',
      bounds=Bounds(minimum=0, maximum=10_000_000)),
    P('checkpoint_interval', 50, 'Checkpoints', 'Checkpoint interval',
      'Optimizer steps between sharded checkpoints; 0: no checkpoints. A restarted run resumes '
      'from the newest.',
      bounds=Bounds(minimum=0, maximum=10_000_000)),
    P('checkpoint_async', False, 'Checkpoints', 'Async checkpoints',
      'Write checkpoints in the background from a copy in CPU memory while training goes on; '
      'each is made complete (uploaded, for S3) when written, before the next one starts.'),
    P('keep_checkpoints', 2, 'Checkpoints', 'Checkpoints kept',
      'The newest checkpoints kept; an older one is deleted once a newer one is complete.',
      bounds=Bounds(minimum=1, maximum=1000)),
    P('max_restarts', 0, 'Checkpoints', 'Max restarts',
      'How often torchrun restarts failed workers before the run fails.',
      bounds=Bounds(minimum=0, maximum=100), trainer=False),
    P('hang_timeout_s', HANG_TIMEOUT_S, 'Checkpoints', 'Hang timeout (s)',
      'A rank with no training step, eval or checkpoint for this long (a hung collective, a '
      'stuck rank) writes its stacks and collective traces to hangs/, records a TrainingHang '
      'naming the rank that stopped, and exits: torchrun restarts the workers from the newest '
      'checkpoint (max_restarts). Longer than the slowest step, eval, save or export. 0: off.',
      bounds=Bounds(minimum=0, maximum=604800)),
    P('straggler_threshold', STRAGGLER_THRESHOLD, 'Metrics', 'Straggler threshold',
      "A rank whose median step time (without its wait for the others at the step's start) "
      'exceeds the median of all ranks by this fraction is flagged in the report (0.2: 20% '
      'slower).',
      bounds=Bounds(maximum=100, exclusive_minimum=0)),
    P('log_interval', 10, 'Metrics', 'Log interval',
      "Optimizer steps between rank 0's progress lines in the log (every step goes to "
      'metrics.jsonl).',
      bounds=Bounds(minimum=1, maximum=1_000_000)),
    P('eval_dataset', '', 'Evaluation', 'Eval data set',
      'A data set for the evaluate stage (same forms and fields as the training data set). '
      "Empty: the training data set's held-out eval split.",
      text=PATH_TEXT),
    P('sample_prompts', 4, 'Evaluation', 'Sample prompts',
      'Prompts of the eval set the model answers (greedy) in the report, beside the reference '
      'answers; 0: none.',
      bounds=Bounds(minimum=0, maximum=100)),
    P('max_new_tokens', 16, 'Evaluation', 'Max new tokens',
      'Tokens generated per sample prompt at most.',
      bounds=Bounds(minimum=1, maximum=4096)),
    P('eval_tasks', ','.join(EVAL_TASKS), 'Evaluation', 'Benchmark tasks',
      'lm-evaluation-harness tasks run offline on task data shipped in trainer/eval_tasks, '
      'comma-separated (' + ', '.join(EVAL_TASKS) + '); empty: none.',
      text=Text(4096, PRINTABLE, "comma-separated task names"), required=False,
      rule=_unknown_tasks),
    P('promotion_metric', 'eval_loss', 'Evaluation', 'Promotion metric',
      "What the model must beat the champion (the DAG's last promoted model) on, both measured "
      "on this run's eval set: eval_loss or perplexity (lower is better), or a task's metric as "
      '<task>.<metric>, e.g. demo_instructions.acc (higher is better).',
      text=Text(256, r"[\w.-]+", "a metric name (eval_loss, perplexity or "
                "<task>.<metric>)"), trainer=False),
    P('promotion_margin', 0.0, 'Evaluation', 'Promotion margin',
      "The model is promoted when it beats the champion by more than this (in the metric's "
      'units), or when there is no champion.',
      bounds=Bounds(minimum=0, maximum=1000000.0), trainer=False),
    P('output_dir', 'runs', 'Output', 'Output location',
      "Directory for the run's outputs (relative paths are from the repository root); each run "
      'writes to <output>/<run id>/ (the trainer run by hand writes into it directly).',
      text=PATH_TEXT),
    P('cluster_name', '', 'EKS', 'EKS cluster',
      'Target eks: name of the Amazon EKS cluster.',
      text=Text(100, EKS_NAME, "an EKS cluster name " + EKS_NAME_WHAT), targets=EKS, trainer=False),
    P('nodegroup', '', 'EKS', 'Node group',
      'Target eks: the managed node group of GPU nodes the run scales up and gives back.',
      text=Text(63, EKS_NAME, "an EKS node group name " + EKS_NAME_WHAT), targets=EKS,
      trainer=False),
    P('instance_type', 'p4de.24xlarge', 'EKS', 'Instance type',
      "The node group's instance type: GPUs, EFA interfaces, CPU and memory per node. A spot "
      'node group of several types of the same GPUs: the smallest, whose pods every node holds.',
      choices=tuple(INSTANCE_TYPES), targets=EKS, trainer=False),
    P('namespace', 'default', 'EKS', 'Namespace',
      'Kubernetes namespace of the PyTorchJob, its ConfigMap and the etcd service.',
      text=LABEL_TEXT, targets=EKS, trainer=False),
    P('image', '', 'EKS', 'Trainer image',
      'A prebuilt trainer image (registry/repository:tag), used as is (verified when in ECR). '
      'Empty: the pipeline builds the image from trainer/, the contract and data packages of '
      'plugins/ and containers/ with image_builder.',
      text=Text(255 + 129 + 72, IMAGE_REFERENCE, "an image reference ([registry[:port]/]"
                "repository[:tag][@sha256:digest]; path parts lowercase letters and digits "
                "joined by '.', '_' or '-', no '..')"), targets=EKS, trainer=False),
    P('image_builder', 'buildkit', 'EKS', 'Image builder',
      'How the image is built when `image` is empty: buildkit (a rootless BuildKit Job in the '
      'cluster), codebuild (AWS CodeBuild) or buildah (built and pushed by the task where '
      'Airflow runs; buildah installed there); prebuilt requires `image`. The tag is the '
      'content hash of what the image holds (trainer/, containers/, the contract and data '
      'packages): a tag already in ECR is not built again.',
      choices=IMAGE_BUILDERS, targets=EKS, trainer=False),
    P('image_repository', 'finetune-trainer', 'EKS', 'ECR repository',
      'ECR repository the built image is pushed to; created when missing (scan on push, '
      'immutable tags).',
      text=Text(256, rf"(?=.{{2}}){ECR_REPOSITORY}", "an ECR repository name (2-256 "
                "lowercase letters, digits, '.', '_', '-', '/')"), targets=EKS, trainer=False),
    P('build_bucket', '', 'EKS', 'Build context bucket',
      'S3 bucket the build context is uploaded to (under finetune-build-context/). Required '
      'when the image is built.',
      text=Text(63, r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", "an S3 bucket name"), targets=EKS,
      trainer=False),
    P('codebuild_role', '', 'EKS', 'CodeBuild role',
      'image_builder codebuild: ARN of the IAM role the CodeBuild project runs as (reads the '
      'context from S3, pushes to ECR).',
      text=Text(2048, r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+", "an IAM role ARN "
                "(arn:aws:iam::<account>:role/<name>)"), targets=EKS, trainer=False),
    P('capacity_type', 'on-demand', 'EKS', 'Capacity type',
      "What the node group's nodes are (its capacityType, checked at scale_up): on-demand; "
      'spot (about a third of the price, reclaimed with two minutes\' notice: validate '
      'refuses a run whose step and save do not fit the notice, and a notice saves the step '
      "and starts the run again from it); capacity-block (an EC2 Capacity Block for ML's "
      'reserved GPUs).',
      choices=CAPACITY_TYPES, targets=EKS, trainer=False),
    P('capacity_wait_s', 1800, 'EKS', 'Capacity wait (s)',
      "scale_up waits this long for the run's nodes to be Ready (spot and GPU capacity may "
      'be short); then capacity_fallback decides.',
      bounds=Bounds(minimum=60, maximum=86400), targets=EKS, trainer=False),
    P('capacity_fallback', 'fail', 'EKS', 'Capacity fallback',
      'When capacity_wait_s passes without the nodes: fail (teardown gives back what came), '
      'or on-demand: the nodes from fallback_nodegroup (on-demand, the same instance type) '
      'instead, the first node group given back.',
      choices=CAPACITY_FALLBACKS, targets=EKS, trainer=False),
    P('fallback_nodegroup', '', 'EKS', 'Fallback node group',
      'capacity_fallback on-demand: the on-demand managed node group of the same instance '
      'type the run scales up when the first one has no capacity.',
      text=Text(63, EKS_NAME, "an EKS node group name " + EKS_NAME_WHAT), targets=EKS,
      trainer=False),
    P('max_nodes', 16, 'EKS', 'Node cap',
      'The node group is never scaled above this many nodes.',
      bounds=Bounds(minimum=1, maximum=1024), targets=EKS, trainer=False),
    P('aws_conn_id', 'aws_default', 'EKS', 'AWS connection',
      'Airflow connection for AWS (region, credentials or role). Empty: boto3 finds the '
      "credentials itself (the worker's IAM role, its environment).",
      text=CONN_ID_TEXT, required=False, targets=EKS, trainer=False),
    P('kubernetes_conn_id', '', 'EKS', 'Kubernetes connection',
      'Optional Airflow Kubernetes connection (kubeconfig). Empty: a token for the EKS cluster '
      'is minted from the AWS connection.',
      text=CONN_ID_TEXT, targets=EKS, trainer=False),
    P('etcd_service', 'etcd', 'EKS', 'etcd service',
      "Service (port 2379, v2 API) in the namespace for torchrun's etcd rendezvous.",
      text=LABEL_TEXT, targets=EKS, trainer=False),
    P('etcd_reset', 'keys', 'EKS', 'etcd reset',
      "keys: delete this run's rendezvous keys; restart: restart the etcd pod (every key is "
      'lost).',
      choices=ETCD_RESETS, targets=EKS, trainer=False),
    P('rdzv_backend', 'etcd-v2', 'EKS', 'Rendezvous backend',
      'torchrun rendezvous: etcd-v2 or etcd (the etcd service), or c10d (on worker 0).',
      choices=RDZV_BACKENDS, targets=EKS, trainer=False),
    P('launcher', 'pytorchjob', 'EKS', 'Launcher',
      'pytorchjob: a Kubeflow PyTorchJob (training operator v1). trainjob: a Kubeflow Trainer '
      "v2 TrainJob on the project's ClusterTrainingRuntime (containers/k8s/trainjob- "
      'runtime.yaml): a static c10d rendezvous on node 0 (rdzv_backend c10d), restarts by '
      "JobSet's failure policy (max_restarts 0).",
      choices=LAUNCHERS,
      display={'pytorchjob': 'PyTorchJob (training operator v1)',
               'trainjob': 'TrainJob (Kubeflow Trainer v2)'}, targets=EKS, trainer=False),
    P('service_account', '', 'EKS', 'Service account',
      'Kubernetes service account of the training pods, e.g. one bound to an IAM role (IRSA) '
      "that reads the data set and writes the outputs on S3. Empty: the namespace's default.",
      text=NAME_TEXT, targets=EKS, trainer=False),
    P('volumes', '', 'EKS', 'Volumes',
      'PersistentVolumeClaims mounted in every training pod, as claim:/mount/path pairs '
      'separated by commas (FSx for Lustre, EFS): absolute model, tokenizer, data set and '
      'output paths must lie under one of them.',
      text=Text(PATH_MAX, PRINTABLE, "claim:/mount/path pairs without control characters"),
      targets=EKS, trainer=False),
    P('prepare_on', 'worker', 'EKS', 'Prepare data on',
      'Where prepare_data encodes the data set on eks: worker (the Airflow worker, which needs '
      'datasets and transformers and the cores to encode) or pod (a CPU pod of its own: the '
      'trainer image, built first when missing, on a node of prepare_node_selector with '
      "prepare_cpu cores and prepare_memory_gib of memory; it writes the set to the run's S3 "
      'output_dir, which pod requires). Either way before any GPU node is up.',
      choices=PREPARE_ON,
      display={'worker': 'the Airflow worker', 'pod': 'a CPU pod in the cluster'},
      targets=EKS, trainer=False),
    P('prepare_node_selector', '', 'EKS', 'Prepare pod node selector',
      'prepare_on pod: the node labels the pod must run on, as label=value pairs separated by '
      'commas (e.g. eks.amazonaws.com/nodegroup=cpu). Empty: any node without a taint (the GPU '
      "nodes' taint keeps it off them).",
      text=Text(4096, PRINTABLE, "label=value pairs separated by commas"), targets=EKS,
      trainer=False),
    P('prepare_cpu', 4, 'EKS', 'Prepare pod CPUs',
      "prepare_on pod: the cores the pod requests, and the encoding's processes.",
      bounds=Bounds(minimum=1, maximum=192), targets=EKS, trainer=False),
    P('prepare_memory_gib', 16, 'EKS', 'Prepare pod memory (GiB)',
      'prepare_on pod: the memory the pod requests and is limited to, in GiB.',
      bounds=Bounds(minimum=1, maximum=2048), targets=EKS, trainer=False),
    P('queue_name', '', 'EKS', 'Kueue queue',
      'A Kueue LocalQueue: the job is created suspended with the kueue.x-k8s.io/queue-name '
      'label, and starts when Kueue admits it. Empty: no Kueue.',
      text=NAME_TEXT, targets=EKS, trainer=False),
    P('hf_token_secret', '', 'EKS', 'Hugging Face token secret',
      'Kubernetes Secret with a Hugging Face token, as name or name:key (key default: token); '
      'the trainer gets it as HF_TOKEN. Empty: no token.',
      text=Text(253 + 1 + 253, r"\S+", "a Secret's name or name:key"), secret=True, targets=EKS,
      trainer=False),
    P('active_deadline_s', 86400, 'Resources', 'Training deadline (s)',
      'The training is stopped after this many seconds and the run fails (teardown gives the '
      "nodes back): eks, the PyTorchJob's activeDeadlineSeconds; local, the torchrun agents. 0: "
      'no deadline.',
      bounds=Bounds(minimum=0, maximum=2592000), trainer=False),
    P('schedule_timeout_s', 600, 'Resources', 'Scheduling timeout (s)',
      'eks: a training pod the Kubernetes scheduler cannot place for this long (a wrong '
      'instance type, EFA or GPUs not advertised, a taint, too little CPU or memory) fails '
      "train with the scheduler's reason, and teardown gives the nodes back. 0: wait until "
      'active_deadline_s.',
      bounds=Bounds(minimum=0, maximum=86400), targets=EKS, trainer=False),
    P('preflight', True, 'Resources', 'Preflight check',
      'Before training, check every node: GPU health through NVML (ECC errors, row remaps, '
      'clocks, temperature; XID errors from DCGM when Prometheus is set), a matmul per GPU, and '
      'the NCCL all-reduce bus bandwidth within each node and across nodes against what the '
      'instance type should reach. A bad node is named and cordoned (eks) and the run fails '
      'before it trains; the report shows the table.',
      trainer=False),
    P('replace_bad_nodes', False, 'Resources', 'Replace bad nodes',
      'eks: a node the preflight finds bad is cordoned and its instance terminated, so the node '
      "group's Auto Scaling group replaces it; the preflight runs again on the new node (at "
      'most 3 preflights). Off: the run fails at once, naming the node.',
      targets=EKS, trainer=False),
    P('metrics_port', 0, 'Metrics', 'Trainer metrics port',
      "Port of the Prometheus endpoint the trainer's rank 0 serves its per-step metrics on "
      '(loss, lr, grad norm, tokens/s, TFLOPs, MFU, memory); on eks the port is named `metrics` '
      "and containers/observability/prometheus-scrape.yaml scrapes worker 0's. 0: no endpoint.",
      bounds=Bounds(minimum=0, maximum=65535)),
    P('prometheus_url', '', 'Metrics', 'Prometheus URL',
      'Target eks: base URL (http(s)://host:port) of the Prometheus that scrapes the DCGM '
      "exporter; the report gets the job's GPU utilisation, memory, power, temperature and XID "
      'errors from it. No credentials in it: give those with prometheus_conn_id. Empty: the '
      'report says GPU metrics are missing.',
      text=Text(2048, r"https?://\S+", "an http(s):// URL"), secret=True, targets=EKS,
      trainer=False),
    P('prometheus_conn_id', '', 'Metrics', 'Prometheus connection',
      'Airflow HTTP connection whose login and password (basic auth) the Prometheus queries '
      'use; its host is used when prometheus_url is empty. Empty: no credentials.',
      text=CONN_ID_TEXT, targets=EKS, trainer=False),
    P('node_hourly_price', 0.0, 'Metrics', 'Price per node-hour (USD)',
      "For the report's cost estimate: nodes x price x training wall time. 0: no estimate.",
      bounds=Bounds(minimum=0, maximum=10000), trainer=False),
    # -- a sweep's own (the llm_finetune_sweep DAG's form only; docs/user-guide.md, Sweeps) --
    P('sweep_space', '', 'Sweep', 'Search space',
      'The fields to vary, as a JSON object: {"grid": {"lr": [0.001, 0.003], "lora_rank": [8, '
      '16]}} (every combination), {"trials": [{"lr": 0.001}, {"seq_len": 256}]} (a list of '
      'confs), or {"random": {"lr": {"log_uniform": [0.0001, 0.01]}, "warmup_steps": '
      '{"int_uniform": [0, 20]}, "lora_rank": {"choice": [8, 16]}}} (sweep_max_trials samples '
      'drawn with sweep_seed; uniform, log_uniform, int_uniform or choice). A trial is the '
      "form's other fields with its values; every trial is validated before anything starts.",
      text=Text(4096, PRINTABLE, "a JSON object"), trainer=False, sweep=True),
    P('sweep_max_trials', 8, 'Sweep', 'Trial budget',
      'The most trials the sweep runs: the samples of a random space; a grid or list with more '
      'is refused.',
      bounds=Bounds(minimum=1, maximum=256), trainer=False, sweep=True),
    P('sweep_parallel', 2, 'Sweep', 'Trials at once',
      'Trials that train at the same time: the node group is scaled once for this many trials '
      "(x a trial's nodes); when one ends (done, stopped or failed) the next takes its nodes.",
      bounds=Bounds(minimum=1, maximum=64), trainer=False, sweep=True),
    P('sweep_seed', 0, 'Sweep', 'Sampling seed',
      "The seed of a random space's samples: the same seed draws the same trials.",
      bounds=Bounds(minimum=0, maximum=2**31 - 1), trainer=False, sweep=True),
    P('sweep_first_rung', 0, 'Sweep', 'First rung (steps)',
      'Early stopping (successive halving, ASHA): the step at which the trials are first '
      'compared on their eval loss, a multiple of eval_interval; the next rungs are this times '
      'sweep_reduction_factor, squared, ... below the last step. 0: the first eval_interval.',
      bounds=Bounds(minimum=0, maximum=10_000_000), trainer=False, sweep=True),
    P('sweep_reduction_factor', 3, 'Sweep', 'Reduction factor',
      'At each rung a trial goes on when its eval loss is in the best 1/factor of the trials '
      'that have reached the rung (itself included, once at least factor of them have), and is '
      'stopped otherwise, its nodes going to the next trial. 1: no trial is stopped.',
      bounds=Bounds(minimum=1, maximum=16), trainer=False, sweep=True),
)
BY_NAME: Mapping[str, Parameter] = MappingProxyType({p.name: p for p in PARAMETERS})
if len(BY_NAME) != len(PARAMETERS):
    raise ValueError("a name is declared twice in PARAMETERS")
# The trainer's fields (TrainConfig), in the table's order.
TRAINER_PARAMETERS = tuple(p for p in PARAMETERS if p.trainer)
# What a run's conf may set (the trigger form's fields).
FORM_PARAMETERS = tuple(p for p in PARAMETERS if p.form and not p.sweep)
# What a sweep's conf sets besides (the sweep DAG's form: FORM_PARAMETERS and these).
SWEEP_PARAMETERS = tuple(p for p in PARAMETERS if p.sweep)
SECRET_NAMES = frozenset(p.name for p in PARAMETERS if p.secret)


def without_secrets(conf: dict[str, Any]) -> dict[str, Any]:
    """A run's conf as what it stores for people to read (the report, MLflow's params) may hold
    it: the secret fields left out."""
    return {key: value for key, value in conf.items() if key not in SECRET_NAMES}


def defaults() -> dict[str, Any]:
    """Every form parameter's default (what a run's conf starts from)."""
    return {p.name: p.default for p in FORM_PARAMETERS}
