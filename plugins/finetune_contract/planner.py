"""The planner: a run's peak memory per GPU, step time, wall time and cost, before it is paid for.

Pure arithmetic on the model's shape (finetune_contract.models) and the run's TrainConfig; the GPU
(memory, peak FLOPs) and the links (bus bandwidths) are arguments, so validate passes the instance
profile's figures and the trainer at start its real GPU's. Calibrated against the measured H200
rows in `bench/plan_calibration.py`; `tests/bench/test_plan_calibration.py` holds it to the errors
stated here (MEMORY_ERROR, THROUGHPUT_ERROR).

Memory per GPU is the larger of two moments of a step:
- the end of forward: fp32 masters and AdamW state (12 bytes a parameter, sharded over the shard
  group; plus fp32 gradients once a micro-batch has made them, with grad_accum > 1), the bf16
  compute copies (one GPU without FSDP) or FSDP's gathered blocks, every saved activation, and
  the loss's logits chunk;
- the end of backward: the same state with all gradients (16 bytes a parameter), activations gone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from finetune_contract.families import (
    activation_extra,
    adapter_input_features,
    adapter_params,
    architecture_problem,
    attention_kernel,
    attention_windows,
    dimensions,
    linear_shapes,
)
from finetune_contract.families import attention_flops as attention_work
from finetune_contract.families import head_dim as family_head_dim
from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.parallel_dims import ParallelDims
from finetune_contract.rules import (
    float8_reads_masters,
    loss_chunk_tokens,
    mlp_tile_fraction,
    offloads_blocks,
    selective_every,
)
from finetune_contract.throughput import (
    MEMORY_BANDWIDTH_BY_DEVICE,
    PEAK_FLOPS_BY_DEVICE,
    flops_per_token,
    parameter_count,
)
from finetune_contract.train_config import TrainConfig

GIB = 1 << 30
AUTO = "auto"
# The planner's stated error on peak memory over the calibration rows
# (tests/bench/test_plan_calibration.py fails when it is exceeded), and what a GPU holds outside
# the allocator's peak (CUDA context, NCCL's buffers): a run fits when its estimate, this much
# larger, and that, fit.
MEMORY_ERROR = 0.03  # 8B QLoRA without checkpointing on the H100: 2.5% over (1B float8 at
# micro-batch 1 was 2.6% over before its row was superseded)
# Offloaded blocks (trainer/offload.py): rows of the trainer as it runs now from 4k to 400k tokens,
# 4.4% the largest (OFFLOAD_HIDDEN): a run in that mode is planned with this margin; past the
# longest such row (8B LoRA at 400,000 tokens) it grows in proportion to the tokens (an
# extrapolation: 13.1% at 1,048,576).
OFFLOAD_MEMORY_ERROR, OFFLOAD_MEASURED_TOKENS = 0.05, 400_000
RESERVED_GIB = 1.5
# QLoRA's NF4 (trainer/qlora.py): values per absmax scale, and scales per quantized scale (double
# quantization): 4 bits a value, an 8-bit scale per block, an fp32 scale per block of scales.
NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK_SIZE + 4 / (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE)
# Dequantizing NF4 weights for their matmuls: seconds per parameter per pass (forward, backward,
# a recompute), fitted between the 8B and 70B QLoRA rows once LoRA's own passes were counted
# (LORA_S_PER_ELEMENT; 2026-12-03: +1.4% and -8.4% on tokens/s).
NF4_DEQUANT_S_PER_PARAM = 0.4e-12
# The stated error on tokens/s per GPU over the same rows.
THROUGHPUT_ERROR = 0.10
# Saved activations of one Llama block without checkpointing, bf16 elements per token: fitted to
# the measured slope of peak memory over micro-batch (1B and 3B, seq 4096): 7 x hidden + 3 x MLP.
ACT_HIDDEN, ACT_MLP = 7, 3
# Selective per-op checkpointing keeps the matmul outputs: q, k, v, o, gate, up, down and the block
# input (not measured on the H200 yet: an estimate from what the policy saves).
SELECTIVE_HIDDEN, SELECTIVE_MLP = 4, 2
# torchao float8 saves the Linears' inputs in float8: 72.5 GiB for 84.7 at 3B micro-batch 4.
FLOAT8_ACTIVATION_FACTOR = 0.70
# The CUDA caching allocator's fragmentation and small buffers: the fit's residual at the peak.
OVERHEAD_GIB = 1.0
# FSDP prefetches the next block while one runs: two blocks gathered at once.
GATHERED_BLOCKS = 2
# Offloaded block inputs on the GPU at once (trainer/offload.py): the one copying out while the
# next block runs, in backward the one in use and the one fetched ahead.
OFFLOAD_IN_FLIGHT = 2
# One offloaded block's recompute and backward, bf16 elements per token: hidden-wide tensors
# (the attention's inputs, outputs and their gradients) and, over one MLP slice, MLP-wide ones
# (gate, up, their product and gradients); with OFFLOAD_OVERHEAD_GIB fitted to the H100 rows of
# the trainer as it runs now (the adapters added in place, 4-bit weights dequantized again in
# backward: 8B QLoRA at 4k, 32k and 128k tokens, 7.78, 9.85 and 21.18 GiB, 2026-12-07; LoRA at
# 4k, 17.13, 2026-12-06, and at 400k, 61.51, 2026-12-07; bench/plan_calibration.py), the largest
# error the least: 4.4%, within OFFLOAD_MEMORY_ERROR. An empirical triple: the peaks grow by
# about 15 hidden-wide elements a token from 32k to 400k (0.115 GiB a thousand tokens, QLoRA and
# LoRA alike) from a base below the sum of the parts with OVERHEAD_GIB; the allocator's record of
# the 4k QLoRA peak (bench.train --memory-peak) holds eight MLP-wide tensors of the slice. (10.0,
# 0.95 and OVERHEAD_GIB, fitted to the rows up to 128k, were 12.5% under at LoRA's 400k; fitted to
# the five rows of peft's add, 11.6 and 3.2 were 11-15% over the short rows.)
OFFLOAD_HIDDEN, OFFLOAD_MLP, OFFLOAD_OVERHEAD_GIB = 12.0, 1.7, 0.0
# Share of the offloaded block inputs' copies (out in forward, in during backward, on side
# streams a block ahead) the compute does not hide: fitted to the same five rows' tokens/s,
# none once the H100's memory-bound work is timed at its own bandwidth (it was 0.25 with the
# H200's; the rows are within 4.6%).
OFFLOAD_EXPOSED = 0.0
# Fractions of the dense bf16 peak the kernels reach on the H200 (docs/trainer.md "Where the
# time goes":
# GEMMs 707 TFLOP/s; cuDNN attention 365 at head dim 128, 286 at 64, real causal FLOPs, which
# are half the 12 x layers x hidden x seq_len counted).
GEMM_EFFICIENCY = 707 / 989
# Head dim 256 (Gemma 2 and 3): 134 TFLOP/s, Gemma 2 2B's causal layers at seq 4096 (its
# profile, one H200, 2026-12-03: docs/notes/2026-12-03-h200-profile-gemma2-2b.log).
ATTENTION_EFFICIENCY = {128: 2 * 365 / 989, 64: 2 * 286 / 989, 256: 2 * 134 / 989}
# Soft-capped attention scores (Gemma 2) run eager attention (families.attention_kernel): its
# compiled softmax keeps two heads x seq_len score rows per token and layer for backward (the
# capped scores and the probabilities, bf16), and runs at about cuDNN's head-dim-256 rate:
# Gemma 2 at 8 layers (2B widths) 7.06 GiB per 4096-token sequence against 3.07 with sdpa, and
# the same tokens/s within 1% (one H200, 2026-12-04: docs/notes/2026-12-04-h200-gemma2-eager.log).
EAGER_SCORE_ROWS = 2
# A layer whose sliding window is shorter than the sequence hands sdpa its window as a mask:
# cuDNN's masked kernel runs at this share of the causal rate (Gemma 3 1B, 22 of 26 layers
# windowed at seq 4096: 54 ms of attention a step; its profile, one H200, 2026-12-03).
MASKED_ATTENTION_RATE = 0.71
# Packed rows under sdpa: transformers hands every layer the block-diagonal mask, and sdpa takes
# it as an additive bias with K and V repeated to the query heads, in a kernel that computes
# the whole square at a fraction of cuDNN's causal rate. The kernels alone ran at 0.31 of it
# (8.74 ms against 2.76 forward and backward at 1B's heads, 11.26 against 3.32 at 3B's, 4 x 4096
# tokens); the rate here is fitted to the training step (1B, 46,340 tokens/s against 59,290
# unpacked), as the causal rate it divides is the H200's fitted one, below the H100's measured
# (one H100, 2026-12-06: docs/notes/2026-12-06-h100-fa4-packing.log). fa4's varlen kernels take
# no mask: the causal rate, over documents the planner takes as long as the row (shorter ones
# only speed it up: 65,290 tokens/s with 128-2,048-token documents against 57,040 estimated).
PACKED_MASK_ATTENTION_RATE = 0.38
# `attention: fa4`: FlashAttention 4's causal kernels against cuDNN's rate above (the planner's
# sdpa rate), fitted to the training steps, head dim 128: 8B QLoRA offloaded at 32k and 128k
# tokens (6,685 and 3,073 tokens/s against sdpa's 6,353 and 2,717, one H100, 2026-12-07:
# docs/notes/2026-12-07-h100-fa4-long-context.log), within 2% there and on the 1B and 3B rows at
# 4k (one H200, 2026-12-04). The kernels alone, 3B's heads at 4k: 1.19x forward, 1.04x backward
# (one H200, 2026-12-02).
FA4_ATTENTION_RATE = 1.2
# cuDNN attention is faster on longer sequences: the 3B 32k-sequence rows need this exponent of
# seq_len / 4096 on its rate (capped), the 4096 rows none.
ATTENTION_SEQ_EXPONENT, ATTENTION_SEQ_CAP = 0.15, 1.4
# Past the length where the cap is reached (about 38,600 tokens) the rate falls again, slowly:
# this exponent of seq_len over that length, fitted to the 8B offloaded rows at 128k and 400k
# tokens (one H100, 2026-12-06: a 400k step is about 90% attention and ran 14% slower than the
# capped rate says). Why is not measured (the clocks under minutes of sustained load, or the
# kernel).
ATTENTION_LONG_EXPONENT = 0.055
# The HBM bandwidth the memory-bound constants below were fitted at (the H200's); on another GPU
# their time scales by this over its bandwidth (Hardware.memory_time_factor).
REFERENCE_BANDWIDTH = 4.8e12
# Elementwise kernels (norms, SiLU, RoPE, residuals, the loss's pass) and the GPU's idle 2%, per
# second of bf16 GEMM time (11% of the 1B and 3B steps, where GEMMs are 64-69%).
ELEMENTWISE_PER_GEMM = 0.16
# Kernel launches and small work per block and micro-batch, whatever its size (the fit of
# micro-batch 4 against 8 on 1B and 3B).
LAUNCH_S_PER_LAYER = 0.65e-3
# Share of FSDP's collectives not hidden behind compute on the H200s measured (NCCL's kernels
# share the SMs with the GEMMs): 3B FULL_SHARD at 2 and 4 GPUs shows nearly all, 8B full AC a
# third.
COMM_EXPOSED = 0.6
# AdamW, the bf16 copies and the gradient casts: memory bound, seconds per parameter per optimizer
# step (from 3B: micro-batch 4 with and without grad_accum 4, one H200).
OPTIMIZER_S_PER_PARAM = 1.1e-11
# LoRA's adapter passes (x @ A, @ B, the scaled add, their gradients): seconds per token per
# element of the adapted Linears' input and output widths (8B LoRA and QLoRA, one H200,
# 2026-12-03: about 12 bytes of memory traffic each).
LORA_S_PER_ELEMENT = 2.8e-12
# FSDP's per-block work at any world size (casts, copy-in/out): 3B FULL_SHARD vs no FSDP, one GPU.
FSDP_S_PER_LAYER = 0.5e-3
# float8 block matmuls take this share of their bf16 time (float8 GEMMs reach 1.6-1.8x the bf16
# rate; rowwise's, scaled per row, less). Their activation casts (each block Linear's input and
# output gradient; rowwise's along rows and again along columns for the weight gradient) take
# this many seconds per token and element of the Linears' widths (fan-in + fan-out), at the
# H200's bandwidth: per element, not per GEMM FLOP, so a narrower model pays more of them per
# FLOP (tensorwise's mostly fuse into the compiled neighbours). And each optimizer step pays a
# fixed cost, whatever the model and its tokens: at micro-batch 1 float8 was about 30 ms a step
# slower than the GEMM saving predicts at 1B and at 3B alike (the H100, 2026-12-07), so it is not
# per layer, parameter or element; where it goes was not profiled.
# Fitted on 2026-12-07 to the fourteen current float8 rows (H100: 1B at micro-batch 1 and 4, 3B
# at 1, 2 and 2 x 2, sdpa and fa4) and the two 3B micro-batch 4 rows of the H200 (from bf16
# copies, 2026-12-01), the GEMM shares held where float8 GEMMs run: every current row within
# 5.6%, the H200's within 5.4%. A cast per GEMM FLOP and per parameter, as before, left 3B
# 5-7.5% under and 1B at micro-batch 1 20% over. 1B at micro-batch 1 varies most from one H100
# to another: 42,960 tokens/s tensorwise on 2026-12-06's machine, 37,250 on 2026-12-07's.
# Rowwise also pays per block weight and micro-batch (its casts of each weight along rows for
# forward and along columns for the input's gradient, from the fp32 masters): one H200
# (2026-12-07, 20:00-20:15 UTC) put 8B rowwise 78 ms a step behind tensorwise at micro-batch 1
# and 85 at 2, where per-element casts alone would double it, and the model without this term
# 9.8% over at 8B micro-batch 1. Refitted then with it (and rowwise's per-element cast 2.6e-12
# -> 1.0e-12): every current rowwise row within 3.6%.
FLOAT8_GEMM_TIME = {"tensorwise": 0.56, "rowwise": 0.64}
FLOAT8_CAST_S_PER_ELEMENT = {"tensorwise": 0.2e-12, "rowwise": 1.0e-12}
FLOAT8_S_PER_STEP = {"tensorwise": 0.024, "rowwise": 0.020}
FLOAT8_S_PER_WEIGHT = {"tensorwise": 0.0, "rowwise": 6e-12}
# Host-device copies (activation offload, cpu_offload) over PCIe, bytes per second a direction:
# Gen4 x16's 25 GB/s at the 80% instance_types assumes of a link ([LINE]).
PCIE_BYTES_PER_S = 0.8 * 25e9
# AdamW on the CPU (cpu_offload): seconds per parameter per step, fused AdamW's GPU figure x 50 for
# host memory bandwidth (an estimate, not measured here).
CPU_OPTIMIZER_S_PER_PARAM = 50 * 1.1e-11
# A ring collective's per-hop latency (NCCL over NVLink / EFA): what makes 1,000 ranks slower
# than 8 at equal bytes per rank. An assumption, not a measurement of this project.
HOP_LATENCY_S = {"intra": 5e-6, "inter": 15e-6}
# Settings `activation_checkpointing: auto` chooses among, cheapest in recompute first.
AUTO_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"activation_checkpointing": "none", "activation_offload": False},
    {"activation_checkpointing": "selective", "selective_ac": "op", "activation_offload": False},
    {"activation_checkpointing": "selective", "selective_ac": "2", "activation_offload": False},
    {"activation_checkpointing": "full", "activation_offload": False},
    {"activation_checkpointing": "full", "activation_offload": True},
)


@dataclass(frozen=True)
class Hardware:
    """What the planner needs of a GPU and its links; None where not known (a CPU, a new GPU)."""

    gpu_memory_gib: float | None
    peak_flops: float | None
    busbw_intra_gbps: float | None = None
    busbw_inter_gbps: float | None = None
    name: str = "GPU"
    node_memory_gib: float | None = None  # CPU memory a node's pod may use (offloaded inputs)
    memory_bandwidth: float | None = None  # bytes/s; None: the H200's, as fitted

    @classmethod
    def of_gpu(cls, gpu_model: str, gpu_memory_gib: float | None, **links: Any) -> Hardware:
        """From a GPU's model name: its dense bf16 peak and memory bandwidth where the contract
        knows them."""
        peak = next((f for key, f in PEAK_FLOPS_BY_DEVICE.items() if key in gpu_model), None)
        bandwidth = next((b for key, b in MEMORY_BANDWIDTH_BY_DEVICE.items()
                          if key in gpu_model), None)
        return cls(gpu_memory_gib, peak, name=gpu_model, memory_bandwidth=bandwidth, **links)

    @property
    def memory_time_factor(self) -> float:
        """How much longer memory-bound work takes here than on the H200 the constants were
        fitted on (its bandwidth over this GPU's)."""
        return REFERENCE_BANDWIDTH / (self.memory_bandwidth or REFERENCE_BANDWIDTH)


@dataclass(frozen=True)
class Estimate:
    """The planner's answer for one run; memory in GiB per GPU, times in seconds."""

    peak_gib: float | None
    parts_gib: dict[str, float]
    step_time_s: float | None
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    comm_s: float | None  # communication time per step, before overlap
    exposed_comm_s: float | None  # what of it is not hidden behind compute
    gpu_memory_gib: float | None
    note: str = ""  # why a figure is n/a
    memory_error: float = MEMORY_ERROR  # the stated error of peak_gib for this run's mode

    @property
    def fits(self) -> bool | None:
        if self.peak_gib is None or self.gpu_memory_gib is None:
            return None
        return self.peak_gib * (1 + self.memory_error) + RESERVED_GIB <= self.gpu_memory_gib

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"fits": self.fits}


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "vocab_size")


