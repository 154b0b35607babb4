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
    """Read against the tokens: every restart inside a row starts the next instruction in order
    (its tokens follow), and every instruction's start is a restart or a row's end cuts it."""
    a = args("demo")
    tokens = bench_batches(32000, a, torch.device("cpu")).flatten()
    positions = bench_positions(32000, a, torch.device("cpu"))
    assert positions.shape[:-1] == bench_batches(32000, a, torch.device("cpu")).shape[:-1]
    restart = restarts(positions).flatten()
    documents = demo_documents(32000, a.seed)
    offset, index, seen = 0, 0, 0
    while offset < len(tokens):
        document = documents[index % len(documents)]
        piece = tokens[offset:offset + len(document)].tolist()
        assert piece == document[:len(piece)]
        assert restart[offset]  # each instruction starts a document
        inside = restart[offset + 1:offset + len(document)].nonzero().flatten() + offset + 1
        assert all(int(i) % a.seq_len == 0 for i in inside)  # only a row's start cuts one
        offset, index, seen = offset + len(document), index + 1, seen + 1
    assert seen > len(tokens) // a.seq_len  # several instructions in a row


def test_sdpa_on_bench_packed_rows_gives_each_document_its_loss_alone():
    """The packed rows isolate their documents on sdpa's masked path: the row's summed loss is
    the sum of each document's loss computed on its own (the tokens at a document's start take
    none, as bench.train labels them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_contract.data import IGNORE_INDEX
    from trainer.batch import Batch, packed_documents
    from trainer.loss import LOSS_METHOD, add_loss_method

    a = args("random", seq_len=4096, micro_batch=1)
    positions = bench_positions(256, a, torch.device("cpu"))[0, 0]
    tokens = bench_batches(256, a, torch.device("cpu"))[0, 0]
    labels = tokens.masked_fill(positions == 0, IGNORE_INDEX)
    # Large weights: a random model's loss then depends on the context (at the usual 0.02 it is
    # about log(vocab) whatever the token attends).
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.5)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    add_loss_method(model)
    loss_sum = getattr(model, LOSS_METHOD)
    with torch.no_grad():
        packed = loss_sum(labels, IGNORE_INDEX,
                          **Batch(tokens, labels, tokens.numel(), positions).model_inputs())
        bounds = packed_documents(positions)["cu_seq_lens_q"].tolist()
        assert len(bounds) > 2  # more than one document in the row
        alone = sum(loss_sum(tokens[:, s:e], IGNORE_INDEX, input_ids=tokens[:, s:e])
                    for s, e in zip(bounds[:-1], bounds[1:]))
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


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


def test_a_rerun_spread_is_zero_for_a_repeatable_backward_and_names_the_gradient_that_moved():
    """--attention-check's reruns (fa4's backward again on the same inputs): a bitwise repeat
    reads 0, a moved dk reads its relative move, and the worst run against the reference is
    reported, the first run's included."""
    from bench.train import _rerun_spread

    generator = torch.Generator().manual_seed(0)
    first = [torch.randn(64, 4, 8, generator=generator) for _ in range(3)]
    reference = [g + 1e-3 * torch.randn(g.shape, generator=generator) for g in first]
    same = _rerun_spread(first, [[g.clone() for g in first]] * 2, reference)
    assert same["runs"] == 2 and same["max_rel_diff"] == {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    moved = [first[0], first[1] * 1.01, first[2]]
    spread = _rerun_spread(first, [first, moved], reference)
    assert spread["max_rel_diff"]["dk"] == 0.01 and spread["max_rel_diff"]["dq"] == 0.0
    assert spread["max_rel_error"]["dk"] > same["max_rel_error"]["dk"] > 0
