"""The architecture table: what differs between the decoder-only families the trainer runs.

One row per Hugging Face `model_type` (config.json's), as plain data: the decoder block's Linear
layers (their shapes and biases, so LoRA's targets, the parameter count and the FLOPs follow from
them), LoRA's default targets, the tensor-parallel plan of a block, the norms, what a random init
fills, and the config keys of soft capping. `validate` reads it to refuse what the trainer would
refuse; the trainer (model.py, lora.py, tensor_parallel.py, loss.py) and the planner read the same
rows. A model_type outside the table is refused at validate, naming it and what is missing.

Shapes are written in the symbols of `dimensions`: hidden, q (heads x head_dim), kv (KV heads x
head_dim), mlp (intermediate_size), and their sums ("q+2kv": a fused q/k/v projection).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune_contract.fields import LORA_TARGETS_DEFAULT

# tensor-parallel styles of a block's modules (trainer/tensor_parallel.py implements each):
COLWISE = "colwise"  # output features split over the tp ranks
COLWISE_FUSED = "colwise_fused"  # a fused projection: each rank gets its part of every piece
COLWISE_DTENSOR = "colwise_dtensor"  # colwise, output kept a DTensor for a whole-projection norm
ROWWISE = "rowwise"  # input features split; output reduced and split along the sequence
SEQUENCE_NORM = "sequence_norm"  # a norm between matmuls: runs on the rank's part of the sequence
HEAD_NORM = "head_norm"  # a per-head norm (over head_dim): runs on the rank's heads
PROJECTION_NORM = "projection_norm"  # a norm over a whole split projection: reduces across ranks
ATTENTION_INPUT = "attention_input"  # gathers the sequence before the attention's projections
# ATTENTION_INPUT, and the attention told the rank's head counts (it slices a fused qkv by them)
ATTENTION_INPUT_RANK_HEADS = "attention_input_rank_heads"
MLP_INPUT = "mlp_input"  # gathers the sequence before the MLP's projections
TP_STYLES = (COLWISE, COLWISE_FUSED, COLWISE_DTENSOR, ROWWISE, SEQUENCE_NORM, HEAD_NORM,
             PROJECTION_NORM, ATTENTION_INPUT, ATTENTION_INPUT_RANK_HEADS, MLP_INPUT)
# Which layers attend through config.json's sliding_window (transformers' rule per family):
WINDOW_NONE = ""  # none: full causal attention everywhere
WINDOW_ALL = "all"  # every layer, when sliding_window is set (layer_types is not read)
# layer_types when config.json has it; else these rules, as transformers' configs derive it:
WINDOW_PAST_MAX_LAYERS = "past_max_window_layers"  # use_sliding_window: layers >= the key's
WINDOW_PATTERN = "pattern"  # every layer but each n-th (n: window_pattern, or its config key)
SLIDING, FULL = "sliding_attention", "full_attention"  # layer_types' values
# A Linear's bias: never, always, or as a boolean config key says.
NO_BIAS, ALWAYS_BIAS = "", "always"


@dataclass(frozen=True)
class Linear:
    """A Linear of a decoder block: its path in the block, in and out features, bias."""

    path: str
    fan_in: str
    fan_out: str
    bias: str = NO_BIAS  # NO_BIAS, ALWAYS_BIAS or the config key that turns it on

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Family:
    """One architecture's row. `tp_refused`: why tensor parallelism is refused ("" supported)."""

    model_type: str
    label: str  # as users name it
    causal_lm: str  # the transformers class config.json's architectures names
    linears: tuple[Linear, ...]
    lora_default: tuple[str, ...]  # lora_target_modules auto
    norms: tuple[str, ...]  # the block's hidden-size norms (two weights of `hidden` each...)
    qk_norm: str = ""  # "": none; HEAD_NORM (weights of head_dim); PROJECTION_NORM (q and kv)
    tp_plan: tuple[tuple[str, str], ...] = ()
    tp_refused: str = ""
    norm_init: float = 1.0  # random init of norm weights (Gemma's norms scale by 1 + weight)
    # Buffers that share a module with parameters, in no checkpoint: (buffer, attribute whose
    # value it holds). Random and pretrained builds fill them from the attribute.
    buffer_values: tuple[tuple[str, str], ...] = ()
    final_softcap_key: str = ""  # config key of tanh soft capping of the logits
    attention_softcap_key: str = ""  # of the attention scores (needs eager attention)
    versions: str = ""  # the releases of this row users know
    window_layers: str = WINDOW_NONE  # WINDOW_*: the layers sliding_window applies to
    window_default: int | None = None  # transformers' sliding_window when config.json has none
    window_pattern: int = 0  # WINDOW_PATTERN: each n-th layer attends fully
    window_pattern_key: str = ""  # ...or the config key that sets n (window_pattern: default)
    # Saved activations a block keeps beyond Llama's (the planner's ACT_HIDDEN x hidden +
    # ACT_MLP x mlp), bf16 elements per token, in the shape symbols; fitted to the slope of peak
    # memory over micro-batch on one H200 (docs/trainer.md "Model families").
    activation_extra: str = ""

    @property
    def mlp_output_unread(self) -> bool:
        """The block adds its MLP's output to the residual and reads it nowhere else (no norm
        after the MLP): a recompute for backward alone may skip computing it (trainer/offload)."""
        return "post_feedforward_layernorm" not in self.norms


