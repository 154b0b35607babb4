"""The run's parameters (one spec for the trigger form and for validation) and the run config.

`PARAM_SPECS` is the single source of truth for every parameter: its type, bounds, allowed
values, default, and where and how the trigger form shows it. `finetune.validate` turns a DAG run's
params into one typed, immutable `RunConfig`, or raises `ConfigError` naming every bad field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.instance_types import INSTANCE_TYPES
from finetune.presets import (
    NO_PRESET,
    PRESET_DISPLAY,
    PRESET_NAMES,
    preset_values_note,
    presets_markdown,
)
from finetune_contract.fields import (
    ACTIVATION_CHECKPOINTING,
    BAD_ROWS,
    BOUNDS,
    CHOICES,
    DATASET_FORMATS,
    DEMO_DATASET,
    DEMO_PREFERENCES,
    DPO_LOSSES,
    DPO_REFERENCES,
    EVAL_TASKS,
    HANG_TIMEOUT_S,
    LORA_TARGETS_DEFAULT,
    METHODS,
    MIXED_PRECISION,
    PROMPT_TEMPLATES,
    STRAGGLER_THRESHOLD,
    STRATEGIES,
    TEXTS,
    Bounds,
    quoted,
)
from finetune_contract.models import BUILTIN_MODELS

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
# its own in the cluster (plugins/finetune/targets/eks/target.py); the local target's is this
# machine.
PREPARE_ON = ("worker", "pod")
# Fields whose value is never quoted in an error message: it may be (or hold) a credential.
SECRET_FIELDS = frozenset({"hf_token_secret", "rdzv_endpoint", "prometheus_url"})


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    default: Any
    type: str  # JSON schema type: string, integer, number
    section: str
    title: str
    description: str
    enum: tuple[Any, ...] | None = None
    values_display: Mapping[str, str] | None = None

    @property
    def bounds(self) -> Bounds:
        """The value's bounds, from the contract's one table (none for a text field)."""
        return BOUNDS.get(self.name, Bounds())

    def schema(self) -> dict[str, Any]:
        """JSON schema keywords for Airflow's `Param` (and so the trigger form)."""
        # An optional text field (default "") may be left empty: the form sends null for it,
        # and marks a plain "string" field required.
        json_type: Any = [self.type, "null"] if self.default == "" else self.type
        out: dict[str, Any] = {"type": json_type, "title": self.title, "section": self.section}
        if self.name == "preset":  # Markdown: the rule, and each preset's values
            out["description_md"] = presets_markdown(default_params())
        else:
            out["description"] = self.description + preset_values_note(self.name, self.default)
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.values_display:
            out["values_display"] = dict(self.values_display)
        for key, value in (("minimum", self.bounds.minimum), ("maximum", self.bounds.maximum),
                           ("exclusiveMinimum", self.bounds.exclusive_minimum)):
            if value is not None:
                out[key] = value
        return out