def model_config(model: str, config: Any = None) -> Any:
    """Attribute access to a built-in model's config (or a given config mapping); None unknown
    or outside the architecture table (finetune_contract.families)."""
    values = config if config is not None else BUILTIN_MODELS.get(model)
    if values is None:
        return None
    if not isinstance(values, dict):
        values = values.to_dict() if hasattr(values, "to_dict") else vars(values)
    if not all(isinstance(values.get(key), int) and values[key] > 0 for key in _SHAPE_KEYS):
        return None  # not a config we can size; loading it says what is wrong
    if architecture_problem(values):
        return None  # not in the architecture table: the rules name it
    # LlamaConfig's defaults for what a config.json may leave out
    return SimpleNamespace(**{"num_key_value_heads": values["num_attention_heads"],
                              "tie_word_embeddings": False, **values})


def _adapter_params(cfg: TrainConfig, config: Any) -> int:
    return adapter_params(config, cfg.lora_rank, cfg.lora_target_modules)


def trained_parameters(cfg: TrainConfig, config: Any = None) -> int | None:
    """The parameters a run trains (LoRA: its adapters'), which its checkpoints hold; None for
    a model not known here."""
    config = model_config(cfg.model, config)
    if config is None:
        return None
    return _adapter_params(cfg, config) if cfg.lora_rank else sum(parameter_count(config).values())


