"""The benchmark's token ids (bench.train.bench_batches): random, or the demo instructions."""

import json

import pytest
from tokenizers import Tokenizer

from bench.train import bench_batches, parse_args
from trainer.demo import DEMO_DATASET, DEMO_TOKENIZER


def _args(*more: str):
    return parse_args(["--models", "tiny-llama", "--seq-len", "64", "--micro-batch", "2",
                       "--steps", "3", "--warmup", "1", *more])


def test_demo_tokens_are_the_demo_instructions_packed_in_the_seeds_order_and_repeated():
    import torch

    args = _args("--tokens", "demo", "--grad-accum", "2")
    batches = bench_batches(725, args, torch.device("cpu"))
    assert batches.shape == (4, 2, 2, 64)
    assert torch.equal(batches, bench_batches(725, args, torch.device("cpu")))  # the same each run
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    rows = [json.loads(line) for line in DEMO_DATASET.read_text().splitlines() if line]
    text = tokenizer.decode(batches.flatten().tolist())
    # whole rows, end to end: the first tokens decode to some row's prompt
    assert sum(row["prompt"] in text for row in rows) >= 10
    other = bench_batches(725, _args("--tokens", "demo", "--seed", "7"), torch.device("cpu"))
    assert not torch.equal(other.flatten()[:256], batches.flatten()[:256])  # another order


def test_demo_tokens_refuse_a_model_whose_vocabulary_is_smaller_than_the_tokenizers():
    import torch

    with pytest.raises(ValueError, match="725 ids exceed the model's vocabulary of 100"):
        bench_batches(100, _args("--tokens", "demo"), torch.device("cpu"))


def test_random_tokens_stay_the_default():
    import torch

    batches = bench_batches(50, _args(), torch.device("cpu"))
    assert batches.shape == (4, 1, 2, 64) and int(batches.max()) < 50