def _attention(bias: str = NO_BIAS, o_bias: str = NO_BIAS) -> tuple[Linear, ...]:
    return (Linear("self_attn.q_proj", "hidden", "q", bias),
            Linear("self_attn.k_proj", "hidden", "kv", bias),
            Linear("self_attn.v_proj", "hidden", "kv", bias),
            Linear("self_attn.o_proj", "q", "hidden", o_bias))


def _mlp(bias: str = NO_BIAS) -> tuple[Linear, ...]:
    return (Linear("mlp.gate_proj", "hidden", "mlp", bias),
            Linear("mlp.up_proj", "hidden", "mlp", bias),
            Linear("mlp.down_proj", "mlp", "hidden", bias))


_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORMS = (*_PRE_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")
_OLMO2_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def _tp_plan(norms: tuple[str, ...], qk_norm: str = "") -> tuple[tuple[str, str], ...]:
    """Megatron's layout (torchtitan's for Llama): q/k/v and gate/up column-wise, o/down
    row-wise, the norms between them on the rank's part of the sequence."""
    qk_style = COLWISE_DTENSOR if qk_norm == PROJECTION_NORM else COLWISE
    plan = [(norm, SEQUENCE_NORM) for norm in norms]
    plan += [("self_attn", ATTENTION_INPUT), ("self_attn.q_proj", qk_style),
             ("self_attn.k_proj", qk_style), ("self_attn.v_proj", COLWISE),
             ("self_attn.o_proj", ROWWISE)]
    if qk_norm:
        plan += [("self_attn.q_norm", qk_norm), ("self_attn.k_norm", qk_norm)]
    plan += [("mlp", MLP_INPUT), ("mlp.gate_proj", COLWISE), ("mlp.up_proj", COLWISE),
             ("mlp.down_proj", ROWWISE)]
    return tuple(plan)


def _fused_tp_plan(norms: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Megatron's layout for fused projections (Phi-3's qkv_proj, gate_up_proj): each rank
    computes its part of every piece (its heads' q, k and v; its units' gate and up), so the
    attention slices q/k/v by the rank's head counts and the MLP chunks gate/up as it does."""
    plan = [(norm, SEQUENCE_NORM) for norm in norms]
    plan += [("self_attn", ATTENTION_INPUT_RANK_HEADS), ("self_attn.qkv_proj", COLWISE_FUSED),
             ("self_attn.o_proj", ROWWISE), ("mlp", MLP_INPUT),
             ("mlp.gate_up_proj", COLWISE_FUSED), ("mlp.down_proj", ROWWISE)]
    return tuple(plan)


_QWEN_WINDOWS: dict[str, Any] = {"window_layers": WINDOW_PAST_MAX_LAYERS, "window_default": 4096}
_GEMMA_BUFFERS = (("embed_scale", "scalar_embed_scale"),)  # the embedding's x sqrt(hidden)

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("llama", "Llama", "LlamaForCausalLM",
           _attention("attention_bias", "attention_bias") + _mlp("mlp_bias"), _SEPARATE,
           _PRE_NORMS, tp_plan=_tp_plan(_PRE_NORMS), versions="Llama 2, 3, 3.1, 3.2, 3.3"),
    Family("qwen2", "Qwen2", "Qwen2ForCausalLM", _attention(ALWAYS_BIAS) + _mlp(), _SEPARATE,
           _PRE_NORMS, tp_plan=_tp_plan(_PRE_NORMS), versions="Qwen2, Qwen2.5", **_QWEN_WINDOWS),
    Family("qwen3", "Qwen3", "Qwen3ForCausalLM",
           _attention("attention_bias", "attention_bias") + _mlp(), _SEPARATE, _PRE_NORMS,
           qk_norm=HEAD_NORM, tp_plan=_tp_plan(_PRE_NORMS, HEAD_NORM),
           versions="Qwen3 (dense)", activation_extra="2q+2kv", **_QWEN_WINDOWS),
    Family("mistral", "Mistral", "MistralForCausalLM", _attention() + _mlp(), _SEPARATE,
           _PRE_NORMS, tp_plan=_tp_plan(_PRE_NORMS), versions="Mistral 7B v0.1-v0.3, Nemo",
           window_layers=WINDOW_ALL, window_default=4096),
    Family("gemma2", "Gemma 2", "Gemma2ForCausalLM",
           _attention("attention_bias", "attention_bias") + _mlp(), _SEPARATE, _GEMMA_NORMS,
           tp_plan=_tp_plan(_GEMMA_NORMS), norm_init=0.0, buffer_values=_GEMMA_BUFFERS,
           final_softcap_key="final_logit_softcapping",
           attention_softcap_key="attn_logit_softcapping", versions="Gemma 2",
           window_layers=WINDOW_PATTERN, window_default=4096, window_pattern=2,
           activation_extra="3hidden"),
    Family("gemma3_text", "Gemma 3 (text)", "Gemma3ForCausalLM",
           _attention("attention_bias", "attention_bias") + _mlp(), _SEPARATE, _GEMMA_NORMS,
           qk_norm=HEAD_NORM, tp_plan=_tp_plan(_GEMMA_NORMS, HEAD_NORM), norm_init=0.0,
           buffer_values=_GEMMA_BUFFERS, final_softcap_key="final_logit_softcapping",
           attention_softcap_key="attn_logit_softcapping", versions="Gemma 3 1B, text-only",
           window_layers=WINDOW_PATTERN, window_default=4096, window_pattern=6,
           window_pattern_key="sliding_window_pattern", activation_extra="3hidden+2q+2kv"),
    Family("phi3", "Phi-3", "Phi3ForCausalLM",
           (Linear("self_attn.qkv_proj", "hidden", "q+2kv"),
            Linear("self_attn.o_proj", "q", "hidden"),
            Linear("mlp.gate_up_proj", "hidden", "2mlp"),
            Linear("mlp.down_proj", "mlp", "hidden")),
           ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), _PRE_NORMS,
           tp_plan=_fused_tp_plan(_PRE_NORMS), versions="Phi-3, Phi-3.5-mini, Phi-4",
           window_layers=WINDOW_ALL, activation_extra="q+3kv"),
    Family("olmo2", "OLMo 2", "Olmo2ForCausalLM",
           _attention("attention_bias", "attention_bias") + _mlp(), _SEPARATE, _OLMO2_NORMS,
           qk_norm=PROJECTION_NORM, tp_plan=_tp_plan(_OLMO2_NORMS, PROJECTION_NORM),
           versions="OLMo 2", activation_extra="2q+4kv"),
)}
# model_types that transformers knows and the trainer refuses, and why.
REFUSED: dict[str, str] = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "olmoe", "deepseek_v2",
                     "deepseek_v3", "dbrx", "jamba", "granitemoe", "llama4"),
                    "a mixture-of-experts model: the trainer shards, counts FLOPs and plans "
                    "memory for dense MLPs only"),
    "gemma3": "the multimodal Gemma 3 (vision tower): the trainer takes the text-only "
              "Gemma3ForCausalLM (model_type gemma3_text)",
}
# config.json keys that make a model a mixture of experts whatever its model_type says.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
BUILTIN_MODEL_TYPE = "llama"  # the built-in configs (finetune_contract.models) are Llama's


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def model_type_of(config: Any) -> str:
    """config.json's model_type (a built-in config's has none: Llama)."""
    value = _get(config, "model_type")
    return value if isinstance(value, str) and value else BUILTIN_MODEL_TYPE


