"""How fast QLoRA's NF4 weights dequantize on the GPU, compiled: `python -m bench.dequant`.

A 4-bit weight is dequantized in forward and again in backward (trainer/lora.py), so a step
dequantizes every weight of an 8B model two or three times. This times that for 8B's weight
shapes as the trainer runs it (torchao's `NF4Tensor.to`, compiled), beside a formulation that
looks each byte's two values up at once in a 256-entry table of pairs, and beside a bf16 copy of
the same weight (what the memory moves, at the GPU's bandwidth). Prints a line per shape and way:
microseconds and the bytes read and written a second.
"""

from __future__ import annotations

import argparse

import torch

from trainer.qlora import BLOCK_SIZE, scaler_block_size

SHAPES = {"8b mlp (14336 x 4096)": (14336, 4096), "8b q/o (4096 x 4096)": (4096, 4096),
          "8b k/v (1024 x 4096)": (1024, 4096)}


def pair_table(nf4: torch.Tensor) -> torch.Tensor:
    """(256, 2): a byte's two NF4 values, high nibble first (torchao's packing)."""
    codes = torch.arange(256, device=nf4.device)
    return torch.stack([nf4[codes >> 4], nf4[codes & 15]], dim=-1)


def dequantize_pairs(weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size)
    pairs = table[weight.quantized_data.int()]
    return (pairs.view(-1, weight.block_size) * scalers[:, None]).view(weight.shape)


def timed_us(fn, *args, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    trainer_way = torch.compile(lambda w: w.to(torch.bfloat16))
    pairs_way = torch.compile(dequantize_pairs)
    copy = torch.compile(lambda w: w * 1)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, shape in SHAPES.items():
        full = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        weight = to_nf4(full, BLOCK_SIZE, scaler_block_size(full.numel() // BLOCK_SIZE))
        table = pair_table(weight.nf4.to(torch.bfloat16))
        expected = weight.get_original_weight()
        torch.testing.assert_close(trainer_way(weight), expected)  # bf16 roundings apart
        torch.testing.assert_close(pairs_way(weight, table), expected)
        nf4_bytes = weight.quantized_data.numel() + weight.quantized_scalers.numel()
        moved = nf4_bytes + 2 * full.numel()
        for way, micros, nbytes in [
                ("trainer (torchao .to)", timed_us(trainer_way, weight, iters=args.iters), moved),
                ("pair table", timed_us(pairs_way, weight, table, iters=args.iters), moved),
                ("bf16 copy", timed_us(copy, full, iters=args.iters), 4 * full.numel())]:
            print(f"{name:24s} {way:22s} {micros:8.1f} us  {nbytes / micros / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
