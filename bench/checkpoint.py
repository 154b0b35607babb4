"""Checkpoint save and load times against the planner's (finetune_contract.checkpoint_time).

python -m bench.checkpoint --models 1b,3b,8b:lora16 --dir /tmp/ckpt

Each model is built as the trainer builds it (bf16 compute on fp32 masters, FULL_SHARD on the
ranks there are, LoRA where asked: the frozen base is left out of the checkpoint), one
optimizer step on random tokens makes AdamW's state, then the trainer's Checkpointer saves it
(sync, then async: the copy to CPU memory, then the whole save) and loads it back, each timed.
One JSON line per model and mode, with the checkpoint's bytes and the planner's estimate for
the same world and storage; first, one line of the machine's own rates (a pinned and a pageable
copy of 4 GB each way, a 4 GB file written and read back with fsync), which the planner's
storage rates are set from. Imports neither trainer.data nor `datasets`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.train import build_bench_model, materialize_bench_model
from finetune_contract.checkpoint_time import checkpoint_time
from trainer.checkpoint import Checkpointer
from trainer.config import TrainConfig
from trainer.lora import apply_lora
from trainer.loss import LOSS_METHOD, add_loss_method
from trainer.master_weights import compute_weights
from trainer.optim import build_optimizer, optimizer_step
from trainer.parallel import apply_parallelism, init_distributed

SHORT_NAMES = {"1b": "llama-1b", "3b": "llama-3b", "8b": "llama-8b", "70b": "llama-70b",
               "tiny": "tiny-llama"}
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1b,3b,8b:lora16",
                        help="comma-separated: 1b, 3b, 8b, tiny, each with :loraR for LoRA")
    parser.add_argument("--dir", default="/tmp/bench-checkpoint",
                        help="where the checkpoints are written (emptied first and after)")
    parser.add_argument("--no-async", action="store_true", help="sync saves only")
    parser.add_argument("--rates-gb", type=float, default=4.0,
                        help="GB copied and written for the machine's rates; 0: none")
    return parser.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_rates(device: torch.device, directory: Path, gigabytes: float) -> dict[str, Any]:
    """GB/s of host-device copies (pinned and pageable) and of this directory's disk."""
    n = int(gigabytes * GB)
    rates: dict[str, Any] = {"run": "rates", "gigabytes": gigabytes}
    if device.type == "cuda":
        on_device = torch.empty(n, dtype=torch.uint8, device=device)
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            for direction, copy in (("d2h", lambda h=host: h.copy_(on_device)),
                                    ("h2d", lambda h=host: on_device.copy_(h))):
                copy()
                synchronize(device)
                start = time.perf_counter()
                copy()
                synchronize(device)
                kind = "pinned" if pinned else "pageable"
                rates[f"{direction}_{kind}_gb_s"] = round(n / GB / (time.perf_counter() - start), 2)
            del host
        del on_device
    path = directory / "rates.bin"
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, n // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rates["disk_write_gb_s"] = round(n / GB / (time.perf_counter() - start), 2)
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    rates["disk_read_gb_s"] = round(n / GB / (time.perf_counter() - start), 2)
    path.unlink()
    return rates


def build(spec: str, env: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, int, TrainConfig]:
    """(model, optimizer with AdamW's state made by one step, trained parameters, config)."""
    name, _, lora = spec.partition(":lora")
    name = SHORT_NAMES.get(name, name)
    config = TrainConfig(model=name, seq_len=256, micro_batch=1, lr=1e-5,
                         strategy="FULL_SHARD", mixed_precision="bf16",
                         lora_rank=int(lora or 0))
    model = build_bench_model(name, "sdpa")
    if config.lora_rank:
        apply_lora(model, config)
    apply_parallelism(model, config, env)
    materialize_bench_model(model, name, config, env.device)
    add_loss_method(model)
    optimizer = build_optimizer(model, config, env.device)
    tokens = torch.randint(0, model.config.vocab_size, (1, config.seq_len), device=env.device)
    with compute_weights(model):
        getattr(model, LOSS_METHOD)(tokens, input_ids=tokens).backward()
    optimizer_step(model, optimizer, config.max_grad_norm)
    optimizer.zero_grad(set_to_none=True)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, optimizer, trained, config


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(spec: str, env: Any, root: Path, use_async: bool) -> list[dict[str, Any]]:
    model, optimizer, trained, config = build(spec, env)
    planned = checkpoint_time(trained, world_size=env.world_size,
                              local_world_size=env.local_world_size, storage="local")
    rows = []
    for mode in ("sync", "async") if use_async else ("sync",):
        shutil.rmtree(root / "run", ignore_errors=True)
        checkpointer = Checkpointer(str(root / "run"), keep=1, rank=env.rank,
                                    local_rank=env.local_rank, async_save=mode == "async")
        synchronize(env.device)
        start = time.perf_counter()
        path = checkpointer.save(1, model, optimizer, {"bench": True})
        staged = time.perf_counter() - start
        checkpointer.wait()
        saved = time.perf_counter() - start
        os.sync()
        start = time.perf_counter()
        checkpointer.load(Path(path), model, optimizer)
        synchronize(env.device)
        loaded = time.perf_counter() - start
        checkpointer.close()
        rows.append({
            "run": "checkpoint", "model": spec, "mode": mode, "gpus": env.world_size,
            "trained_params": trained, "bytes": size_of(Path(path)),
            "planned_bytes": planned.bytes_total, "save_s": round(saved, 2),
            "blocking_s": round(staged, 2), "load_s": round(loaded, 2),
            "planned_save_s": round(planned.save_s, 2), "planned_load_s": round(planned.load_s, 2),
            "save_vs_plan": round(saved / planned.save_s, 3),
            "load_vs_plan": round(loaded / planned.load_s, 3),
            "lora_rank": config.lora_rank,
        })
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(root / "run", ignore_errors=True)
    del model, optimizer
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = init_distributed()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if args.rates_gb and env.rank == 0:
        print(json.dumps(machine_rates(env.device, root, args.rates_gb)), flush=True)
    for spec in args.models.split(","):
        measure(spec, env, root, not args.no_async)
    shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
