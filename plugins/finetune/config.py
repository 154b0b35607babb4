"""The run's parameters (one spec for the trigger form and for validation) and the run config.

`PARAM_SPECS` is the single source of truth for every parameter: its type, bounds, allowed
values, default, and where and how the trigger form shows it. `validate_params` turns a DAG run's
params into one typed, immutable `RunConfig`, or raises `ConfigError` naming every bad field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune import REPO_ROOT
from finetune.instance_types import INSTANCE_TYPES
from finetune.names import dns_label, run_dir_name
from finetune.presets import NO_PRESET, PRESET_DISPLAY, PRESET_NAMES, apply_preset

TARGETS = ("local", "eks")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
MIXED_PRECISION = ("bf16", "fp16", "fp32")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
PROMPT_TEMPLATES = ("instruction", "chat")
DATASET_FORMATS = ("auto", "jsonl", "json", "parquet", "csv")
BAD_ROWS = ("skip", "error")
# torchrun rendezvous backends the training operator passes on (elasticPolicy.rdzvBackend).
RDZV_BACKENDS = ("etcd-v2", "etcd", "c10d")
ETCD_RESETS = ("keys", "restart")
# How the eks target provides the trainer image (plugins/finetune/image_build.py).
IMAGE_BUILDERS = ("buildkit", "codebuild", "prebuilt")
# Model configs the trainer builds from scratch, with their max_position_embeddings
# (trainer/model.py BUILTIN_CONFIGS; a test keeps the two equal, since Airflow workers do not
# have the trainer package installed).
BUILTIN_MODELS = {"tiny-llama": 1024, "llama-1b": 131072, "llama-3b": 131072, "llama-8b": 131072}
# The Linear layers of a Llama block; the trainer's default too (trainer/config.py).
LORA_TARGET_MODULES = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# Share of the data set the trainer holds out for the eval loss.
EVAL_FRACTION = 0.05

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


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
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None

    def schema(self) -> dict[str, Any]:
        """JSON schema keywords for Airflow's `Param` (and so the trigger form)."""
        # An optional text field (default "") may be left empty: the form sends null for it,
        # and marks a plain "string" field required.
        json_type: Any = [self.type, "null"] if self.default == "" else self.type
        out: dict[str, Any] = {"type": json_type, "title": self.title,
                               "description": self.description, "section": self.section}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.values_display:
            out["values_display"] = dict(self.values_display)
        for key, value in (("minimum", self.minimum), ("maximum", self.maximum),
                           ("exclusiveMinimum", self.exclusive_minimum)):
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
    _S("dataset", "trainer/demo/instructions.jsonl", "string", "Data", "Data set",
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
    _S("nodes", 1, "integer", "Resources", "Nodes",
       "Nodes (local: torchrun agents on this machine).", minimum=1, maximum=128),
    _S("procs_per_node", 2, "integer", "Resources", "Processes per node",
       "Training processes per node: one per GPU, or CPU processes on the local target.",
       minimum=1, maximum=64),
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
       "HYBRID_SHARD only: processes per shard group; 0 means processes per node.",
       minimum=0, maximum=8192),
    _S("tp_degree", 1, "integer", "Parallelism", "Tensor parallel degree",
       "Tensor (and sequence) parallel processes per model replica, for long sequences; "
       "FSDP shards across the rest. Must divide the processes per node.",
       minimum=1, maximum=64),
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
    _S("float8", False, "boolean", "Memory and speed", "float8 matmuls",
       "The decoder blocks' Linear layers compute in float8 (torchao; weights all-gathered in "
       "float8). Needs GPUs with compute capability >= 8.9 (H100, H200, L4) and mixed "
       "precision bf16; reported by tokens/s (MFU assumes the bf16 peak)."),
    _S("lora_rank", 0, "integer", "LoRA", "LoRA rank",
       "Train LoRA adapters of this rank instead of all weights (peft); 0: full fine-tune. The "
       "exported model has the adapters merged in; model/adapter/ holds them alone.",
       minimum=0, maximum=4096),
    _S("lora_alpha", 16.0, "number", "LoRA", "LoRA alpha",
       "The adapters' output is scaled by alpha / rank.", exclusive_minimum=0, maximum=65536),
    _S("lora_dropout", 0.0, "number", "LoRA", "LoRA dropout",
       "Dropout on the adapters' input.", minimum=0, maximum=0.99),
    _S("lora_target_modules", LORA_TARGET_MODULES, "string", "LoRA", "LoRA target modules",
       "Comma-separated names of the decoder blocks' Linear layers that get adapters."),
    _S("seq_len", 128, "integer", "Training", "Sequence length",
       "Tokens per sequence; longer examples are truncated.", minimum=8, maximum=131072),
    _S("micro_batch", 8, "integer", "Training", "Micro-batch",
       "Sequences per process per forward pass.", minimum=1, maximum=4096),
    _S("grad_accum", 1, "integer", "Training", "Gradient accumulation",
       "Micro-batches per optimizer step.", minimum=1, maximum=4096),
    _S("lr", 3e-3, "number", "Training", "Learning rate",
       "Peak AdamW learning rate (linear warmup, then cosine decay).", exclusive_minimum=0,
       maximum=1),
    _S("warmup_steps", 10, "integer", "Training", "Warmup steps",
       "Optimizer steps of linear learning-rate warmup.", minimum=0, maximum=1_000_000),
    _S("max_steps", 150, "integer", "Training", "Steps",
       "Optimizer steps to train; 0 means train for `epochs` instead.", minimum=0,
       maximum=10_000_000),
    _S("epochs", 1.0, "number", "Training", "Epochs",
       "Passes over the data set, used when steps is 0.", exclusive_minimum=0, maximum=1000),
    _S("seed", 1234, "integer", "Training", "Seed",
       "Seed for initialisation and data order.", minimum=0, maximum=2**31 - 1),
    _S("eval_interval", 50, "integer", "Training", "Eval interval",
       "Optimizer steps between eval-loss measurements (also at start and end); 0: start and "
       "end only.", minimum=0, maximum=10_000_000),
    _S("checkpoint_interval", 50, "integer", "Checkpoints", "Checkpoint interval",
       "Optimizer steps between sharded checkpoints; 0: no checkpoints. A restarted run "
       "resumes from the newest.", minimum=0, maximum=10_000_000),
    _S("checkpoint_async", False, "boolean", "Checkpoints", "Async checkpoints",
       "Write checkpoints in the background from a copy in CPU memory while training goes on; "
       "each is made complete (uploaded, for S3) when written, before the next one starts."),
    _S("max_restarts", 0, "integer", "Checkpoints", "Max restarts",
       "How often torchrun restarts failed workers before the run fails.", minimum=0,
       maximum=100),
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
       "cluster) or codebuild (AWS CodeBuild); prebuilt requires `image`. The tag is the "
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
       "The node group is never scaled above this many nodes.", minimum=1, maximum=1024),
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
    _S("hf_token_secret", "", "string", "EKS", "Hugging Face token secret",
       "Kubernetes Secret with a Hugging Face token, as name or name:key (key default: token); "
       "the trainer gets it as HF_TOKEN. Empty: no token."),
    _S("active_deadline_s", 86400, "integer", "Resources", "Training deadline (s)",
       "The training is stopped after this many seconds and the run fails (teardown gives the "
       "nodes back): eks, the PyTorchJob's activeDeadlineSeconds; local, the torchrun agents. "
       "0: no deadline.", minimum=0, maximum=30 * 86400),
    _S("metrics_port", 0, "integer", "Metrics", "Trainer metrics port",
       "Port of the Prometheus endpoint the trainer's rank 0 serves its per-step metrics on "
       "(loss, lr, grad norm, tokens/s, TFLOPs, MFU, memory); on eks the pods are annotated "
       "for scraping. 0: no endpoint.", minimum=0, maximum=65535),
    _S("prometheus_url", "", "string", "Metrics", "Prometheus URL",
       "Target eks: base URL (http(s)://host:port) of the Prometheus that scrapes the DCGM "
       "exporter; the report gets the job's GPU utilisation, memory, power, temperature and "
       "XID errors from it. Empty: the report says GPU metrics are missing."),
    _S("node_hourly_price", 0.0, "number", "Metrics", "Price per node-hour (USD)",
       "For the report's cost estimate: nodes x price x training wall time. 0: no estimate.",
       minimum=0, maximum=10_000),
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
    float8: bool
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: str
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
    metrics_port: int = 0
    prometheus_url: str = ""
    node_hourly_price: float = 0.0
    preset: str = NO_PRESET
    preset_version: int = 0  # the preset's version; 0 without a preset
    bad_rows: str = "skip"

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def _check_type(spec: ParamSpec, value: Any) -> str | None:
    if spec.type == "string":
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if spec.type == "boolean":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if isinstance(value, bool):
        return f"must be a {spec.type}, got {value!r}"
    if spec.type == "integer":
        if isinstance(value, int):
            return None
        return f"must be a positive integer, got {value!r}" if (
            spec.minimum is not None and spec.minimum > 0) else f"must be an integer, got {value!r}"
    if isinstance(value, (int, float)) and math.isfinite(value):
        return None
    return f"must be a finite number, got {value!r}"