def activation_bytes_per_token(cfg: TrainConfig, config: Any) -> tuple[float, float]:
    """(saved bytes per token of all blocks, of one block recomputed in backward)."""
    hidden, mlp, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    elem = element_bytes(cfg)
    # Eager attention (soft-capped scores) keeps its score rows for backward (EAGER_SCORE_ROWS).
    scores = EAGER_SCORE_ROWS * elem * config.num_attention_heads * cfg.seq_len \
        if attention_kernel(config) == "eager" else 0
    if packed_under_mask(cfg):  # a block keeps the mask as a bias row and K, V repeated
        dims = dimensions(config)
        scores += elem * (cfg.seq_len + 2 * (dims["q"] - dims["kv"]))

    # LoRA dropout: each adapter keeps its dropped input and dropout's mask (a byte a value)
    dropped = (elem + 1) * adapter_input_features(config, cfg.lora_target_modules) \
        if cfg.lora_rank and cfg.lora_dropout > 0 else 0

    def block_bytes(hidden_wide: float, mlp_wide: float) -> float:
        """One block's activations per token: `hidden_wide` and `mlp_wide` tensors' elements."""
        kept = elem * (hidden_wide * hidden + mlp_wide * mlp + activation_extra(config))
        return kept * (FLOAT8_ACTIVATION_FACTOR if cfg.float8 else 1) + scores + dropped

    block = block_bytes(ACT_HIDDEN, ACT_MLP)
    boundary = elem * hidden  # a checkpointed block keeps only its input
    mode = cfg.activation_checkpointing
    if mode == "full":
        saved, recompute = layers * boundary, block
    elif mode == "selective" and selective_every(cfg.selective_ac) is None:
        saved = layers * (elem * (SELECTIVE_HIDDEN * hidden + SELECTIVE_MLP * mlp) + scores)
        recompute = block
    elif mode == "selective":
        every = selective_every(cfg.selective_ac) or 1
        checkpointed = layers // every
        saved, recompute = checkpointed * boundary + (layers - checkpointed) * block, block
    else:
        saved, recompute = layers * block, 0.0
    if offloads_blocks(cfg):  # trainer/offload.py: the inputs in CPU memory, the MLP tiled
        tokens = cfg.micro_batch * cfg.seq_len
        tile = mlp_tile_fraction(cfg, tokens)
        recompute = block_bytes(OFFLOAD_HIDDEN, OFFLOAD_MLP * tile)
        saved = OFFLOAD_IN_FLIGHT * boundary
    elif cfg.activation_offload:  # saved tensors wait in CPU memory; a block's are in flight
        saved = min(saved, GATHERED_BLOCKS * saved / layers)
    return saved, recompute