def architecture_problem(config: Any) -> str | None:
    """Why the trainer cannot run this config's architecture, or None: it is in the table."""
    model_type = model_type_of(config)
    experts = [key for key in MOE_KEYS if _get(config, key)]
    if model_type in REFUSED:
        return f"model_type {model_type} is {REFUSED[model_type]}"
    if model_type not in FAMILIES:
        return (f"model_type {model_type} is not in the trainer's architecture table (its LoRA "
                "targets, tensor-parallel plan, init and FLOPs are not known); supported: "
                + ", ".join(FAMILIES))
    if experts:
        return f"model_type {model_type} with {experts[0]} is {REFUSED['mixtral']}"
    return None


def family_of(config: Any) -> Family:
    """The row of a config (a config.json mapping, a built-in's or a transformers config);
    ValueError naming the architecture and what is missing when it has none."""
    problem = architecture_problem(config)
    if problem:
        raise ValueError(problem)
    return FAMILIES[model_type_of(config)]


def head_dim(config: Any) -> int:
    """head_dim as the config states it, else hidden / heads (Gemma's 256 is neither)."""
    return _get(config, "head_dim") or _get(config, "hidden_size") // _get(
        config, "num_attention_heads")


def dimensions(config: Any) -> dict[str, int]:
    """The symbols the table's shapes are written in, for this config."""
    heads = _get(config, "num_attention_heads")
    q = heads * head_dim(config)
    kv = (_get(config, "num_key_value_heads") or heads) * head_dim(config)
    hidden, mlp = _get(config, "hidden_size"), _get(config, "intermediate_size")
    return {"hidden": hidden, "q": q, "kv": kv, "mlp": mlp}


