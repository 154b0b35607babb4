"""Named, versioned run presets: settings known to fit a model on an instance type.

A run names one in its conf (`"preset": "llama2-7b-p4de"`) and may override any field. The
params a run validates are: the built-in defaults, then the preset's values, then the fields the
conf sets (`apply_preset`). Raise a preset's `version` whenever its values change: the run
config records name and version, so a report says which settings a run used.

Memory budgets (the reasoning behind each preset; estimates, not measurements on the cluster):
full fine-tuning keeps fp32 weights, fp32 gradients and AdamW's two fp32 moments, 16 bytes per
parameter, sharded over the shard group. Compute is bf16. With full activation checkpointing a
sequence keeps one bf16 hidden state per layer (seq x hidden x 2 bytes x layers) plus one
block's working set while it recomputes; the LM head's loss is computed in chunks. Measured
anchor (docs/trainer.md, one H200): an 8B model (hidden 4096, 32 layers) with full checkpointing at
micro-batch 2 x 4096 tokens peaked at 123.6 GiB with 119.7 GiB of that weights and optimizer
state, i.e. about 2 GiB of activations per 4096-token sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

NO_PRESET = "none"


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    version: int
    title: str  # shown in the trigger form
    values: Mapping[str, Any]


def _preset(name: str, version: int, title: str, **values: Any) -> Preset:
    return Preset(name, version, title, MappingProxyType(values))


_GPU_COMMON = {"mixed_precision": "bf16", "activation_checkpointing": "full", "seq_len": 4096,
               "lr": 2e-5, "warmup_steps": 50, "max_steps": 1000, "eval_interval": 100,
               "checkpoint_interval": 200, "max_restarts": 3}

PRESETS: dict[str, Preset] = {p.name: p for p in (
    # This machine, 2 CPU processes (gloo), the built-in tiny model and the demo data: a full
    # run in well under a minute; for trying the pipeline and for tests.
    _preset("tiny-local", 1, "tiny-local: tiny model on this machine's CPUs, 40 steps",
            target="local", model="tiny-llama", nodes=1, procs_per_node=2,
            strategy="FULL_SHARD", mixed_precision="fp32", activation_checkpointing="none",
            seq_len=96, micro_batch=8, grad_accum=1, lr=3e-3, warmup_steps=4, max_steps=40,
            eval_interval=20, checkpoint_interval=20),
    # Llama 2 7B (6.7e9 parameters, hidden 4096, 32 layers) on 1 x p4de.24xlarge (8 x A100
    # 80 GB). The planner (`make plan CONF='{"preset": "llama2-7b-p4de"}'`): 22.6 GiB per GPU
    # of 80 (state 12.6, activations 5.9). All traffic stays on NVLink (one node).
    _preset("llama2-7b-p4de", 1, "llama2-7b-p4de: Llama 2 7B, 1 x p4de.24xlarge (8 A100 80GB)",
            target="eks", model="meta-llama/Llama-2-7b-hf", instance_type="p4de.24xlarge",
            nodes=1, procs_per_node=8, strategy="FULL_SHARD", micro_batch=4, grad_accum=4,
            **_GPU_COMMON),
    # Llama 2 13B (13.0e9, hidden 5120, 40 layers) on 2 x p5.48xlarge (8 x H100 80 GB each),
    # HYBRID_SHARD: sharded within a node, replicated across the two, so parameter gathers stay
    # on NVLink and only the gradient all-reduce crosses EFA. The planner: 37.6 GiB per GPU of
    # 80 (state 24.2, activations 8.6).
    _preset("llama2-13b-p5", 1, "llama2-13b-p5: Llama 2 13B, 2 x p5.48xlarge (HSDP)",
            target="eks", model="meta-llama/Llama-2-13b-hf", instance_type="p5.48xlarge",
            nodes=2, procs_per_node=8, strategy="HYBRID_SHARD", shard_group_size=8,
            micro_batch=4, grad_accum=4, **_GPU_COMMON),
    # Llama 2 70B (69e9, hidden 8192, 80 layers) on 4 x p5.48xlarge: 16 B x 69e9 = 1.1 TB of
    # state does not fit one node's 640 GB, so FULL_SHARD over all 32 GPUs. The planner: 43.9
    # GiB per GPU of 80 (state 32.1, gathered blocks 4.2, activations 6.1) at micro-batch 1.
    _preset("llama2-70b-p5", 1, "llama2-70b-p5: Llama 2 70B, 4 x p5.48xlarge (FSDP)",
            target="eks", model="meta-llama/Llama-2-70b-hf", instance_type="p5.48xlarge",
            nodes=4, procs_per_node=8, strategy="FULL_SHARD", micro_batch=1, grad_accum=8,
            max_nodes=16, **_GPU_COMMON),
    # Llama 3 8B (8.0e9, hidden 4096, 32 layers, 128k vocabulary) on 1 x p5.48xlarge at 8192
    # tokens. The planner: 26.9 GiB per GPU of 80 (state 15.0, activations 6.2; the 128k
    # vocabulary's logits are chunked: 2.0).
    _preset("llama3-8b-p5", 1, "llama3-8b-p5: Llama 3 8B, 1 x p5.48xlarge, 8k context",
            target="eks", model="meta-llama/Meta-Llama-3-8B", instance_type="p5.48xlarge",
            nodes=1, procs_per_node=8, strategy="FULL_SHARD", micro_batch=2, grad_accum=8,
            **{**_GPU_COMMON, "seq_len": 8192}),
    # Other families of the architecture table (finetune_contract.families), one per GPU class;
    # memory per GPU from the planner (`make plan CONF='{"preset": NAME}'`).
    # Qwen2.5 1.5B (1.5e9, hidden 1536, 28 layers, tied 152k vocabulary) on 1 x g5.12xlarge
    # (4 x A10G 24 GB): a full fine-tune at 2048 tokens. The planner: 8.8 GiB per GPU of 24.
    _preset("qwen2.5-1.5b-g5", 1, "qwen2.5-1.5b-g5: Qwen2.5 1.5B, 1 x g5.12xlarge (4 A10G)",
            target="eks", model="Qwen/Qwen2.5-1.5B", instance_type="g5.12xlarge", nodes=1,
            procs_per_node=4, strategy="FULL_SHARD", micro_batch=1, grad_accum=8,
            **{**_GPU_COMMON, "seq_len": 2048}),
    # Phi-3.5-mini (3.8e9, fused qkv_proj/gate_up_proj) on 1 x g6.12xlarge (4 x L4 24 GB): LoRA
    # on its four Linears (lora_target_modules auto), the frozen base sharded. The planner: 7.0
    # GiB per GPU of 24.
    _preset("phi3.5-mini-lora-g6", 1, "phi3.5-mini-lora-g6: Phi-3.5-mini LoRA, 1 x g6.12xlarge",
            target="eks", model="microsoft/Phi-3.5-mini-instruct", instance_type="g6.12xlarge",
            nodes=1, procs_per_node=4, strategy="FULL_SHARD", micro_batch=2, grad_accum=4,
            lora_rank=16, lora_alpha=32.0, **{**_GPU_COMMON, "lr": 2e-4, "seq_len": 2048}),
    # Qwen2.5 7B (7.6e9, hidden 3584, 28 layers, 4 KV heads) on 1 x p4de.24xlarge (8 x A100).
    # The planner: 22.9 GiB per GPU of 80.
    _preset("qwen2.5-7b-p4de", 1, "qwen2.5-7b-p4de: Qwen2.5 7B, 1 x p4de.24xlarge (8 A100)",
            target="eks", model="Qwen/Qwen2.5-7B", instance_type="p4de.24xlarge", nodes=1,
            procs_per_node=8, strategy="FULL_SHARD", micro_batch=2, grad_accum=4,
            **_GPU_COMMON),
    # Mistral 7B v0.3 (7.2e9, hidden 4096, 32 layers) on 1 x p5.48xlarge (8 x H100). The
    # planner: 24.0 GiB per GPU of 80.
    _preset("mistral-7b-p5", 1, "mistral-7b-p5: Mistral 7B v0.3, 1 x p5.48xlarge (8 H100)",
            target="eks", model="mistralai/Mistral-7B-v0.3", instance_type="p5.48xlarge",
            nodes=1, procs_per_node=8, strategy="FULL_SHARD", micro_batch=4, grad_accum=4,
            **_GPU_COMMON),
    # Qwen3 8B (8.2e9, head_dim 128 with per-head q/k norms, 36 layers) on 1 x p5e.48xlarge
    # (8 x H200 141 GB) at 8192 tokens. The planner: 27.8 GiB per GPU of 141.
    _preset("qwen3-8b-p5e", 1, "qwen3-8b-p5e: Qwen3 8B, 1 x p5e.48xlarge (8 H200), 8k context",
            target="eks", model="Qwen/Qwen3-8B", instance_type="p5e.48xlarge", nodes=1,
            procs_per_node=8, strategy="FULL_SHARD", micro_batch=2, grad_accum=4,
            **{**_GPU_COMMON, "seq_len": 8192}),
)}

PRESET_NAMES = (NO_PRESET, *PRESETS)
PRESET_DISPLAY = {NO_PRESET: "none: the fields below as they are",
                  **{p.name: p.title for p in PRESETS.values()}}


def explicit_fields(conf: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a run's conf sets on purpose.

    A REST or CLI conf names only what it sets. The trigger form sends every field: there a
    field still at its built-in default counts as not set, so the preset's value stands.
    """
    if set(defaults) <= set(conf):
        return {k: v for k, v in conf.items() if k not in defaults
                or (v != defaults[k] and not (v is None and defaults[k] == ""))}
    return dict(conf)


def apply_preset(params: Mapping[str, Any], defaults: Mapping[str, Any],
                 given: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], Preset | None]:
    """Built-in defaults <- the preset `params` names <- the fields set on purpose.

    params: the run's params (the DAG's defaults filled in); given: the conf the run was
    triggered with (None: take params as the conf). Raises KeyError for an unknown preset.
    """
    name = params.get("preset", NO_PRESET)
    if name == NO_PRESET:
        return dict(params), None
    preset = PRESETS[name]
    explicit = explicit_fields(params if given is None else given, defaults)
    merged = {**defaults, **preset.values}
    merged.update(explicit)
    merged["preset"] = name
    return merged, preset