_S = ParamSpec
PARAM_SPECS: tuple[ParamSpec, ...] = (
    _S("preset", NO_PRESET, "string", "Preset", "Preset",
       "Settings known to fit a model on an instance type (plugins/finetune/presets.py). Its "
       "values replace the defaults below; a field you change here overrides the preset.",
       enum=PRESET_NAMES, values_display=PRESET_DISPLAY),
    _S("target", "local", "string", "Where to run", "Target",
       "`local`: this machine is the cluster (torchrun, local etcd). `eks`: Amazon EKS with "
       "the Kubeflow training operator.",
       enum=TARGETS, values_display={"local": "local (this machine)", "eks": "Amazon EKS"}),
    _S("model", "tiny-llama", "string", "Model", "Model",
       "A built-in config trained from scratch (" + ", ".join(BUILTIN_MODELS) + "), a directory "
       "with Hugging Face model files, or a Hugging Face hub id (org/name)."),
    _S("tokenizer", "", "string", "Model", "Tokenizer",
       "Directory with tokenizer files. Empty: the model's own (the demo tokenizer for "
       "built-in configs)."),
    _S("dataset", DEMO_DATASET, "string", "Data", "Data set",
       "A jsonl, json, parquet or csv file or a directory of them (relative paths are from the "
       "repository root), an s3://bucket/key URI (file or prefix), or a hub name (org/name)."),
    _S("dataset_format", "auto", "string", "Data", "Data set format",
       "`auto` picks the format from the file extension.", enum=DATASET_FORMATS),
    _S("dataset_split", "train", "string", "Data", "Split",
       "Split of a Hugging Face hub data set (files and s3:// use all their rows)."),
    _S("text_field", "", "string", "Data", "Text field",
       "Field holding plain text to train on. Empty: use the prompt and response fields."),
    _S("prompt_field", "prompt", "string", "Data", "Prompt field",
       "Field holding the instruction; the loss is not computed on it."),
    _S("response_field", "response", "string", "Data", "Response field",
       "Field holding the answer the model learns to give."),
    _S("prompt_template", "instruction", "string", "Data", "Prompt template",
       "instruction: '### Instruction: ... ### Response:'; chat: the tokenizer's chat template "
       "(user = prompt, assistant = response).", enum=PROMPT_TEMPLATES),
    _S("packing", False, "boolean", "Data", "Packing",
       "Pack examples into full sequences; no token attends to another example."),
    _S("bad_rows", "skip", "string", "Data", "Bad rows",
       "Rows that are not JSON, miss a field, hold a non-string or empty one, or are longer than "
       "seq_len tokens: `skip` skips them and counts them by reason in the report; `error` fails "
       "the run at the first one, naming its file and line.", enum=BAD_ROWS),
    _S("max_skipped_fraction", 0.1, "number", "Data", "Max skipped fraction",
       "The share of the data set's rows that may be skipped as bad (bad_rows skip) before the "
       "run fails at prepare_data, before any GPU is up, naming the count and the longest rows. "
       "1: never fail for skipped rows."),
    _S("method", "sft", "string", "Preference tuning (DPO)", "Method",
       "sft: learn the responses (next-token loss). dpo: direct preference optimisation on rows "
       "of prompt, chosen and rejected response; left at the demo data set it trains on "
       f"{DEMO_PREFERENCES}. Not with packing, text_field or tp_degree > 1.", enum=METHODS),
    _S("chosen_field", "chosen", "string", "Preference tuning (DPO)", "Chosen field",
       "dpo: the field holding the preferred response."),
    _S("rejected_field", "rejected", "string", "Preference tuning (DPO)", "Rejected field",
       "dpo: the field holding the dispreferred response."),
    _S("dpo_beta", 0.1, "number", "Preference tuning (DPO)", "DPO beta",
       "How strongly the policy is held to the reference (the KL penalty); the rewards are beta "
       "times the policy-minus-reference log-ratio."),
    _S("dpo_loss", "sigmoid", "string", "Preference tuning (DPO)", "DPO loss",
       "sigmoid: DPO (-log sigmoid of beta times the log-ratio margin); ipo: IPO's squared loss "
       "on the per-token averaged margin.", enum=DPO_LOSSES),
    _S("dpo_label_smoothing", 0.0, "number", "Preference tuning (DPO)", "DPO label smoothing",
       "sigmoid only: the share of pairs assumed mislabelled (conservative DPO)."),
    _S("dpo_reference", "model", "string", "Preference tuning (DPO)", "DPO reference",
       "model: the frozen initial weights, sharded like the policy, without optimizer state "
       "(with LoRA: the base with its adapters disabled, no copy). precompute: the initial "
       "weights score every training pair once before step 1 and no reference is held (less "
       "memory, one extra forward pass over the pairs); the same losses as model.",
       enum=DPO_REFERENCES),
    _S("nodes", 1, "integer", "Resources", "Nodes",
       "Nodes (local: torchrun agents on this machine)."),
    _S("procs_per_node", 2, "integer", "Resources", "Processes per node",
       "Training processes per node: one per GPU, or CPU processes on the local target."),
    _S("rdzv_endpoint", "", "string", "Resources", "etcd endpoint",
       "host:port of an etcd (v2 API) for torchrun's rendezvous. Empty: the local target "
       "starts its own etcd, or uses torch's c10d store when etcd is not installed."),
    _S("strategy", "FULL_SHARD", "string", "Parallelism", "Sharding strategy",
       "FSDP2 sharding: FULL_SHARD (params, grads, optimizer state sharded), SHARD_GRAD_OP "
       "(params kept after forward), HYBRID_SHARD (shard within a group, replicate across), "
       "NO_SHARD (replicate, like DDP).", enum=STRATEGIES,
       values_display={"FULL_SHARD": "FULL_SHARD (ZeRO-3)", "SHARD_GRAD_OP": "SHARD_GRAD_OP "
                       "(ZeRO-2)", "HYBRID_SHARD": "HYBRID_SHARD (HSDP)",
                       "NO_SHARD": "NO_SHARD (replicate)"}),
    _S("shard_group_size", 0, "integer", "Parallelism", "Shard group size",
       "HYBRID_SHARD only: processes per shard group; 0 means processes per node."),
    _S("tp_degree", 1, "integer", "Parallelism", "Tensor parallel degree",
       "Tensor (and sequence) parallel processes per model replica, for long sequences; "
       "FSDP shards across the rest. Must divide the processes per node."),
    _S("mixed_precision", "fp32", "string", "Memory and speed", "Mixed precision",
       "bf16: bf16 compute with fp32 master weights and fp32 gradient reduction (GPUs). "
       "fp16: fp16 compute with a gradient scaler. fp32: full precision (the fast choice on "
       "CPUs).", enum=MIXED_PRECISION),
    _S("activation_checkpointing", "none", "string", "Memory and speed",
       "Activation checkpointing",
       "full: recompute every decoder block in backward; selective: see below.",
       enum=ACTIVATION_CHECKPOINTING),
    _S("selective_ac", "op", "string", "Memory and speed", "Selective checkpointing",
       "With selective checkpointing: `op` keeps matmul outputs and recomputes the rest, or a "
       "number k checkpoints every k-th block."),
    _S("activation_offload", False, "boolean", "Memory and speed", "Offload activations",
       "Keep saved activations in CPU memory until backward."),
    _S("cpu_offload", False, "boolean", "Memory and speed", "Offload parameters",
       "Parameters, gradients and the optimizer step on the CPU (FSDP2 CPU offload)."),
    _S("compile", False, "boolean", "Memory and speed", "torch.compile",
       "Compile each decoder block with torch.compile."),
    _S("attention", "sdpa", "string", "Memory and speed", "attention kernel",
       "sdpa: cuDNN flash attention through torch (any GPU, and CPUs); fa4: FlashAttention 4 "
       "(flash-attn-4's kernels, faster on H100/H200 and B200: compute capability 9.0 or 10.0), "
       "with mixed precision bf16 or fp16, no packing and tp_degree 1."),
    _S("float8", False, "boolean", "Memory and speed", "float8 matmuls",
       "The decoder blocks' Linear layers compute in float8 (torchao; weights all-gathered in "
       "float8). Needs GPUs with compute capability >= 8.9 (H100, H200, L4) and mixed "
       "precision bf16; reported by tokens/s (MFU assumes the bf16 peak)."),
    _S("float8_recipe", "tensorwise", "string", "Memory and speed", "float8 scaling",
       "tensorwise: one scale per tensor, weights all-gathered in float8 under FSDP (fastest); "
       "rowwise: one scale per row of each operand (closer to bf16's loss, weights all-gathered "
       "in bf16). Only with float8.", enum=CHOICES["float8_recipe"]),
    _S("lora_rank", 0, "integer", "LoRA", "LoRA rank",
       "Train LoRA adapters of this rank instead of all weights (peft); 0: full fine-tune. The "
       "exported model has the adapters merged in; model/adapter/ holds them alone."),
    _S("quantize_base", "none", "string", "LoRA", "Quantize the base (QLoRA)",
       "nf4: keep the frozen base weights of the decoder blocks in 4-bit NormalFloat (torchao), "
       "the LoRA adapters in the compute dtype: QLoRA, about a quarter of the base's bf16 "
       "memory. Needs lora_rank > 0 and GPUs; not with cpu_offload.",
       enum=CHOICES["quantize_base"]),
    _S("lora_alpha", 16.0, "number", "LoRA", "LoRA alpha",
       "The adapters' output is scaled by alpha / rank."),
    _S("lora_dropout", 0.0, "number", "LoRA", "LoRA dropout",
       "Dropout on the adapters' input."),
    _S("lora_target_modules", LORA_TARGETS_DEFAULT, "string", "LoRA", "LoRA target modules",
       "Comma-separated names of the decoder blocks' Linear layers that get adapters; auto: "
       "the model family's set (all attention and MLP projections; docs/trainer.md, Model "
       "families)."),
    _S("seq_len", 128, "integer", "Training", "Sequence length",
       "Tokens per sequence. An example longer than this is never truncated: bad_rows "
       "decides (skip: skipped and counted in the report; error: the run fails at validate "
       "naming its line)."),
    _S("micro_batch", 8, "integer", "Training", "Micro-batch",
       "Sequences per process per forward pass."),
    _S("grad_accum", 1, "integer", "Training", "Gradient accumulation",
       "Micro-batches per optimizer step."),
    _S("lr", 3e-3, "number", "Training", "Learning rate",
       "Peak AdamW learning rate (linear warmup, then cosine decay)."),
    _S("warmup_steps", 10, "integer", "Training", "Warmup steps",
       "Optimizer steps of linear learning-rate warmup."),
    _S("max_steps", 150, "integer", "Training", "Steps",
       "Optimizer steps to train; 0 means train for `epochs` instead."),
    _S("epochs", 1.0, "number", "Training", "Epochs",
       "Passes over the data set, used when steps is 0."),
    _S("seed", 1234, "integer", "Training", "Seed",
       "Seed for initialisation and data order."),
    _S("eval_interval", 50, "integer", "Training", "Eval interval",
       "Optimizer steps between eval-loss measurements (also at start and end); 0: start and "
       "end only."),
    _S("checkpoint_interval", 50, "integer", "Checkpoints", "Checkpoint interval",
       "Optimizer steps between sharded checkpoints; 0: no checkpoints. A restarted run "
       "resumes from the newest."),
    _S("checkpoint_async", False, "boolean", "Checkpoints", "Async checkpoints",
       "Write checkpoints in the background from a copy in CPU memory while training goes on; "
       "each is made complete (uploaded, for S3) when written, before the next one starts."),
    _S("max_restarts", 0, "integer", "Checkpoints", "Max restarts",
       "How often torchrun restarts failed workers before the run fails."),
    _S("hang_timeout_s", HANG_TIMEOUT_S, "integer", "Checkpoints", "Hang timeout (s)",
       "A rank with no training step, eval or checkpoint for this long (a hung collective, a "
       "stuck rank) writes its stacks and collective traces to hangs/, records a TrainingHang "
       "naming the rank that stopped, and exits: torchrun restarts the workers from the newest "
       "checkpoint (max_restarts). Longer than the slowest step, eval, save or export. 0: off."),
    _S("straggler_threshold", STRAGGLER_THRESHOLD, "number", "Metrics", "Straggler threshold",
       "A rank whose median step time (without its wait for the others at the step's start) "
       "exceeds the median of all ranks by this fraction is flagged in the report (0.2: 20% "
       "slower)."),
    _S("eval_dataset", "", "string", "Evaluation", "Eval data set",
       "A data set for the evaluate stage (same forms and fields as the training data set). "
       "Empty: the training data set's held-out eval split."),
    _S("sample_prompts", 4, "integer", "Evaluation", "Sample prompts",
       "Prompts of the eval set the model answers (greedy) in the report, beside the "
       "reference answers; 0: none."),
    _S("max_new_tokens", 16, "integer", "Evaluation", "Max new tokens",
       "Tokens generated per sample prompt at most."),
    _S("eval_tasks", ",".join(EVAL_TASKS), "string", "Evaluation", "Benchmark tasks",
       "lm-evaluation-harness tasks run offline on task data shipped in trainer/eval_tasks, "
       "comma-separated (" + ", ".join(EVAL_TASKS) + "); empty: none."),
    _S("promotion_metric", "eval_loss", "string", "Evaluation", "Promotion metric",
       "What the model must beat the champion (the DAG's last promoted model) on, both "
       "measured on this run's eval set: eval_loss or perplexity (lower is better), or a "
       "task's metric as <task>.<metric>, e.g. demo_instructions.acc (higher is better)."),
    _S("promotion_margin", 0.0, "number", "Evaluation", "Promotion margin",
       "The model is promoted when it beats the champion by more than this (in the metric's "
       "units), or when there is no champion."),
    _S("output_dir", "runs", "string", "Output", "Output location",
       "Directory for the run's outputs (relative paths are from the repository root); each "
       "run writes to <output>/<run id>/."),
    _S("cluster_name", "", "string", "EKS", "EKS cluster",
       "Target eks: name of the Amazon EKS cluster."),
    _S("nodegroup", "", "string", "EKS", "Node group",
       "Target eks: the managed node group of GPU nodes the run scales up and gives back."),
    _S("instance_type", "p4de.24xlarge", "string", "EKS", "Instance type",
       "The node group's instance type: GPUs, EFA interfaces, CPU and memory per node.",
       enum=tuple(INSTANCE_TYPES)),
    _S("namespace", "default", "string", "EKS", "Namespace",
       "Kubernetes namespace of the PyTorchJob, its ConfigMap and the etcd service."),
    _S("image", "", "string", "EKS", "Trainer image",
       "A prebuilt trainer image (registry/repository:tag), used as is (verified when in ECR). "
       "Empty: the pipeline builds the image from trainer/ and containers/ with "
       "image_builder."),
    _S("image_builder", "buildkit", "string", "EKS", "Image builder",
       "How the image is built when `image` is empty: buildkit (a rootless BuildKit Job in the "
       "cluster), codebuild (AWS CodeBuild) or buildah (built and pushed by the task where "
       "Airflow runs; buildah installed there); prebuilt requires `image`. The tag is the "
       "content hash of trainer/ and containers/: a tag already in ECR is not built again.",
       enum=IMAGE_BUILDERS),
    _S("image_repository", "finetune-trainer", "string", "EKS", "ECR repository",
       "ECR repository the built image is pushed to; created when missing (scan on push, "
       "immutable tags)."),
    _S("build_bucket", "", "string", "EKS", "Build context bucket",
       "S3 bucket the build context is uploaded to (under finetune-build-context/). Required "
       "when the image is built."),
    _S("codebuild_role", "", "string", "EKS", "CodeBuild role",
       "image_builder codebuild: ARN of the IAM role the CodeBuild project runs as (reads the "
       "context from S3, pushes to ECR)."),
    _S("max_nodes", 16, "integer", "EKS", "Node cap",
       "The node group is never scaled above this many nodes."),
    _S("aws_conn_id", "aws_default", "string", "EKS", "AWS connection",
       "Airflow connection for AWS (region, credentials or role)."),
    _S("kubernetes_conn_id", "", "string", "EKS", "Kubernetes connection",
       "Optional Airflow Kubernetes connection (kubeconfig). Empty: a token for the EKS cluster "
       "is minted from the AWS connection."),
    _S("etcd_service", "etcd", "string", "EKS", "etcd service",
       "Service (port 2379, v2 API) in the namespace for torchrun's etcd rendezvous."),
    _S("etcd_reset", "keys", "string", "EKS", "etcd reset",
       "keys: delete this run's rendezvous keys; restart: restart the etcd pod (every key is "
       "lost).", enum=ETCD_RESETS),
    _S("rdzv_backend", "etcd-v2", "string", "EKS", "Rendezvous backend",
       "torchrun rendezvous: etcd-v2 or etcd (the etcd service), or c10d (on worker 0).",
       enum=RDZV_BACKENDS),
    _S("launcher", "pytorchjob", "string", "EKS", "Launcher",
       "pytorchjob: a Kubeflow PyTorchJob (training operator v1). trainjob: a Kubeflow Trainer "
       "v2 TrainJob on the project's ClusterTrainingRuntime (containers/k8s/"
       "trainjob-runtime.yaml): a static c10d rendezvous on node 0 (rdzv_backend c10d), "
       "restarts by JobSet's failure policy (max_restarts 0).",
       enum=LAUNCHERS, values_display={"pytorchjob": "PyTorchJob (training operator v1)",
                                       "trainjob": "TrainJob (Kubeflow Trainer v2)"}),
    _S("service_account", "", "string", "EKS", "Service account",
       "Kubernetes service account of the training pods, e.g. one bound to an IAM role (IRSA) "
       "that reads the data set and writes the outputs on S3. Empty: the namespace's default."),
    _S("volumes", "", "string", "EKS", "Volumes",
       "PersistentVolumeClaims mounted in every training pod, as claim:/mount/path pairs "
       "separated by commas (FSx for Lustre, EFS): absolute model, tokenizer, data set and "
       "output paths must lie under one of them."),
    _S("prepare_on", "worker", "string", "EKS", "Prepare data on",
       "Where prepare_data encodes the data set on eks: worker (the Airflow worker, which needs "
       "datasets and transformers and the cores to encode) or pod (a CPU pod of its own: the "
       "trainer image, built first when missing, on a node of prepare_node_selector with "
       "prepare_cpu cores and prepare_memory_gib of memory; it writes the set to the run's S3 "
       "output_dir, which pod requires). Either way before any GPU node is up.",
       enum=PREPARE_ON, values_display={"worker": "the Airflow worker",
                                         "pod": "a CPU pod in the cluster"}),
    _S("prepare_node_selector", "", "string", "EKS", "Prepare pod node selector",
       "prepare_on pod: the node labels the pod must run on, as label=value pairs separated by "
       "commas (e.g. eks.amazonaws.com/nodegroup=cpu). Empty: any node without a taint (the "
       "GPU nodes' taint keeps it off them)."),
    _S("prepare_cpu", 4, "integer", "EKS", "Prepare pod CPUs",
       "prepare_on pod: the cores the pod requests, and the encoding's processes."),
    _S("prepare_memory_gib", 16, "integer", "EKS", "Prepare pod memory (GiB)",
       "prepare_on pod: the memory the pod requests and is limited to, in GiB."),
    _S("queue_name", "", "string", "EKS", "Kueue queue",
       "A Kueue LocalQueue: the job is created suspended with the kueue.x-k8s.io/queue-name "
       "label, and starts when Kueue admits it. Empty: no Kueue."),
    _S("hf_token_secret", "", "string", "EKS", "Hugging Face token secret",
       "Kubernetes Secret with a Hugging Face token, as name or name:key (key default: token); "
       "the trainer gets it as HF_TOKEN. Empty: no token."),
    _S("active_deadline_s", 86400, "integer", "Resources", "Training deadline (s)",
       "The training is stopped after this many seconds and the run fails (teardown gives the "
       "nodes back): eks, the PyTorchJob's activeDeadlineSeconds; local, the torchrun agents. "
       "0: no deadline."),
    _S("schedule_timeout_s", 600, "integer", "Resources", "Scheduling timeout (s)",
       "eks: a training pod the Kubernetes scheduler cannot place for this long (a wrong "
       "instance type, EFA or GPUs not advertised, a taint, too little CPU or memory) fails "
       "train with the scheduler's reason, and teardown gives the nodes back. 0: wait until "
       "active_deadline_s."),
    _S("preflight", True, "boolean", "Resources", "Preflight check",
       "Before training, check every node: GPU health through NVML (ECC errors, row remaps, "
       "clocks, temperature; XID errors from DCGM when Prometheus is set), a matmul per GPU, "
       "and the NCCL all-reduce bus bandwidth within each node and across nodes against what "
       "the instance type should reach. A bad node is named and cordoned (eks) and the run "
       "fails before it trains; the report shows the table."),
    _S("replace_bad_nodes", False, "boolean", "Resources", "Replace bad nodes",
       "eks: a node the preflight finds bad is cordoned and its instance terminated, so the "
       "node group's Auto Scaling group replaces it; the preflight runs again on the new node "
       "(at most 3 preflights). Off: the run fails at once, naming the node."),
    _S("metrics_port", 0, "integer", "Metrics", "Trainer metrics port",
       "Port of the Prometheus endpoint the trainer's rank 0 serves its per-step metrics on "
       "(loss, lr, grad norm, tokens/s, TFLOPs, MFU, memory); on eks the port is named "
       "`metrics` and containers/observability/prometheus-scrape.yaml scrapes worker 0's. "
       "0: no endpoint."),
    _S("prometheus_url", "", "string", "Metrics", "Prometheus URL",
       "Target eks: base URL (http(s)://host:port) of the Prometheus that scrapes the DCGM "
       "exporter; the report gets the job's GPU utilisation, memory, power, temperature and "
       "XID errors from it. No credentials in it: give those with prometheus_conn_id. Empty: "
       "the report says GPU metrics are missing."),
    _S("prometheus_conn_id", "", "string", "Metrics", "Prometheus connection",
       "Airflow HTTP connection whose login and password (basic auth) the Prometheus queries "
       "use; its host is used when prometheus_url is empty. Empty: no credentials."),
    _S("node_hourly_price", 0.0, "number", "Metrics", "Price per node-hour (USD)",
       "For the report's cost estimate: nodes x price x training wall time. 0: no estimate."),
)
SPECS_BY_NAME = {spec.name: spec for spec in PARAM_SPECS}