_TERM = re.compile(r"(\d*)([a-z]+)")


def pieces(config: Any, shape: str) -> tuple[int, ...]:
    """The parts of a shape of the table, in order: "q+2kv" (a fused q/k/v) is (q, kv, kv),
    "2mlp" (a fused gate/up) (mlp, mlp), "hidden" (hidden,). A fused projection's output is its
    pieces side by side; tensor parallelism splits each piece (trainer/tensor_parallel.py)."""
    dims = dimensions(config)
    parts: list[int] = []
    for term in shape.split("+"):
        match = _TERM.fullmatch(term)
        if match is None or match[2] not in dims:
            raise ValueError(f"shape {shape!r}: {term!r} is not a count and one of {list(dims)}")
        parts += [dims[match[2]]] * int(match[1] or 1)
    return tuple(parts)


def size(config: Any, shape: str) -> int:
    """A shape of the table in features: the sum of its pieces."""
    return sum(pieces(config, shape))


def linear_shapes(config: Any) -> dict[str, tuple[int, int, bool]]:
    """{Linear name: (in features, out features, has a bias)} of one block of this config."""
    family = family_of(config)
    return {linear.name: (size(config, linear.fan_in), size(config, linear.fan_out),
                          linear.bias == ALWAYS_BIAS or bool(linear.bias and _get(config,
                                                                                  linear.bias)))
            for linear in family.linears}


def lora_targets(config: Any, lora_target_modules: str) -> list[str]:
    """The Linear names of `lora_target_modules` (comma-separated; auto: the family's default)."""
    names = [name.strip() for name in lora_target_modules.split(",") if name.strip()]
    return list(family_of(config).lora_default) if names == [LORA_TARGETS_DEFAULT] else names


def lora_target_problem(config: Any, lora_target_modules: str) -> str | None:
    """Why these LoRA targets are not Linear layers of this architecture's blocks, or None."""
    family = family_of(config)
    known = [linear.name for linear in family.linears]
    missing = [n for n in lora_targets(config, lora_target_modules) if n not in known]
    if not missing:
        return None
    return (f"names {', '.join(missing)}, which {family.label} ({family.model_type}) blocks do "
            f"not have; their Linear layers: {', '.join(known)} (auto: "
            f"{','.join(family.lora_default)})")


def softcap(config: Any, key: str) -> float | None:
    """The soft-capping value of `key` (a Family's *_softcap_key), None when off."""
    value = _get(config, key) if key else None
    return float(value) if value else None


def attention_kernel(config: Any) -> str:
    """The attention the trainer runs: sdpa, or eager where the scores are soft-capped (Gemma
    2): sdpa has no cap, and the exported model (eager by default then) would compute another
    loss. The planner's attention time reads it too."""
    family = family_of(config)
    return "eager" if softcap(config, family.attention_softcap_key) else "sdpa"