def _check_bounds(spec: ParamSpec, value: Any) -> str | None:
    if spec.enum is not None and value not in spec.enum:
        allowed = ", ".join(str(v) for v in spec.enum)
        return f"unknown value {value!r}; allowed: {allowed}"
    if spec.exclusive_minimum is not None and value <= spec.exclusive_minimum:
        return f"must be > {spec.exclusive_minimum:g}, got {value!r}"
    if spec.minimum is not None and value < spec.minimum:
        return f"must be >= {spec.minimum:g}, got {value!r}"
    if spec.maximum is not None and value > spec.maximum:
        return f"must be <= {spec.maximum:g}, got {value!r}"
    return None


def resolve_path(path: str) -> Path:
    """User paths: `~` expanded, relative ones taken from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def dataset_format(path: str, declared: str) -> str | None:
    if declared != "auto":
        return declared
    return _FORMAT_BY_SUFFIX.get(Path(path).suffix.lower())


def count_rows(path: Path, fmt: str) -> int | None:
    """Rows in a local data file, without parsing them all; None when not countable cheaply."""
    if path.is_dir():
        return None
    if fmt == "jsonl":
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if fmt == "csv":
        with path.open("rb") as f:
            return max(sum(1 for line in f if line.strip()) - 1, 0)
    if fmt == "json":
        data = json.loads(path.read_text())
        return len(data) if isinstance(data, list) else None
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return None
        return pq.ParquetFile(path).metadata.num_rows
    return None


def dataset_kind(dataset: str) -> str:
    """s3, local (a file or directory here), hub (org/name with no data-file extension), missing.

    The trainer decides the same way (trainer/data.py dataset_source).
    """
    if dataset.startswith("s3://"):
        return "s3"
    if resolve_path(dataset).exists():
        return "local"
    if _HUB_ID.match(dataset) and Path(dataset).suffix.lower() not in _FORMAT_BY_SUFFIX \
            and not dataset.startswith((".", "/", "~")):
        return "hub"
    return "missing"


def _check_dataset(v: dict[str, Any], in_pod: bool) -> list[tuple[str, str]]:
    """The data set exists (where it can be seen from here) and one step's batch fits in it."""
    if not v["dataset"]:
        return [("dataset", "is empty; give a data file, directory, s3:// URI or hub name")]
    kind = dataset_kind(v["dataset"])
    if kind in ("s3", "hub") or (in_pod and v["dataset"].startswith("/")):
        return []  # read where the trainer runs
    data_path = resolve_path(v["dataset"])
    if kind == "missing":
        return [("dataset", f"{v['dataset']!r} does not exist ({data_path}) and is not a hub "
                 "name (org/name) or s3:// URI")]
    if data_path.is_dir():
        return []  # the trainer reads every data file in it
    fmt = dataset_format(v["dataset"], v["dataset_format"])
    if fmt is None:
        return [("dataset_format", f"cannot tell the format of {v['dataset']!r} from its "
                 "extension; set dataset_format to one of " + ", ".join(DATASET_FORMATS[1:]))]
    try:
        rows = count_rows(data_path, fmt)
    except (OSError, ValueError) as exc:
        return [("dataset", f"cannot read {v['dataset']!r} as {fmt}: {exc}")]
    if rows == 0:
        return [("dataset", f"{v['dataset']!r} has no rows")]
    if rows is not None:
        train_rows = rows - max(1, math.ceil(rows * EVAL_FRACTION))
        per_step = v["micro_batch"] * v["nodes"] * v["procs_per_node"] // v["tp_degree"]
        if train_rows < per_step:
            return [("micro_batch", (
                f"{v['micro_batch']} is too large for the data: one step needs micro_batch x "
                f"data-parallel processes = {per_step} rows, the data set has {train_rows} "
                "training rows"))]
    return []