class ConfigError(ValueError):
    """Invalid run parameters; `errors` holds (field, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        lines = "\n".join(f"- {field}: {message}" for field, message in errors)
        super().__init__(f"invalid run parameters ({len(errors)}):\n{lines}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, typed and checked. Stages receive it through XCom as a dict."""

    run_id: str
    run_name: str  # file-system-safe run id
    rdzv_id: str  # DNS-safe, unique per DAG run
    run_dir: str  # absolute: <output_dir>/<run_name>
    target: str
    model: str
    tokenizer: str
    dataset: str
    dataset_format: str
    dataset_split: str
    text_field: str
    prompt_field: str
    response_field: str
    nodes: int
    procs_per_node: int
    strategy: str
    shard_group_size: int
    tp_degree: int
    mixed_precision: str
    activation_checkpointing: str
    selective_ac: str
    activation_offload: bool
    cpu_offload: bool
    compile: bool
    attention: str
    float8: bool
    float8_recipe: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: str
    quantize_base: str
    prompt_template: str
    packing: bool
    seq_len: int
    micro_batch: int
    grad_accum: int
    lr: float
    warmup_steps: int
    max_steps: int
    epochs: float
    seed: int
    eval_interval: int
    checkpoint_interval: int
    checkpoint_async: bool
    max_restarts: int
    output_dir: str
    rdzv_endpoint: str
    cluster_name: str
    nodegroup: str
    instance_type: str
    namespace: str
    image: str
    image_builder: str
    image_repository: str
    build_bucket: str
    codebuild_role: str
    max_nodes: int
    aws_conn_id: str
    kubernetes_conn_id: str
    etcd_service: str
    etcd_reset: str
    rdzv_backend: str
    hf_token_secret: str
    active_deadline_s: int
    schedule_timeout_s: int = 600
    preflight: bool = True
    replace_bad_nodes: bool = False
    service_account: str = ""
    volumes: str = ""
    queue_name: str = ""
    prepare_on: str = "worker"
    prepare_node_selector: str = ""
    prepare_cpu: int = 4
    prepare_memory_gib: int = 16
    metrics_port: int = 0
    prometheus_url: str = ""
    prometheus_conn_id: str = ""
    node_hourly_price: float = 0.0
    preset: str = NO_PRESET
    preset_version: int = 0  # the preset's version; 0 without a preset
    bad_rows: str = "skip"
    max_skipped_fraction: float = 0.1
    hang_timeout_s: int = HANG_TIMEOUT_S
    straggler_threshold: float = STRAGGLER_THRESHOLD
    launcher: str = "pytorchjob"
    eval_dataset: str = ""
    sample_prompts: int = 4
    max_new_tokens: int = 16
    eval_tasks: str = ",".join(EVAL_TASKS)
    promotion_metric: str = "eval_loss"
    promotion_margin: float = 0.0
    method: str = "sft"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    dpo_reference: str = "model"
    # Counted by validate where it can read the data set (0: not counted): the training split's
    # rows (packed: about how many sequences) and micro-batches per data-parallel rank per epoch.
    counted_train_rows: int = 0
    counted_batches_per_epoch: int = 0
    # Set by prepare_data: the prepared set the trainer loads (finetune_data.prepare).
    prepared_data: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def check_type(spec: ParamSpec, value: Any) -> str | None:
    """What is wrong with a value's JSON type for its spec, or None."""
    if spec.type == "string":
        return None if isinstance(value, str) else f"must be a string, got {_shown(spec, value)}"
    if spec.type == "boolean":
        return None if isinstance(value, bool) else \
            f"must be true or false, got {_shown(spec, value)}"
    if isinstance(value, bool):
        return f"must be a {spec.type}, got {value!r}"
    if spec.type == "integer":
        if isinstance(value, int):
            return None
        positive = (spec.bounds.minimum or 0) > 0
        return f"must be a {'positive ' if positive else ''}integer, got {_shown(spec, value)}"
    if isinstance(value, (int, float)) and math.isfinite(value):
        return None
    return f"must be a finite number, got {_shown(spec, value)}"


def check_value(spec: ParamSpec, value: Any) -> str | None:
    """What is wrong with a well-typed value on its own: its choices, bounds, length and
    characters (the contract's tables)."""
    if spec.enum is not None and value not in spec.enum:
        return f"unknown value {_shown(spec, value)}; allowed: " + \
            ", ".join(str(v) for v in spec.enum)
    if spec.name in TEXTS and isinstance(value, str):
        return TEXTS[spec.name].problem(value, _shown(spec, value))
    return spec.bounds.problem(value)


def _shown(spec: ParamSpec, value: Any) -> str:
    """The value as an error message may show it: cut, and never a secret field's."""
    return "a value (not shown)" if spec.name in SECRET_FIELDS else quoted(value)


def resolve_path(path: str) -> Path:
    """User paths: `~` expanded, relative ones taken from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def run_output_dir(output_dir: str, run_name: str, target: str) -> str:
    """<output_dir>/<run name>: on this machine (local), or as the trainer's pod sees it."""
    if target == "local":
        return str(resolve_path(output_dir) / run_name)
    return f"{output_dir.rstrip('/')}/{run_name}"


def default_params() -> dict[str, Any]:
    return {spec.name: spec.default for spec in PARAM_SPECS}