def attention_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as the family's transformers
    model applies config.json's `sliding_window`, `layer_types` and the keys behind them."""
    family, layers = family_of(config), _get(config, "num_hidden_layers")
    window = _get(config, "sliding_window") if _has(config, "sliding_window") \
        else family.window_default
    if family.window_layers == WINDOW_NONE or not window:
        return [None] * layers
    if family.window_layers == WINDOW_ALL:
        return [window] * layers
    types = _get(config, "layer_types")
    if family.window_layers == WINDOW_PAST_MAX_LAYERS and not types:
        if not _get(config, "use_sliding_window"):
            return [None] * layers
        first = _get(config, "max_window_layers")
        first = 28 if first is None else first  # transformers' default
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    elif not types:
        every = (_get(config, family.window_pattern_key) if family.window_pattern_key else None) \
            or family.window_pattern
        types = [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    return [window if kind == SLIDING else None for kind in types]


def _has(config: Any, key: str) -> bool:
    return key in config if isinstance(config, Mapping) else hasattr(config, key)


def attended_length(seq_len: int, window: int | None) -> float:
    """The keys a layer's FLOPs count per query: seq_len for full causal attention (the usual
    convention counts the whole score matrix, twice the causal half computed); with a sliding
    window W < seq_len, twice the causal band's mean keys per query (W - W^2 / (2 seq_len))."""
    if window is None or window >= seq_len:
        return float(seq_len)
    return 2 * window - window * window / seq_len


def parameter_count(config: Any) -> dict[str, int]:
    """Parameters read off a config of the table: embedding, blocks (and final norm), head."""
    family, dims = family_of(config), dimensions(config)
    hidden, layers, vocab = dims["hidden"], _get(config, "num_hidden_layers"), _get(
        config, "vocab_size")
    block = sum(fan_in * fan_out + (fan_out if bias else 0)
                for fan_in, fan_out, bias in linear_shapes(config).values())
    block += len(family.norms) * hidden
    if family.qk_norm == HEAD_NORM:
        block += 2 * head_dim(config)
    elif family.qk_norm == PROJECTION_NORM:
        block += dims["q"] + dims["kv"]
    tied = _get(config, "tie_word_embeddings")
    return {"embedding": vocab * hidden, "blocks": layers * block + hidden,
            "lm_head": 0 if tied else vocab * hidden}


def flops_per_token(config: Any, seq_len: int, adapter_params: int | None = None) -> float:
    """Training FLOPs per token: 6 x (params - input embedding) + 12 x layers x q x seq_len
    (per layer, seq_len is the keys it attends: fewer under a sliding window, `attended_length`).

    The input embedding is a lookup, not a matmul; a tied embedding still does the head's matmul,
    so it is counted once, as the head. Attention's scores and weighted sum use q = heads x
    head_dim (not hidden: Gemma's and Qwen3's head_dim is not hidden / heads). With LoRA
    (`adapter_params` trainable, the rest frozen) frozen weights cost 2 (forward) + 2 (input
    gradients) FLOPs per parameter, not 6 (no weight gradient), and the adapters 6. Soft capping
    and norms are elementwise and not counted (as the usual MFU definitions do); so are the
    biases' adds, which are in the parameter count and cost 6 like a weight.
    """
    counts = parameter_count(config)
    matmul_params = counts["blocks"] + _get(config, "vocab_size") * _get(config, "hidden_size")
    attention = attention_flops(config, seq_len)
    if adapter_params is not None:
        return 4 * matmul_params + 6 * adapter_params + attention
    return 6 * matmul_params + attention


def activation_extra(config: Any) -> int:
    """The family's saved activations beyond Llama's block, elements per token per block."""
    extra = family_of(config).activation_extra
    return size(config, extra) if extra else 0


def attention_flops(config: Any, seq_len: int, windows: bool = True) -> float:
    """Attention's training FLOPs per token (scores and weighted sum, forward and backward):
    12 x q x the keys each layer attends (`attended_length`). windows=False: as if every layer
    attended the whole sequence, what the kernels compute when a window is only a mask."""
    layers = attention_windows(config) if windows else [None] * _get(config, "num_hidden_layers")
    return 12 * dimensions(config)["q"] * sum(attended_length(seq_len, w) for w in layers)


def adapter_input_features(config: Any, lora_target_modules: str) -> int:
    """The input features of one block's LoRA-targeted Linears, summed: with LoRA dropout each
    keeps its own dropped copy of its input for backward."""
    shapes = linear_shapes(config)
    return sum(shapes[name][0] for name in lora_targets(config, lora_target_modules)
               if name in shapes)


def adapter_params(config: Any, lora_rank: int, lora_target_modules: str) -> int:
    """LoRA's trainable parameters: rank x (in + out) per targeted Linear per block."""
    shapes = linear_shapes(config)
    per_layer = sum(lora_rank * (shapes[name][0] + shapes[name][1])
                    for name in lora_targets(config, lora_target_modules) if name in shapes)
    return per_layer * _get(config, "num_hidden_layers")
