"""bench.train --packing: the position ids it packs documents with (no subprocess: fast)."""

import argparse

import torch

from bench.train import DOCUMENT_TOKENS, bench_batches, bench_positions, demo_documents


def args(tokens: str, **overrides) -> argparse.Namespace:
    values = {"warmup": 1, "steps": 2, "grad_accum": 2, "micro_batch": 2, "seq_len": 256,
              "seed": 7, "tokens": tokens, "packing": True, **overrides}
    return argparse.Namespace(**values)


def restarts(positions: torch.Tensor) -> torch.Tensor:
    """Where each row's positions go back to 0 (the first column always does)."""
    rows = positions.reshape(-1, positions.shape[-1])
    consecutive = rows[:, 1:] == rows[:, :-1] + 1
    assert bool((consecutive | (rows[:, 1:] == 0)).all()), "a position neither follows nor restarts"
    assert bool((rows[:, 0] == 0).all()), "a row starts mid-document"
    return rows == 0


def test_packed_demo_rows_restart_positions_exactly_where_an_instruction_starts():
    a = args("demo")
    tokens = bench_batches(32000, a, torch.device("cpu"))
    positions = bench_positions(32000, a, torch.device("cpu"))
    assert positions.shape == tokens.shape
    lengths = [len(document) for document in demo_documents(32000, a.seed)]
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    expected = starts.repeat(-(-tokens.numel() // len(starts)))[:tokens.numel()]
    expected = expected.view(-1, a.seq_len)
    expected[:, 0] = True  # a document cut by a row's end goes on from 0 in the next row
    assert torch.equal(restarts(positions), expected)
    assert int(expected.sum()) > expected.shape[0]  # several instructions in a row


def test_packed_random_rows_hold_documents_of_the_drawn_lengths():
    a = args("random", seq_len=4096)
    positions = bench_positions(32000, a, torch.device("cpu"))
    lengths = torch.diff(restarts(positions).flatten().nonzero().flatten())
    # Whole documents (those not cut by a row's end) are within the drawn bounds.
    whole = lengths[(lengths >= DOCUMENT_TOKENS[0])]
    assert len(whole) > 0.8 * len(lengths)
    assert int(lengths.max()) <= DOCUMENT_TOKENS[1]


def test_without_packing_there_are_no_positions():
    assert bench_positions(32000, args("random", packing=False), torch.device("cpu")) is None


def test_packed_rows_count_the_attention_flops_of_their_documents_only():
    from bench.train import attended_keys

    # Documents of 2 and 6 tokens: (4 + 36) / 8 keys per query; one row of 8: 8.
    assert attended_keys(torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]])) == 5.0
    assert attended_keys(torch.arange(8)[None]) == 8.0