def _check_float8_and_lora(v: dict[str, Any]) -> list[tuple[str, str]]:
    """The option pairs the trainer refuses (trainer/parallel.py), caught before any cloud call."""
    errors: list[tuple[str, str]] = []
    if v["float8"]:
        if v["mixed_precision"] != "bf16":
            errors.append(("float8", "needs mixed_precision bf16, mixed_precision is "
                           f"{v['mixed_precision']}"))
        if v["seq_len"] % 16:
            errors.append(("float8", f"needs seq_len divisible by 16 (float8 matmuls), seq_len "
                           f"is {v['seq_len']}"))
        for name, conflicting in (("cpu_offload", v["cpu_offload"]),
                                  ("tp_degree", v["tp_degree"] > 1),
                                  ("lora_rank", v["lora_rank"] > 0)):
            if conflicting:
                errors.append(("float8", f"cannot be combined with {name} = {v[name]}; turn "
                               f"one of them off"))
    if v["lora_rank"]:
        if v["tp_degree"] > 1:
            errors.append(("lora_rank", f"{v['lora_rank']} with tp_degree = {v['tp_degree']}: "
                           "LoRA runs with tp_degree 1 only"))
        names = [n.strip() for n in v["lora_target_modules"].split(",") if n.strip()]
        if not names or any(not re.match(r"^[A-Za-z_]\w*$", n) for n in names):
            errors.append(("lora_target_modules", f"{v['lora_target_modules']!r}: give "
                           "comma-separated module names such as " + LORA_TARGET_MODULES))
    return errors