def host_offload_bytes(cfg: TrainConfig, config: Any) -> float:
    """CPU memory the offloaded block inputs take per GPU (trainer/offload.py), 0 otherwise."""
    if not offloads_blocks(cfg):
        return 0.0
    return (config.num_hidden_layers * element_bytes(cfg) * config.hidden_size * cfg.micro_batch
            * cfg.seq_len)


def element_bytes(cfg: TrainConfig) -> int:
    """Bytes of an activation element: the compute dtype's."""
    return 4 if cfg.mixed_precision == "fp32" else 2


def packed_under_mask(cfg: TrainConfig) -> bool:
    """Packed rows that reach attention as transformers' block-diagonal mask (sdpa): fa4 takes
    their documents' bounds instead (trainer.batch.packed_documents)."""
    return cfg.packing and cfg.attention == "sdpa"


def packed_mask_bytes(cfg: TrainConfig) -> float:
    """Packed rows under sdpa: transformers' block-diagonal causal mask, a byte per query and
    key of each row (a quadratic term: 17 GB at 131,072 tokens), made once for all layers (each
    block's bias made of it: activation_bytes_per_token); 0 otherwise."""
    return float(cfg.micro_batch * cfg.seq_len ** 2) if packed_under_mask(cfg) else 0.0


def estimate(cfg: TrainConfig, *, world_size: int, local_world_size: int, hardware: Hardware,
             config: Any = None) -> Estimate:
    """Peak memory per GPU and step time of `cfg` on `world_size` GPUs of `hardware`.

    config: the model's config (a transformers config or a mapping); None: a built-in model's.
    An unknown model gives n/a with the reason, never an exception."""
    config = model_config(cfg.model, config)
    if config is None:
        return Estimate(None, {}, None, None, None, None, None, hardware.gpu_memory_gib,
                        note=f"model {cfg.model!r} is not built in and no Llama-shaped config "
                             "of it is read here: n/a until the trainer starts")
    counts = parameter_count(config)
    params = sum(counts.values())
    layers = config.num_hidden_layers
    tp = cfg.tp_degree
    layout = ParallelDims.of(cfg, world_size=world_size, procs_per_node=local_world_size)
    shard = layout.param_shards
    no_fsdp = not layout.needs_fsdp(cfg.cpu_offload)
    compute_bytes = element_bytes(cfg)
    tokens = cfg.micro_batch * cfg.seq_len  # per micro-batch per data-parallel rank
    lora = _adapter_params(cfg, config) if cfg.lora_rank else 0
    trained = lora or params
    # QLoRA: the blocks' Linear weights in NF4, whole on every GPU (outside FSDP's sharding)
    linears = counts["blocks"] - layers * 2 * config.hidden_size - config.hidden_size
    quantized = linears if cfg.quantize_base == "nf4" and lora else 0
    nf4 = NF4_BYTES_PER_PARAM * quantized
    # fp32 masters (a LoRA run's frozen base too, but below), AdamW's two moments, fp32 grads.
    masters = 4 * (params - quantized)
    optimizer = 8 * trained
    grads = 4 * trained
    if cfg.cpu_offload:
        masters = optimizer = grads = 0
    block_params = (counts["blocks"] - quantized) / layers
    embedding = counts["embedding"] + counts["lm_head"]
    # One GPU without FSDP (trainer/master_weights.py): a frozen weight is made in the compute
    # dtype and has no fp32 master at any time.
    if no_fsdp and lora and cfg.mixed_precision != "fp32" and not cfg.cpu_offload:
        masters = 4 * trained
    if no_fsdp:
        sharded = 1
        # trained float8 Linears cast their fp32 masters: no copies (rules.float8_reads_masters)
        read = linears if not lora and float8_reads_masters(cfg) else 0
        copies = (compute_bytes * (params - quantized - read)
                  if cfg.mixed_precision != "fp32" else 0)
        if copies and layout.reshard_after_forward and not lora:
            # a block's copies only while it runs, as FSDP's gathered weights
            copies = compute_bytes * (GATHERED_BLOCKS * (block_params - read / layers) + embedding)
    else:
        sharded = shard
        blocks_held = layers if cfg.strategy == "SHARD_GRAD_OP" else GATHERED_BLOCKS
        copies = compute_bytes * (blocks_held * block_params + embedding) / tp
    saved, recompute = activation_bytes_per_token(cfg, config)
    activations = (saved * tokens + recompute * tokens) / tp
    if quantized and cfg.compile:
        # A block's dequantized weights while its backward runs: none is kept from forward to
        # backward (trainer/lora.py dequantizes again), tests/trainer/test_qlora.py checks.
        activations += compute_bytes * quantized / layers
    activations += packed_mask_bytes(cfg)
    chunk = min(tokens // tp or 1, loss_chunk_tokens(cfg, config.vocab_size))
    loss = 4 * chunk * config.vocab_size  # the chunk's logits and their gradient, bf16
    state_forward = (masters + optimizer + (grads if cfg.grad_accum > 1 else 0)) / sharded
    state_backward = (masters + optimizer + grads) / sharded
    forward_end = state_forward + nf4 + copies + activations + loss
    if offloads_blocks(cfg):
        # Each block's recompute and backward run on their own, after the loss's chunks are
        # gone: the larger of the two is live, beside the inputs in flight.
        forward_end -= min(loss, recompute * tokens / tp)
    backward_end = state_backward + nf4 + copies + recompute * tokens / tp
    overhead = OFFLOAD_OVERHEAD_GIB if offloads_blocks(cfg) else OVERHEAD_GIB
    parts = {"parameters": (masters / sharded + nf4) / GIB, "optimizer": optimizer / sharded / GIB,
             "gradients": grads / sharded / GIB, "compute_copies": copies / GIB,
             "activations": activations / GIB, "loss_chunk": loss / GIB,
             "overhead": overhead}
    host = host_offload_bytes(cfg, config)
    if host:  # CPU memory, not in the GPU's peak
        parts["host_offload"] = host / GIB
    peak = max(forward_end, backward_end) / GIB + overhead
    step, comm, exposed = _step_time(cfg, config, hardware, layout, no_fsdp, params, trained,
                                     lora, quantized)
    tokens_per_s = tokens * cfg.grad_accum / tp / step if step else None
    token_flops = flops_per_token(config, cfg.seq_len, lora or None)
    mfu = (tokens_per_s * token_flops / hardware.peak_flops
           if tokens_per_s and hardware.peak_flops and not cfg.float8 else None)
    return Estimate(round(peak, 2), {k: round(v, 2) for k, v in parts.items()}, step,
                    tokens_per_s, mfu, comm, exposed, hardware.gpu_memory_gib,
                    note="" if step else "no peak FLOPs for this device: no time estimate",
                    memory_error=memory_error(cfg))


def memory_error(cfg: TrainConfig) -> float:
    """The stated error of the peak for `cfg`'s mode, the margin `Estimate.fits` plans with."""
    if not offloads_blocks(cfg):
        return MEMORY_ERROR
    return OFFLOAD_MEMORY_ERROR * max(1.0, cfg.micro_batch * cfg.seq_len / OFFLOAD_MEASURED_TOKENS)


def _step_time(cfg: TrainConfig, config: Any, hardware: Hardware, layout: ParallelDims,
               no_fsdp: bool, params: int, trained: int, lora: int, quantized: float = 0
               ) -> tuple[float | None, float | None, float | None]:
    """(step seconds, communication seconds, of which exposed); Nones without a peak."""
    if not hardware.peak_flops:
        return None, None, None
    counts = parameter_count(config)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    head_dim = family_head_dim(config)
    tokens = cfg.micro_batch * cfg.seq_len / cfg.tp_degree
    # Matmul FLOPs: 6 per parameter (forward, input and weight gradients), 4 when frozen (LoRA).
    per_param = 4 if lora else 6
    block_flops = per_param * counts["blocks"] * tokens
    head_flops = per_param * config.vocab_size * hidden * tokens
    # the kernels' work: a sliding window is a mask to sdpa, not fewer keys computed, and a
    # slower kernel where it is shorter than the sequence
    windows = attention_windows(config)
    masked = sum(1 for w in windows if w is not None and w < cfg.seq_len) / len(windows)
    rate = MASKED_ATTENTION_RATE
    if packed_under_mask(cfg):  # every layer's attention takes the documents' mask
        masked, rate = 1.0, PACKED_MASK_ATTENTION_RATE
    # fa4's kernels run the causal layers faster; a layer with a window shorter than the
    # sequence goes to sdpa's masked kernel as before (trainer/attention.py)
    causal = FA4_ATTENTION_RATE if cfg.attention == "fa4" else 1.0
    attention_flops = (attention_work(config, cfg.seq_len, windows=False) * tokens
                       * ((1 - masked) / causal + masked / rate))
    recomputed = {"full": 1.0, "none": 0.0}.get(cfg.activation_checkpointing)
    if recomputed is None:  # selective: per op recomputes only elementwise work; every k-th
        every = selective_every(cfg.selective_ac)
        recomputed = 0.0 if every is None else (layers // every) / layers
    # A recomputed forward is a third of the block's training FLOPs.
    block_flops *= 1 + recomputed * 2 / per_param
    attention_flops *= 1 + recomputed / 3
    gemm = block_flops * (FLOAT8_GEMM_TIME[cfg.float8_recipe] if cfg.float8 else 1) + head_flops
    # the elementwise work goes with the bf16 matmuls' (float8 makes the GEMMs faster, not it);
    # float8's casts and scales are memory bound as it is
    memory = hardware.memory_time_factor
    elementwise = (block_flops + head_flops) / GEMM_EFFICIENCY * ELEMENTWISE_PER_GEMM
    if cfg.float8:
        widths = sum(fan_in + fan_out for fan_in, fan_out, _ in linear_shapes(config).values())
        elementwise += (FLOAT8_CAST_S_PER_ELEMENT[cfg.float8_recipe] * tokens * widths * layers
                        * (1 + recomputed / 3) * hardware.peak_flops)
        elementwise += (FLOAT8_S_PER_WEIGHT[cfg.float8_recipe] * counts["blocks"]
                        * hardware.peak_flops)
    attention = ATTENTION_EFFICIENCY.get(head_dim, ATTENTION_EFFICIENCY[128]) * min(
        ATTENTION_SEQ_CAP, (cfg.seq_len / 4096) ** ATTENTION_SEQ_EXPONENT)
    capped_from = 4096 * ATTENTION_SEQ_CAP ** (1 / ATTENTION_SEQ_EXPONENT)
    attention /= max(1.0, cfg.seq_len / capped_from) ** ATTENTION_LONG_EXPONENT
    compute = (gemm / GEMM_EFFICIENCY + elementwise * memory
               + attention_flops / attention) / hardware.peak_flops + LAUNCH_S_PER_LAYER * layers
    if cfg.activation_checkpointing == "selective" and selective_every(cfg.selective_ac) is None:
        # per op: the elementwise work of forward runs again (a third of it)
        compute += elementwise * memory / 3 / hardware.peak_flops
    if not no_fsdp:
        compute += FSDP_S_PER_LAYER * layers
    if cfg.activation_offload:  # saved activations out in forward and back in backward
        saved, _ = activation_bytes_per_token(dataclasses.replace(cfg, activation_offload=False),
                                              config)
        exposed = OFFLOAD_EXPOSED if offloads_blocks(cfg) else COMM_EXPOSED
        compute += 2 * saved * tokens / PCIE_BYTES_PER_S * exposed
    if lora:  # the adapters' own passes, memory bound: per token, each adapted Linear's widths
        compute += (LORA_S_PER_ELEMENT * tokens * lora / cfg.lora_rank * (1 + recomputed / 3)
                    * memory)
    if quantized:  # dequantized for forward, backward and any recompute
        compute += NF4_DEQUANT_S_PER_PARAM * quantized * (2 + recomputed) * memory
    shard = layout.param_shards
    optimizer = OPTIMIZER_S_PER_PARAM * trained / max(1, shard) * memory
    if cfg.cpu_offload:  # the step on the CPU; parameters in, gradients out every micro-batch
        optimizer = CPU_OPTIMIZER_S_PER_PARAM * trained / max(1, shard)
        compute += (2 * params + 4 * trained) / max(1, shard) / PCIE_BYTES_PER_S
    # the NF4 base is whole on every GPU: FSDP gathers only the rest
    comm = communication(cfg, config, hardware, layout, int(params - quantized), trained)
    # Gathers and reductions overlap the blocks' compute but slow it (COMM_EXPOSED); whatever
    # exceeds the compute waits in full.
    exposed_per_micro = max(comm - compute, COMM_EXPOSED * comm)
    step = cfg.grad_accum * (compute + exposed_per_micro) + optimizer
    if cfg.float8:  # its fixed cost a step (above)
        step += FLOAT8_S_PER_STEP[cfg.float8_recipe]
    return step, comm * cfg.grad_accum, exposed_per_micro * cfg.grad_accum


def communication(cfg: TrainConfig, config: Any, hardware: Hardware, layout: ParallelDims,
                  params: int, trained: int) -> float:
    """Seconds of collectives per micro-batch before overlap: FSDP's all-gathers (bf16, twice with
    FULL_SHARD and HYBRID_SHARD: forward and backward) and reduce-scatters (fp32) over the shard
    group, the gradients' all-reduce across replicas (HYBRID_SHARD, NO_SHARD), and tensor
    parallelism's gathers and reductions of the hidden states within a node."""
    tp, layers = cfg.tp_degree, config.num_hidden_layers
    dp_shard, replicas, shard = layout.shard_degree, layout.replicate_degree, layout.param_shards
    intra = (hardware.busbw_intra_gbps or 0) * 1e9
    inter = (hardware.busbw_inter_gbps or 0) * 1e9

    def crosses(group: int) -> bool:
        return group * tp > layout.procs_per_node

    def ring(nbytes: float, group: int, collectives: int) -> float:
        """A ring collective's bandwidth term and its per-hop latency, once per collective."""
        bw = inter if crosses(group) and inter else intra
        hop = HOP_LATENCY_S["inter" if crosses(group) else "intra"]
        return (nbytes / bw if bw else 0.0) + collectives * (group - 1) * hop

    seconds = 0.0
    if dp_shard > 1 and cfg.strategy != "NO_SHARD":
        gathers = 2 if layout.reshard_after_forward else 1
        fraction = (dp_shard - 1) / dp_shard
        nbytes = (2 * gathers * params + 4 * trained) / tp * fraction
        seconds += ring(nbytes, dp_shard, (gathers + 1) * layers)
    if replicas > 1:  # an all-reduce moves 2 (n-1)/n of the buffer: the bus bandwidth's basis
        nbytes = 4 * trained / shard * 2 * (replicas - 1) / replicas
        seconds += ring(nbytes, replicas * dp_shard, 2 * layers)
    if tp > 1:  # sequence parallel: 2 gathers + 2 reductions of the hidden states per block,
        # forward and backward (bf16)
        hidden_bytes = 2 * cfg.micro_batch * cfg.seq_len * config.hidden_size * (tp - 1) / tp
        seconds += 8 * layers * hidden_bytes / intra if intra else 0.0
    return seconds


def _with(cfg: TrainConfig, changes: dict[str, Any]) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)


def resolve_checkpointing(cfg: TrainConfig, *, world_size: int, local_world_size: int,
                          hardware: Hardware, config: Any = None) -> tuple[TrainConfig, str]:
    """`activation_checkpointing: auto` made concrete: of AUTO_CANDIDATES, the fastest whose
    estimated peak fits the GPU; the one line saying why. Validate (the instance type's GPU)
    and the trainer at start (the real GPU) both call this. Other values come back unchanged."""
    if cfg.activation_checkpointing != AUTO:
        return cfg, ""
    if hardware.gpu_memory_gib is None or model_config(cfg.model, config) is None:
        why = ("no GPU memory known here" if hardware.gpu_memory_gib is None
               else f"model {cfg.model!r}'s shape is not known here")
        chosen = _with(cfg, AUTO_CANDIDATES[0])
        return chosen, f"activation_checkpointing auto -> none ({why}: nothing to fit)"
    options = [(changes, estimate(_with(cfg, changes), world_size=world_size,
                                  local_world_size=local_world_size, hardware=hardware,
                                  config=config)) for changes in AUTO_CANDIDATES]
    fitting = [(c, e) for c, e in options if e.fits]
    if not fitting:  # the most frugal; the memory rule then names what else to change
        changes, est = options[-1]
        return _with(cfg, changes), (f"activation_checkpointing auto -> {_describe(changes)}: "
                                     f"nothing fits {hardware.gpu_memory_gib:g} GiB "
                                     f"(estimated {est.peak_gib:g} GiB)")
    changes, est = min(fitting, key=lambda ce: ce[1].step_time_s or 0.0)
    return _with(cfg, changes), (f"activation_checkpointing auto -> {_describe(changes)} "
                                 f"(estimated {est.peak_gib:g} of {hardware.gpu_memory_gib:g} "
                                 "GiB, the fastest that fits)")


def _describe(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items() if v is not False)


def search(cfg: TrainConfig, *, world_size: int, local_world_size: int, hardware: Hardware,
           config: Any = None) -> list[tuple[dict[str, Any], Estimate]]:
    """Settings that fit, fastest first: micro_batch (with grad_accum keeping the tokens per
    optimizer step where it divides), checkpointing and offload, the strategy, cpu_offload.
    Numerics (precision, float8, LoRA) and the world are the user's and stay."""
    per_step = cfg.micro_batch * cfg.grad_accum
    batches = sorted({mb for mb in (1, 2, 4, 8, 16, 32, cfg.micro_batch) if mb <= per_step})
    strategies = [cfg.strategy] + [s for s in ("FULL_SHARD",) if s != cfg.strategy
                                   and world_size > 1]
    found: list[tuple[dict[str, Any], Estimate]] = []
    for micro in batches:
        accum = per_step // micro if per_step % micro == 0 else cfg.grad_accum
        for strategy in strategies:
            for checkpointing in AUTO_CANDIDATES:
                for cpu_offload in (False, True):
                    changes = {"micro_batch": micro, "grad_accum": accum, "strategy": strategy,
                               **checkpointing, "cpu_offload": cpu_offload}
                    est = estimate(_with(cfg, changes), world_size=world_size,
                                   local_world_size=local_world_size, hardware=hardware,
                                   config=config)
                    if est.fits:
                        found.append((changes, est))
                        break  # offloading what already fits is only slower
    found.sort(key=lambda ce: (-(ce[1].tokens_per_s_per_gpu or 0), ce[1].peak_gib or 0))
    return found


def memory_problems(cfg: TrainConfig, *, world_size: int, local_world_size: int,
                    hardware: Hardware, config: Any = None) -> list[tuple[str, str]]:
    """A run whose estimated peak exceeds the GPU's memory: the fields to change, and the
    fastest setting found that fits. Nothing when the GPU or the model is not known here."""
    cfg, _ = resolve_checkpointing(cfg, world_size=world_size, local_world_size=local_world_size,
                                   hardware=hardware, config=config)
    est = estimate(cfg, world_size=world_size, local_world_size=local_world_size,
                   hardware=hardware, config=config)
    host = est.parts_gib.get("host_offload", 0.0) * local_world_size
    if host and hardware.node_memory_gib and host > hardware.node_memory_gib:
        return [("activation_offload",
                 f"the offloaded block inputs take {host:g} GiB of CPU memory per node "
                 f"({local_world_size} x {host / local_world_size:g}: layers x hidden x "
                 f"seq_len x micro_batch, bf16), more than the {hardware.node_memory_gib:g} GiB "
                 "a node's pod may use: lower seq_len or micro_batch, or use more nodes")]
    if est.fits is not False:
        return []
    found = search(cfg, world_size=world_size, local_world_size=local_world_size,
                   hardware=hardware, config=config)
    largest = max(est.parts_gib, key=lambda k: 0 if k in ("overhead", "host_offload")
                  else est.parts_gib[k])
    message = (f"estimated peak {est.peak_gib:g} GiB per GPU, with its stated error "
               f"({est.memory_error:.1%}) and {RESERVED_GIB:g} GiB reserved, exceeds the "
               f"{hardware.name}'s {hardware.gpu_memory_gib:g} GiB (largest part: {largest} "
               f"{est.parts_gib[largest]:g} GiB); change micro_batch, grad_accum, "
               "activation_checkpointing, activation_offload, strategy, cpu_offload or nodes")
    if found:
        changes, fit = found[0]
        differ = {k: v for k, v in changes.items() if getattr(cfg, k) != v}
        shown = ", ".join(f"{k}={v}" for k, v in differ.items()) or "the same"
        message += (f"; fits: {shown} (estimated {fit.peak_gib:g} "
                    f"GiB, {fit.tokens_per_s_per_gpu or 0:,.0f} tokens/s per GPU)")
    else:
        message += "; no setting of those fits this world: add nodes or use LoRA"
    return [("micro_batch", message)]
