"""Measured runs the planner (finetune_contract.planner) is calibrated and checked against.

One row a measurement: the settings that differ from `BASE` (the benchmark's: seq 4096, bf16,
compile, one H200), what was measured (tokens/s per GPU, MFU, peak GiB from
torch.cuda.max_memory_allocated), the command and the date. To add a row: run the command on the
GPU, append a `Row`; `tests/bench/test_plan_calibration.py` recomputes the planner's error over
every row. All rows so far are from docs/trainer.md's tables ("Benchmark: one H200", "Where the
time goes", "Scaling: one host, several H200s").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The benchmark's TrainConfig fields (bench/train.py with --compile).
BASE: dict[str, Any] = {"seq_len": 4096, "mixed_precision": "bf16", "compile": True,
                        "strategy": "SHARD_GRAD_OP", "activation_checkpointing": "none"}
# Every row was measured as `trainer.bench`, bench.train's name before it moved (2026-12-05).
BENCH = "python -m bench.train --no-hf --compile"
TORCHRUN = "torchrun --nproc-per-node {gpus} -m bench.train --no-hf --compile"
# The machines the rows were measured on: the H200 (finetune_contract.instance_types: its H200
# types have its GPU; the 2- and 4-GPU hosts joined their GPUs by NVLink, NCCL_NVLS_ENABLE=0),
# and for the offloaded rows of 2026-12-06 an H100 (the planner's peak FLOPs are the same).
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
LONG = ("python -m bench.train --models 8b --micro-batch 1 --lora-rank 16 --quantize-base nf4 "
        "--ac full --activation-offload --compile --peers unsloth")


@dataclass(frozen=True)
class Row:
    model: str
    settings: dict[str, Any]  # TrainConfig fields beyond BASE
    tokens_per_s: float  # per GPU (a tensor-parallel pair's tokens split between its GPUs)
    mfu: float | None
    peak_gib: float
    command: str
    date: str
    gpus: int = 1
    gpu: str = H200
    note: str = ""
    # what the trainer changed since, which the planner now plans and this row did not run: kept
    # as measured, left out of the planner's errors
    superseded: str = ""
    config: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", {**BASE, "model": self.model, **self.settings})


def _mb(n: int, **more: Any) -> dict[str, Any]:
    return {"micro_batch": n, **more}


_FS = "FULL_SHARD"
# FULL_SHARD on one GPU ran FSDP at one rank until 2026-12-06; it now runs without FSDP (its
# blocks' compute copies made and freed per block, trainer/master_weights.py): the same memory
# by the planner's parts, its time without FSDP's per-layer cost. Not re-measured yet.
FSDP_ONE = "FSDP at one rank, as FULL_SHARD ran on one GPU then"
_AC = "full"
OLD = "older version, about 2% slower"
# Before 2026-12-07, float8 Linears cast bf16 copies of their masters at one process; without
# accumulated micro-batches (and rowwise with them, since 11:05 UTC that day) they now cast the
# fp32 masters (finetune_contract.rules.float8_reads_masters): 1.81 GiB less at 1B and 5.25 at
# 3B, measured (docs/trainer.md).
F8_COPIES = "float8 from bf16 copies, where float8_reads_masters now reads the masters"
# docs/trainer.md's scaling and long-sequence tables give no date (measured before
# 2026-12-01's profile).
UNDATED = "undated"
ROWS: tuple[Row, ...] = (
    Row("llama-1b", _mb(2), 53_870, 0.492, 29.0, f"{BENCH} --models 1b --micro-batch 2",
        "2026-11-29", note=OLD),
    Row("llama-1b", _mb(4), 60_720, 0.554, 38.5, f"{BENCH} --models 1b --micro-batch 4",
        "2026-11-29"),
    Row("llama-1b", _mb(8), 63_140, 0.576, 57.4, f"{BENCH} --models 1b --micro-batch 8",
        "2026-11-29"),
    Row("llama-3b", _mb(2), 22_100, 0.525, 65.1, f"{BENCH} --models 3b --micro-batch 2",
        "2026-11-29", note=OLD),
    Row("llama-3b", _mb(4), 24_790, 0.589, 84.7, f"{BENCH} --models 3b --micro-batch 4",
        "2026-11-29"),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing=_AC), 8_461, 0.440, 123.6,
        f"{BENCH} --models 8b --micro-batch 2 --ac full --strategy FULL_SHARD", "2026-11-29",
        note=FSDP_ONE),
    Row("llama-3b", _mb(4, grad_accum=4), 25_990, 0.618, 96.7,
        f"{BENCH} --steps 6 --warmup 3 --models 3b --micro-batch 4 --grad-accum 4", "2026-12-01"),
    Row("llama-3b", _mb(8), 26_050, 0.619, 123.7,
        f"{BENCH} --steps 6 --warmup 3 --models 3b --micro-batch 8", "2026-12-01"),
    Row("llama-1b", _mb(4, grad_accum=4), 63_600, 0.580, 43.1,
        f"{BENCH} --steps 6 --warmup 3 --models 1b --micro-batch 4 --grad-accum 4", "2026-12-01"),
    Row("llama-1b", _mb(8, grad_accum=2), 64_830, 0.592, 62.0,
        f"{BENCH} --steps 6 --warmup 3 --models 1b --micro-batch 8 --grad-accum 2", "2026-12-01"),
    Row("llama-3b", _mb(4, float8=True), 29_700, None, 72.5,
        f"{BENCH} --models 3b --micro-batch 4 --float8", "2026-12-01", superseded=F8_COPIES),
    Row("llama-3b", _mb(4, float8=True, float8_recipe="rowwise"), 25_890, None, 72.5,
        f"{BENCH} --models 3b --micro-batch 4 --float8 --float8-recipe rowwise", "2026-12-01",
        superseded=F8_COPIES),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing=_AC, float8=True), 10_820,
        None, 123.6, f"{BENCH} --models 8b --micro-batch 2 --ac full --strategy FULL_SHARD "
        "--float8", "2026-12-01", note=FSDP_ONE, superseded=F8_COPIES),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing=_AC, float8=True,
                        float8_recipe="rowwise"), 9_586, None, 123.6,
        f"{BENCH} --models 8b --micro-batch 2 --ac full --strategy FULL_SHARD --float8 "
        "--float8-recipe rowwise", "2026-12-01", note=FSDP_ONE, superseded=F8_COPIES),
    Row("llama-3b", _mb(1, seq_len=32768, strategy=_FS, activation_checkpointing=_AC,
                        tp_degree=2), 10_010, 0.537, 26.6,
        TORCHRUN.format(gpus=2) + " --models 3b --seq-len 32768 --micro-batch 1 --ac full "
        "--strategy FULL_SHARD --tp-degree 2", UNDATED, gpus=2),
    Row("llama-3b", _mb(1, seq_len=32768, strategy=_FS, activation_checkpointing=_AC), 11_200,
        0.601, 29.8, TORCHRUN.format(gpus=2) + " --models 3b --seq-len 32768 --micro-batch 1 "
        "--ac full --strategy FULL_SHARD --tp-degree 1", UNDATED, gpus=2),
    Row("llama-3b", _mb(4, strategy=_FS), 24_160, 0.574, 79.5,
        f"{BENCH} --models 3b --micro-batch 4 --strategy FULL_SHARD", UNDATED, note=FSDP_ONE),
    Row("llama-3b", _mb(4, strategy=_FS), 23_750, 0.565, 61.7,
        TORCHRUN.format(gpus=2) + " --models 3b --micro-batch 4 --strategy FULL_SHARD",
        UNDATED, gpus=2),
    Row("llama-3b", _mb(4, strategy="HYBRID_SHARD", shard_group_size=1), 22_990, 0.546, 79.5,
        TORCHRUN.format(gpus=2) + " --models 3b --micro-batch 4 --strategy HYBRID_SHARD "
        "--shard-group-size 1", UNDATED, gpus=2),
    Row("llama-3b", _mb(4, strategy=_FS), 23_820, 0.566, 52.7,
        TORCHRUN.format(gpus=4) + " --models 3b --micro-batch 4 --strategy FULL_SHARD",
        UNDATED, gpus=4, note="the version before the 1- and 2-GPU rows"),
    Row("llama-3b", _mb(4, strategy="HYBRID_SHARD", shard_group_size=2), 23_330, 0.555, 61.7,
        TORCHRUN.format(gpus=4) + " --models 3b --micro-batch 4 --strategy HYBRID_SHARD "
        "--shard-group-size 2", UNDATED, gpus=4, note="the version before"),
    # One device call, 2026-12-03 (`--steps 5 --warmup 2`; 70B `--steps 3`): LoRA's frozen
    # base keeps its bf16 copy alone at one GPU (trainer/master_weights.py);
    # docs/notes/2026-12-03-h200-{lora-8b,qlora-8b,qlora-70b}.log.
    Row("llama-8b", _mb(2, lora_rank=16), 14_700, 0.5457, 53.74,
        f"{BENCH} --steps 5 --warmup 2 --models 8b --micro-batch 2 --lora-rank 16", "2026-12-03"),
    # QLoRA since its 4-bit weights are dequantized again in backward (trainer/lora.py keeps no
    # bf16 copy from forward to backward), one H100, 2026-12-07: 43.11 GiB; it was 14,360
    # tokens/s in 57.04 GiB on the H200 of 2026-12-03 (docs/notes/2026-12-03-h200-qlora-8b.log)
    # and 14,480 in 56.06 on the same H100 in the same call
    # (docs/notes/2026-12-07-h100-dequant-again.log).
    Row("llama-8b", _mb(2, lora_rank=16, quantize_base="nf4"), 14_210, 0.5274, 43.11,
        f"{BENCH} --steps 5 --warmup 2 --models 8b --micro-batch 2 --lora-rank 16 "
        "--quantize-base nf4 --peers=", "2026-12-07", gpu=H100),
    Row("llama-70b", _mb(1, lora_rank=16, quantize_base="nf4", activation_checkpointing=_AC),
        1_330, 0.4189, 48.78, f"{BENCH} --steps 3 --warmup 2 --models 70b --micro-batch 1 "
        "--ac full --lora-rank 16 --quantize-base nf4", "2026-12-03"),
    # One device call, 2026-12-01 (`--steps 5 --warmup 2`): the 8B settings auto chooses
    # between, and the accumulation rows of issue 21's targets.
    Row("llama-8b", _mb(2, strategy=_FS), 9_653, 0.502, 130.0,
        f"{BENCH} --steps 5 --warmup 2 --models 8b --micro-batch 2 --strategy FULL_SHARD "
        "--ac none", "2026-12-01", note=FSDP_ONE),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing="selective"), 9_856, 0.513,
        123.6, f"{BENCH} --steps 5 --warmup 2 --models 8b --micro-batch 2 --strategy FULL_SHARD "
        "--ac selective", "2026-12-01", note=FSDP_ONE),
    Row("llama-3b", _mb(4, grad_accum=4), 26_340, 0.626, 96.69,
        f"{BENCH} --steps 5 --warmup 2 --models 3b --micro-batch 4 --grad-accum 4", "2026-12-01"),
    Row("llama-1b", _mb(8, grad_accum=4), 66_250, 0.605, 61.97,
        f"{BENCH} --steps 5 --warmup 2 --models 1b --micro-batch 8 --grad-accum 4", "2026-12-01"),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing=_AC), 8_474, 0.441, 64.8,
        TORCHRUN.format(gpus=2) + " --models 8b --micro-batch 2 --ac full --strategy FULL_SHARD",
        UNDATED, gpus=2),
    Row("llama-8b", _mb(2, strategy=_FS, activation_checkpointing=_AC), 8_535, 0.444, 35.0,
        TORCHRUN.format(gpus=4) + " --models 8b --micro-batch 2 --ac full --strategy FULL_SHARD",
        UNDATED, gpus=4, note="the version before"),
    # float8 beside torchtitan's, one H100, 2026-12-06 (bench/float8.sh titan, ours' rows:
    # docs/notes/2026-12-06-h100-float8-titan.log), and float8's loss check at micro-batch 1
    # (bench/float8.sh loss: 202 steps of the demo tokens;
    # docs/notes/2026-12-06-h100-float8-loss.log).
    Row("llama-3b", _mb(2, grad_accum=2, float8=True), 27_690, None, 70.95,
        f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe tensorwise "
        "--peers titan --steps 8 --warmup 3", "2026-12-06", gpu=H100),
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, float8_recipe="rowwise"), 23_390, None,
        70.95, f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe "
        "rowwise --peers titan --steps 8 --warmup 3", "2026-12-06", gpu=H100,
        superseded=F8_COPIES),
    Row("llama-1b", _mb(4, float8=True), 66_190, None, 32.51,
        f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe tensorwise --peers titan "
        "--steps 10 --warmup 3", "2026-12-06", gpu=H100, superseded=F8_COPIES),
    Row("llama-1b", _mb(4, float8=True, float8_recipe="rowwise"), 57_270, None, 32.51,
        f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe rowwise --peers titan "
        "--steps 10 --warmup 3", "2026-12-06", gpu=H100, superseded=F8_COPIES),
    # One process, 3B at micro-batch 2: SHARD_GRAD_OP keeps every block's bf16 copies for the
    # step, FULL_SHARD (no FSDP since 2026-12-06) makes and frees them per block; one H100,
    # 2026-12-06 15:49 UTC (docs/notes/2026-12-06-h100-full-shard-one-process.log).
    Row("llama-3b", _mb(2), 22_100, 0.5252, 65.11,
        f"{BENCH} --models 3b --micro-batch 2 --tokens demo --peers= --steps 6 --warmup 2",
        "2026-12-06", gpu=H100),
    Row("llama-3b", _mb(2, strategy=_FS), 21_830, 0.5188, 59.86,
        f"{BENCH} --models 3b --micro-batch 2 --tokens demo --peers= --steps 6 --warmup 2 "
        "--strategy FULL_SHARD", "2026-12-06", gpu=H100),
    # Packed rows under sdpa's mask (bench.train --packing, random 128-2,048-token documents:
    # docs/notes/2026-12-06-h100-fa4-packing.log; its MFU counts attention over whole rows).
    Row("llama-1b", _mb(4, packing=True), 46_340, 0.4229, 42.02,
        f"{BENCH} --models 1b --micro-batch 4 --tokens random --packing --attention fa4,sdpa "
        "--peers= --steps 6 --warmup 2", "2026-12-06", gpu=H100),
    Row("llama-1b", _mb(1), 45_430, 0.4146, 23.34,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2",
        "2026-12-06", gpu=H100),
    Row("llama-1b", _mb(1, float8=True), 42_960, None, 21.84,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe tensorwise", "2026-12-06", gpu=H100, superseded=F8_COPIES),
    Row("llama-1b", _mb(1, float8=True, float8_recipe="rowwise"), 37_490, None, 21.84,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe rowwise", "2026-12-06", gpu=H100, superseded=F8_COPIES),
    # Offloaded blocks (trainer/offload.py), 8B r16, one H100 (the planner's peak FLOPs are the
    # H200's, the same dense bf16 figure), as the trainer runs now: each adapter added in place
    # (trainer/lora.py), a 4-bit weight dequantized again in backward. QLoRA: 2026-12-07, one
    # machine, beside Unsloth (docs/notes/2026-12-07-h100-dequant-again.log, call 1;
    # -long-context.log: bench/long_context.sh peers). LoRA: 2026-12-06 18:37-18:47 UTC, beside
    # Unsloth (docs/notes/2026-12-06-h100-lora-add-in-place.log; the dequantization does not
    # touch it).
    Row("llama-8b", _mb(2, activation_checkpointing=_AC, activation_offload=True, lora_rank=16,
                        quantize_base="nf4"), 10_010, 0.3715, 7.775,
        f"{LONG} --seq-len 4096 --micro-batch 2 --steps 5 --warmup 2 --no-hf", "2026-12-07",
        gpu=H100),
    Row("llama-8b", _mb(1, seq_len=32768, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4"), 6_324, 0.5231, 9.847,
        f"{LONG} --seq-len 32768 --steps 2 --warmup 1", "2026-12-07", gpu=H100),
    Row("llama-8b", _mb(1, seq_len=131072, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4"), 2_717, 0.6494, 21.18,
        f"{LONG} --seq-len 131072 --steps 1 --warmup 1", "2026-12-07", gpu=H100),
    Row("llama-8b", _mb(2, activation_checkpointing=_AC, activation_offload=True, lora_rank=16),
        10_190, 0.378, 17.13,
        f"{LONG.replace(' --quantize-base nf4', '')} --seq-len 4096 --micro-batch 2 --steps 5 "
        "--warmup 2", "2026-12-06", gpu=H100),
    # attention: fa4 at 4k, beside torchtitan and HF + Liger, one H200, 2026-12-04 (docs/trainer.md
    # "Every peer beside the current version": docs/notes/2026-12-04-h200-peers-fa4-fused.log).
    Row("llama-1b", _mb(4, grad_accum=4, attention="fa4"), 65_290, 0.596, 43.1,
        f"{BENCH} --models 1b --micro-batch 4 --grad-accum 4 --ac none --attention fa4 "
        "--peers titan,liger --steps 4 --warmup 2", "2026-12-04"),
    Row("llama-3b", _mb(4, grad_accum=4, attention="fa4"), 26_450, 0.629, 96.7,
        f"{BENCH} --models 3b --micro-batch 4 --grad-accum 4 --ac none --attention fa4 "
        "--peers titan,liger --steps 4 --warmup 2", "2026-12-04"),
    # attention: fa4 (planner.FA4_ATTENTION_RATE), the same trainer, and sdpa at 32k again beside
    # it: one H100, five calls on one machine, 2026-12-07 04:27-04:40 UTC
    # (docs/notes/2026-12-07-h100-fa4-long-context.log).
    Row("llama-8b", _mb(1, seq_len=32768, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4"), 6_353, 0.5255, 9.847,
        f"{LONG} --seq-len 32768 --steps 2 --warmup 1 --peers ''", "2026-12-07", gpu=H100),
    Row("llama-8b", _mb(1, seq_len=32768, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4", attention="fa4"), 6_685, 0.553, 9.831,
        f"{LONG} --seq-len 32768 --steps 2 --warmup 1 --peers '' --attention fa4", "2026-12-07",
        gpu=H100),
    Row("llama-8b", _mb(1, seq_len=131072, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4", attention="fa4"), 3_073, 0.7346, 20.78,
        f"{LONG} --seq-len 131072 --steps 1 --warmup 1 --peers '' --attention fa4",
        "2026-12-07", gpu=H100),
    Row("llama-8b", _mb(2, activation_checkpointing=_AC, activation_offload=True, lora_rank=16,
                        quantize_base="nf4", attention="fa4"), 10_030, 0.3723, 7.775,
        f"{LONG} --seq-len 4096 --micro-batch 2 --steps 5 --warmup 2 --peers '' --attention fa4",
        "2026-12-07", gpu=H100),
    Row("llama-8b", _mb(2, activation_checkpointing=_AC, activation_offload=True, lora_rank=16,
                        attention="fa4"), 10_290, 0.382, 17.13,
        f"{LONG.replace(' --quantize-base nf4', '')} --seq-len 4096 --micro-batch 2 --steps 5 "
        "--warmup 2 --peers '' --attention fa4", "2026-12-07", gpu=H100),
    # float8 with fa4 beside torchtitan's float8 (its sdpa), one H100, 2026-12-07 06:30-06:38 UTC,
    # `ATTENTION=sdpa,fa4 bench/float8.sh OUT titan RECIPE` per recipe
    # (docs/notes/2026-12-07-h100-fa4-float8-one-call.log; ours' sdpa rows there agree with the
    # 2026-12-06 rows above within 1.5%).
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, attention="fa4"), 27_930, None, 70.95,
        f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe tensorwise "
        "--attention sdpa,fa4 --peers titan --steps 8 --warmup 3", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, float8_recipe="rowwise", attention="fa4"),
        23_310, None, 70.95, f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 "
        "--float8-recipe rowwise --attention sdpa,fa4 --peers titan --steps 8 --warmup 3",
        "2026-12-07", gpu=H100, superseded=F8_COPIES),
    Row("llama-1b", _mb(4, float8=True, attention="fa4"), 67_110, None, 32.51,
        f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe tensorwise --attention "
        "sdpa,fa4 --peers titan --steps 10 --warmup 3", "2026-12-07", gpu=H100,
        superseded=F8_COPIES),
    Row("llama-1b", _mb(4, float8=True, float8_recipe="rowwise", attention="fa4"), 57_950, None,
        32.51, f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe rowwise --attention "
        "sdpa,fa4 --peers titan --steps 10 --warmup 3", "2026-12-07", gpu=H100,
        superseded=F8_COPIES),
    # float8 Linears casting their fp32 masters (finetune_contract.rules.float8_reads_masters),
    # 1B at micro-batch 4, sdpa, one H100, 2026-12-07 09:11-09:14 UTC, each beside the same run
    # with TRAINER_FLOAT8_MASTERS=0 (65,730 and 56,650 tokens/s, 32.51 GiB:
    # docs/notes/2026-12-07-h100-float8-masters.log).
    Row("llama-1b", _mb(4, float8=True), 66_360, None, 30.7,
        f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe tensorwise --peers '' "
        "--steps 10 --warmup 3 --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-1b", _mb(4, float8=True, float8_recipe="rowwise"), 56_960, None, 30.7,
        f"{BENCH} --models 1b --micro-batch 4 --float8 --float8-recipe rowwise --peers '' "
        "--steps 10 --warmup 3 --attention sdpa", "2026-12-07", gpu=H100),
    # 3B float8 casting its fp32 masters (micro-batch 2, no accumulation), then 2 x 2 rowwise with
    # its bf16 copies, each beside torchtitan's float8, sdpa, one H100, one call, 2026-12-07
    # 10:36-10:41 UTC (docs/notes/2026-12-07-h100-float8-3b-ga1.log).
    Row("llama-3b", _mb(2, float8=True, float8_recipe="rowwise"), 22_160, None, 53.74,
        f"{BENCH} --models 3b --micro-batch 2 --float8 --float8-recipe rowwise --peers titan "
        "--steps 8 --warmup 3 --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, float8=True), 25_660, None, 53.74,
        f"{BENCH} --models 3b --micro-batch 2 --float8 --float8-recipe tensorwise --peers titan "
        "--steps 8 --warmup 3 --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, float8_recipe="rowwise"), 23_090, None,
        70.95, f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe "
        "rowwise --peers titan --steps 8 --warmup 3 --attention sdpa", "2026-12-07", gpu=H100,
        superseded=F8_COPIES),
    # With fa4 (the same micro-batch 2 rows: 22,700 and 26,540 tokens/s, 53.74 GiB), and rowwise
    # at 2 x 2 casting its masters too (rules.float8_reads_masters since that call), beside
    # torchtitan: one H100, 2026-12-07 10:59-11:05 UTC
    # (docs/notes/2026-12-07-h100-float8-rowwise-masters.log, calls 3 and 4).
    Row("llama-3b", _mb(2, float8=True, float8_recipe="rowwise", attention="fa4"), 22_700, None,
        53.74, f"{BENCH} --models 3b --micro-batch 2 --float8 --float8-recipe rowwise "
        "--attention fa4,sdpa --peers titan --steps 8 --warmup 3", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, float8=True, attention="fa4"), 26_540, None, 53.74,
        f"{BENCH} --models 3b --micro-batch 2 --float8 --float8-recipe tensorwise --attention "
        "fa4,sdpa --peers titan --steps 8 --warmup 3", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, float8_recipe="rowwise", attention="fa4"),
        23_810, None, 65.7, f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 "
        "--float8-recipe rowwise --attention fa4,sdpa --peers titan --steps 8 --warmup 3",
        "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(2, grad_accum=2, float8=True, float8_recipe="rowwise"), 23_410, None,
        65.7, f"{BENCH} --models 3b --micro-batch 2 --grad-accum 2 --float8 --float8-recipe "
        "rowwise --attention fa4,sdpa --peers titan --steps 8 --warmup 3", "2026-12-07",
        gpu=H100),
    # float8's loss check at 3B, then at 1B (micro-batch 1, 202 steps of the demo tokens; float8
    # Linears casting their fp32 masters), one H100, one machine, 2026-12-07 14:19-14:30 UTC,
    # `bench/float8.sh OUT loss 3b`, then `loss` (docs/notes/2026-12-07-h100-float8-loss.log).
    Row("llama-3b", _mb(1), 18_350, 0.436, 54.66,
        f"{BENCH} --models 3b --micro-batch 1 --tokens demo --steps 200 --warmup 2 "
        "--attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(1, float8=True), 19_230, None, 49.41,
        f"{BENCH} --models 3b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe tensorwise --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-3b", _mb(1, float8=True, float8_recipe="rowwise"), 16_700, None, 49.41,
        f"{BENCH} --models 3b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe rowwise --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-1b", _mb(1), 43_950, 0.4011, 23.34,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2 "
        "--attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-1b", _mb(1, float8=True), 37_250, None, 20.03,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe tensorwise --attention sdpa", "2026-12-07", gpu=H100),
    Row("llama-1b", _mb(1, float8=True, float8_recipe="rowwise"), 34_860, None, 20.03,
        f"{BENCH} --models 1b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe rowwise --attention sdpa", "2026-12-07", gpu=H100),
    # LoRA (bf16 base) at 400k, the trainer as it runs now, one step, one H100, 2026-12-07
    # 08:42-08:49 UTC, `bench/long_context.sh OUT longest-lora`
    # (docs/notes/2026-12-07-h100-lora-400k.log): the longest row (planner.OFFLOAD_MEASURED_TOKENS).
    Row("llama-8b", _mb(1, seq_len=400_000, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16), 987.8, 0.6586, 61.51,
        f"{LONG.replace(' --quantize-base nf4', '').replace(' --peers unsloth', '')} --seq-len "
        "400000 --steps 1 --warmup 0 --peers ''", "2026-12-07", gpu=H100),
    # QLoRA at 400k: an older version (peft's add, which keeps more than the add in place: 24.47
    # GiB at 128k, against 21.18 now), one step, 2026-12-06 05:53-06:00 UTC,
    # bench/long_context.sh longest (docs/notes/2026-12-06-h100-400k.log). Not re-run.
    Row("llama-8b", _mb(1, seq_len=400_000, activation_checkpointing=_AC, activation_offload=True,
                        lora_rank=16, quantize_base="nf4"), 969.2, 0.646, 51.92,
        f"{LONG.replace(' --peers unsloth', '')} --seq-len 400000 --steps 1 --warmup 0 --peers ''",
        "2026-12-06", gpu=H100, note="peft's add, an older version"),
    # The 8B full fine-tune on one H200 beside torchtitan, bf16 then float8 (FULL_SHARD on one
    # GPU: no FSDP, per-block compute copies), 2026-12-07 20:00-20:07 UTC, one machine,
    # `bench/full_8b.sh OUT pick`, then `float8 tensorwise` and `float8 rowwise`
    # (docs/notes/2026-12-07-h200-full-8b-float8.log); then float8's loss check at 8B
    # (`bench/float8.sh OUT loss 8b`, 20:07-20:15 UTC, the same machine;
    # docs/notes/2026-12-07-h200-float8-loss-8b.log).
    Row("llama-8b", _mb(2, strategy=_FS), 10_440, 0.5436, 130.0,
        f"{BENCH} --models 8b --micro-batch 2 --strategy FULL_SHARD --attention sdpa --ac none "
        "--steps 5 --warmup 2", "2026-12-07"),
    Row("llama-8b", _mb(2, strategy=_FS, float8=True), 13_660, None, 122.7,
        f"{BENCH} --models 8b --micro-batch 2 --strategy FULL_SHARD --attention sdpa --ac none "
        "--float8 --float8-recipe tensorwise --steps 5 --warmup 2", "2026-12-07"),
    Row("llama-8b", _mb(2, strategy=_FS, float8=True, float8_recipe="rowwise"), 11_970, None,
        122.7, f"{BENCH} --models 8b --micro-batch 2 --strategy FULL_SHARD --attention sdpa "
        "--ac none --float8 --float8-recipe rowwise --steps 5 --warmup 2", "2026-12-07"),
    Row("llama-8b", _mb(1), 9_066, 0.4719, 135.7,
        f"{BENCH} --models 8b --micro-batch 1 --tokens demo --steps 200 --warmup 2 "
        "--attention sdpa", "2026-12-07"),
    Row("llama-8b", _mb(1, float8=True), 11_070, None, 122.7,
        f"{BENCH} --models 8b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe tensorwise --attention sdpa", "2026-12-07"),
    Row("llama-8b", _mb(1, float8=True, float8_recipe="rowwise"), 9_132, None, 122.7,
        f"{BENCH} --models 8b --micro-batch 1 --tokens demo --steps 200 --warmup 2 --float8 "
        "--float8-recipe rowwise --attention sdpa", "2026-12-07"),
)

# Each family's saved activations (families.Family.activation_extra), one device call on one
# H200, 2026-12-03: 8-layer models at the family's published widths (random weights, seq 4096,
# compile, no checkpointing, one GPU without FSDP), peak GiB at micro-batch 2 and 4
# (`python -m bench.train --no-hf --compile --steps 2 --warmup 1 --micro-batch 2` (and 4)
# `--models` the eight config directories; docs/notes/2026-12-03-h200-family-activations-mb*.log).
# The slope over micro-batch is what the activations cost; a family in the table without a row
# here fails tests/bench/test_plan_calibration.py. Gemma 2's row is of 2026-12-04, run as the
# trainer runs it (eager attention for its soft cap; that day's benchmark builds it so, where the
# first run had sdpa and no cap: 26.12 / 32.25 GiB, 53,410 / 59,130 tokens/s):
# docs/notes/2026-12-04-h200-gemma2-eager.log.


def _family(model_type: str, hidden: int, heads: int, kv_heads: int, mlp: int, vocab: int,
            tied: bool, **more: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": 8,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": mlp, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": 8192, **more}


# (config, peak GiB at micro-batch 2, at micro-batch 4)
FAMILY_ROWS: dict[str, tuple[dict[str, Any], float, float]] = {
    "llama": (_family("llama", 3072, 24, 8, 8192, 128256, True), 25.09, 30.93),
    "qwen2": (_family("qwen2", 3584, 28, 4, 18944, 152064, False), 52.66, 62.61),
    "qwen3": (_family("qwen3", 4096, 32, 8, 12288, 151936, False, head_dim=128), 49.29, 57.99),
    "mistral": (_family("mistral", 4096, 32, 8, 14336, 32768, False, sliding_window=None),
                36.39, 46.21),
    "gemma2": (_family("gemma2", 2304, 8, 4, 9216, 256000, True, head_dim=256,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0), 34.13, 48.25),
    "gemma3_text": (_family("gemma3_text", 1152, 4, 1, 6912, 262144, True, head_dim=256,
                            sliding_window=512), 14.65, 18.88),
    "phi3": (_family("phi3", 3072, 32, 32, 8192, 32064, False), 22.6, 30.57),
    "olmo2": (_family("olmo2", 4096, 32, 32, 11008, 100352, False), 44.14, 54.49),
}
# The same call's tokens/s per GPU (micro-batch 2, 4), the planner's time per family at 8 layers,
# where the head and embedding weigh about three times their share at released depths.
FAMILY_TOKENS_PER_S: dict[str, tuple[float, float]] = {
    "llama": (63_350, 68_900), "qwen2": (32_390, 35_310), "qwen3": (35_270, 38_340),
    "mistral": (42_060, 44_510), "gemma2": (53_860, 58_420), "gemma3_text": (103_800, 113_000),
    "phi3": (71_050, 77_650), "olmo2": (38_080, 40_410),
}


@dataclass(frozen=True)
class ReleasedRow:
    """A family shape at its released depth (bench.family_shapes.FAMILY_SHAPES)."""

    shape: str
    micro_batch: int
    tokens_per_s: float
    peak_gib: float
    attention: str  # the attention the run had


# One device call on one H200, 2026-12-03 (`python -m bench.train --no-hf --compile --steps 5
# --warmup 2 --micro-batch 2 --models gemma2-2b,gemma3-1b,gemma3-4b`;
# docs/notes/2026-12-03-h200-gemma-released-depths.log); the first two's profiles of that day
# (`--profile`, docs/notes/2026-12-03-h200-profile-gemma*.log) fit ATTENTION_EFFICIENCY[256] and
# MASKED_ATTENTION_RATE. Gemma 2 2B's row is of 2026-12-04 (the same command, `--models
# gemma2-2b --profile`; docs/notes/2026-12-04-h200-gemma2-eager.log): eager attention, as the
# trainer runs it (the sdpa run of 2026-12-03 had 23,600 tokens/s in 57.84 GiB).
RELEASED_ROWS: tuple[ReleasedRow, ...] = (
    ReleasedRow("gemma2-2b", 2, 23_410, 83.47, "eager"),
    ReleasedRow("gemma3-1b", 2, 46_170, 30.33, "sdpa"),
    ReleasedRow("gemma3-4b", 2, 15_790, 85.25, "sdpa"),
)