def _max_positions(config_json: Path) -> int | None:
    """A model directory's max_position_embeddings, as the trainer checks seq_len against it."""
    try:
        positions = json.loads(config_json.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None  # the trainer's loading names what is wrong with the file
    return positions if isinstance(positions, int) else None


def _check_semantics(v: dict[str, Any]) -> list[tuple[str, str]]:
    """Checks across fields and against the file system; `v` has well-typed values."""
    errors: list[tuple[str, str]] = []
    # On eks, absolute paths are read in the trainer's pod, not on this machine.
    in_pod = v["target"] == "eks"
    positions = BUILTIN_MODELS.get(v["model"])
    if v["model"] not in BUILTIN_MODELS and not (in_pod and v["model"].startswith("/")):
        model_path = resolve_path(v["model"])
        if model_path.is_dir():
            if not (model_path / "config.json").is_file():
                errors.append(("model", f"directory {v['model']!r} has no config.json"))
            else:
                positions = _max_positions(model_path / "config.json")
        elif not _HUB_ID.match(v["model"]) or v["model"].startswith((".", "/", "~")):
            errors.append(("model", f"{v['model']!r} is not a built-in config ("
                           + ", ".join(BUILTIN_MODELS) + "), an existing model directory or "
                           "a hub id (org/name)"))
    if positions is not None and v["seq_len"] > positions:
        errors.append(("seq_len", f"{v['seq_len']} exceeds model {v['model']}'s "
                       f"max_position_embeddings ({positions})"))
    if v["tokenizer"] and not (in_pod and v["tokenizer"].startswith("/")) \
            and not resolve_path(v["tokenizer"]).is_dir():
        errors.append(("tokenizer", f"directory {v['tokenizer']!r} does not exist"))
    errors.extend(_check_dataset(v, in_pod))
    if not v["text_field"] and not (v["prompt_field"] and v["response_field"]):
        errors.append(("text_field", "set text_field, or both prompt_field and response_field"))
    world = v["nodes"] * v["procs_per_node"]
    if v["procs_per_node"] % v["tp_degree"]:
        errors.append(("tp_degree", f"{v['tp_degree']} does not divide procs_per_node = "
                       f"{v['procs_per_node']} (tensor parallelism stays within a node)"))
    elif v["seq_len"] % v["tp_degree"]:
        errors.append(("tp_degree", f"{v['tp_degree']} does not divide seq_len = "
                       f"{v['seq_len']} (sequence parallelism splits the sequence)"))
    errors.extend(_check_float8_and_lora(v))
    if v["activation_checkpointing"] == "selective" and v["selective_ac"] != "op" and not (
            v["selective_ac"].isdigit() and int(v["selective_ac"]) > 0):
        errors.append(("selective_ac", f"{v['selective_ac']!r}: allowed: op, or a positive "
                       "integer k (every k-th block)"))
    elif v["activation_checkpointing"] != "selective" and v["selective_ac"] != "op":
        errors.append(("selective_ac", f"{v['selective_ac']!r} applies only to "
                       "activation_checkpointing selective (it is "
                       f"{v['activation_checkpointing']!r}): leave it at op"))
    if v["strategy"] == "HYBRID_SHARD":
        group = v["shard_group_size"] or v["procs_per_node"]
        if world % group:
            errors.append(("shard_group_size", f"{group} does not divide the world size "
                           f"nodes x procs_per_node = {world} (strategy HYBRID_SHARD)"))
    elif v["shard_group_size"]:
        errors.append(("shard_group_size", "applies to strategy HYBRID_SHARD only, "
                       f"strategy is {v['strategy']}"))
    if v["rdzv_endpoint"] and not re.match(r"^[\w.-]+:\d{1,5}$", v["rdzv_endpoint"]):
        errors.append(("rdzv_endpoint", f"{v['rdzv_endpoint']!r} is not host:port"))
    if v["prometheus_url"] and not re.match(r"^https?://[^/\s]+(/\S*)?$", v["prometheus_url"]):
        errors.append(("prometheus_url", "is not an http(s)://host[:port][/path] URL"))
    if v["output_dir"].startswith("s3://") and v["target"] == "local":
        errors.append(("output_dir", "s3:// output needs target eks; give a local directory"))
    return errors


def validate_params(params: Mapping[str, Any], *, run_id: str, dag_id: str = "llm_finetune",
                    given: Mapping[str, Any] | None = None) -> RunConfig:
    """Params (from the trigger form, REST conf or defaults) -> RunConfig, or ConfigError.

    A `preset` in params supplies the values of the fields not set on purpose (`given`: the
    conf the run was triggered with; see finetune.presets.apply_preset). Checks the target's
    own constraints too (for example the local machine's CPUs), so that nothing is started for
    a run that cannot work.
    """
    errors: list[tuple[str, str]] = []
    preset_name = params.get("preset", NO_PRESET)
    if not isinstance(preset_name, str) or preset_name not in PRESET_NAMES:
        raise ConfigError([("preset", f"unknown preset {preset_name!r}; known: "
                            + ", ".join(PRESET_NAMES))])
    params, preset = apply_preset(params, default_params(), given)
    unknown = sorted(set(params) - set(SPECS_BY_NAME))
    if unknown:
        errors.append((unknown[0], "unknown parameter" + (
            f"s {', '.join(unknown)}" if len(unknown) > 1 else "") + "; known: "
            + ", ".join(SPECS_BY_NAME)))
    values: dict[str, Any] = {}
    for spec in PARAM_SPECS:
        value = params.get(spec.name, spec.default)
        if spec.type == "number" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if spec.type == "string" and isinstance(value, str):
            value = value.strip()
        if value is None and spec.default == "":
            value = ""  # an optional text field left empty in the form
        problem = _check_type(spec, value) or _check_bounds(spec, value)
        if problem:
            errors.append((spec.name, problem))
        else:
            values[spec.name] = value
    if errors:
        raise ConfigError(errors)
    from finetune.targets import get_target

    errors.extend(_check_semantics(values))
    errors.extend(get_target(values["target"]).check(values))
    if errors:
        raise ConfigError(errors)
    run_name = run_dir_name(run_id)
    return RunConfig(
        run_id=run_id,
        run_name=run_name,
        rdzv_id=dns_label(dag_id, run_id, max_len=48),
        run_dir=run_output_dir(values["output_dir"], run_name, values["target"]),
        preset_version=preset.version if preset else 0,
        **values,
    )


def run_output_dir(output_dir: str, run_name: str, target: str) -> str:
    """<output_dir>/<run name>: on this machine (local), or as the trainer's pod sees it."""
    if target == "local":
        return str(resolve_path(output_dir) / run_name)
    return f"{output_dir.rstrip('/')}/{run_name}"


def default_params() -> dict[str, Any]:
    return {spec.name: spec.default for spec in PARAM_SPECS}

